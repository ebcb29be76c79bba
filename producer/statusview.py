"""The terminal view of ``python -m producer status``: progress, workers, failures (rich renderables).

Pure functions of the status dict that :mod:`producer.status` builds, so the view can be tested
without a run.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from producer.words import fmt_bytes, noun


def fmt_duration(seconds: float | None) -> str:
    """``1h02m``, ``4m05s``, ``12s``, ``0.3s``; ``-`` for None."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds:.1f}s"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def _rate(value: float | None, unit: str = "tok/s") -> str:
    return "-" if value is None else f"{value:,.0f} {unit}"


def progress_table(status: dict) -> Table:
    """The run's totals: state, a bar of batches done, samples, tokens, rate, ETA, skips."""
    t = Table(title=f"run {status['run_id']}", show_header=False, title_justify="left", box=None, padding=(0, 1))
    t.add_column(style="bold")
    t.add_column()
    total, done = status["batches_total"], status["batches_done"]
    state_style = {"done": "green", "failed": "red", "plan_failed": "red", "running": "cyan", "stalled": "yellow",
                   "planning": "yellow"}.get(status["state"], "")
    t.add_row("state", Text(status["state"], style=state_style))
    if status.get("stalled_reason"):
        t.add_row("stalled", Text(status["stalled_reason"], style="yellow"))
        t.add_row("to restart", Text(status.get("restart") or ""))
    t.add_row("address", Text(status["address"]))
    t.add_row("model", Text(status["model"]))
    if status["planned"]:
        pct = 100 * done / total if total else 0.0
        bar = Table.grid(padding=(0, 1))
        bar.add_row(ProgressBar(total=max(total, 1), completed=done, width=40),
                    Text(f"{done:,} / {total:,} {noun(total, 'batch')} ({pct:.1f}%)"))
        t.add_row("progress", bar)
        t.add_row("samples", f"{status['samples_done']:,} / {status['samples_total']:,}"
                  + (f"  ({status['samples_quarantined']:,} quarantined)" if status["samples_quarantined"] else ""))
        t.add_row("tokens", f"{status['tokens_done']:,} / {status['tokens_total']:,}")
        if status.get("bytes_stored"):
            t.add_row("stored", f"{fmt_bytes(status['bytes_stored'])} in shards; longest batch "
                                f"{fmt_duration(status.get('batch_seconds_max'))}")
        samples_s = f", {status['samples_per_s']:,.1f} samples/s" if status.get("samples_per_s") else ""
        if status["state"] == "done":
            t.add_row("rate", f"{_rate(status['overall_tokens_per_s'])}{samples_s} (first batch to last)")
        else:
            window = status.get("rate_window_s")
            recent = (f"{_rate(status['tokens_per_s'])} over the last {fmt_duration(window)}" if window
                      else "- (a rate needs two batches done)")
            t.add_row("rate", f"{recent}{samples_s}, {_rate(status['overall_tokens_per_s'])} overall")
        t.add_row("eta", fmt_duration(status["eta_s"]) if status["state"] != "done" else "done")
    elif status["state"] == "plan_failed":
        t.add_row("progress", Text(f"planning did not finish: {status.get('plan_error')}", style="red"))
        command = (status.get("planner") or {}).get("command") or "the same `python -m producer run` / `enqueue` command"
        t.add_row("to resume", Text(f"run {command} again: it plans the run from the start"))
    else:
        planner = status.get("planner") or {}
        who = (f" (pid {planner.get('pid')} on {planner.get('host')}, since {planner.get('started_at')})"
               if planner.get("pid") else "")
        t.add_row("progress", f"planning: the batch list is not written yet{who}")
    if status["skipped"]:
        t.add_row("skipped", ", ".join(f"{k} {v:,}" for k, v in status["skipped"].items()) + " (at planning)")
    broker = status.get("broker")
    if broker:
        if broker.get("error"):
            t.add_row("broker", Text(f"{broker['url']}: {broker['error']}", style="red"))
        else:
            q = broker.get("queue") or {}
            t.add_row("queue", f"{q.get('waiting', 0):,} waiting, {q.get('unacked', 0):,} claimed on '{broker['queue_name']}' "
                               f"(all runs on {broker['url']})")
    t.add_row("failures", Text(str(status["batches_failed"]), style="red" if status["batches_failed"] else ""))
    return t


def workers_table(status: dict) -> Table | Text:
    """One row per worker process: host, GPU, utilisation, memory, current batch, tokens/s, heartbeat, paused."""
    rows = status["workers"]
    if not rows:
        hint = "" if status.get("broker") else " (set HSX_BROKER_URL to ask the workers for live GPU stats)"
        return Text(f"no workers seen yet{hint}", style="dim")
    t = Table(title="workers", title_justify="left")
    for name, justify in (("worker", "left"), ("device", "left"), ("util", "right"), ("memory", "right"),
                          ("temp/power", "right"), ("batch", "left"), ("tok/s", "right"), ("batches", "right"),
                          ("heartbeat", "right"), ("paused", "left")):
        t.add_column(name, justify=justify, no_wrap=name != "paused")
    for r in rows:
        gpu = r.get("gpu") or {}
        who = r.get("name") or f"{r.get('host')}:{r.get('pid')}"
        device = gpu.get("name") or r.get("device") or ("no GPU" if r.get("no_gpu") else "-")
        util = f"{gpu['utilization_pct']}%" if gpu.get("utilization_pct") is not None else "-"
        mem = (f"{fmt_bytes(gpu.get('memory_used_bytes'))} / {fmt_bytes(gpu.get('memory_total_bytes'))}"
               if gpu.get("memory_total_bytes") else "-")
        temp = " ".join(x for x in (f"{gpu['temperature_c']}C" if gpu.get("temperature_c") is not None else "",
                                    f"{gpu['power_w']:.0f}W" if gpu.get("power_w") is not None else "") if x) or "-"
        beat = "-" if r.get("heartbeat_age_s") is None else f"{fmt_duration(r['heartbeat_age_s'])} ago"
        if r.get("state"):
            beat = f"{r['state']}, {beat}"
        style = "dim" if r.get("online") is False else ""
        t.add_row(who, device, util, mem, temp, ", ".join(map(str, r.get("running") or [])) or "-",
                  _rate(r.get("tokens_per_s"), ""), f"{r.get('batches_done', 0):,}", beat,
                  Text(f"refusing tasks: {r['refusing']}", style="red") if r.get("refusing")
                  else Text(r["paused"], style="yellow") if r.get("paused") else "-", style=style)
    return t


def failures_table(status: dict, limit: int = 20) -> Table | None:
    """The batches that failed and have no marker, with the last error of each; None when there are none."""
    failures = status["failures"]
    if not failures:
        return None
    t = Table(title=f"failures ({len(failures)})", title_justify="left")
    t.add_column("batch", no_wrap=True)
    t.add_column("host", no_wrap=True)
    t.add_column("at", no_wrap=True)
    t.add_column("reason", style="red")
    for batch, f in sorted(failures.items())[:limit]:
        t.add_row(batch, str(f.get("host", "-")), str(f.get("at", "-")), Text(str(f.get("error", "?"))[:300]))
    if len(failures) > limit:
        t.caption = f"... and {len(failures) - limit} more (--json lists them all)"
    return t


def status_view(status: dict) -> RenderableType:
    """The whole view: progress, workers, failures."""
    parts: list[RenderableType] = [progress_table(status), workers_table(status)]
    failures = failures_table(status)
    if failures is not None:
        parts.append(failures)
    return Group(*parts)
