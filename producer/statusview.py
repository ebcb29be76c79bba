"""The terminal view of ``python -m producer status``: progress, workers, failures (rich renderables).

Pure functions of the status dict that :mod:`producer.status` builds, so the view can be tested
without a run.
"""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from producer.words import fmt_bytes, noun, plural


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


def _planning_rows(t: Table, status: dict) -> None:
    """What a plan still being written holds so far, and how fast the dataset is read."""
    p = status.get("planning") or {}
    planner = status.get("planner") or {}
    who = (f"pid {planner.get('pid')} on {planner.get('host')}, since {planner.get('started_at')}"
           if planner.get("pid") else "")
    failed = status["state"] == "plan_failed"
    if p.get("windows"):
        records = f", {p['records_read']:,} records read" if p.get("records_read") is not None else ""
        t.add_row("planned", f"{plural(p['windows'], 'window')} written{' before it stopped' if failed else ''}: "
                             f"{plural(p['samples'], 'sample')} in {plural(p['batches'], 'batch')}, enqueued as "
                             f"written{records}")
    elif not failed:
        t.add_row("planning", "tokenising the first window: no batch planned yet" + (f" ({who})" if who else ""))
    read = []
    if p.get("records_total") and p.get("records_read") is not None:
        read.append(f"{p['records_read']:,} / {p['records_total']:,} records")
    if p.get("bytes_total") and p.get("bytes_read") is not None:
        read.append(f"{fmt_bytes(p['bytes_read'])} / {fmt_bytes(p['bytes_total'])}")
    elif p.get("bytes_read"):
        read.append(f"{fmt_bytes(p['bytes_read'])} (total not known)")
    rates = [f"{fmt_bytes(p['bytes_per_s'])}/s" if p.get("bytes_per_s") else "",
             f"{p['records_per_s']:,.0f} records/s" if p.get("records_per_s") else "",
             plural(p["num_proc"], "process", "processes") if p.get("num_proc") else ""]
    rates = [r for r in rates if r]
    if read or rates:
        pct = f" ({p['percent']:.1f}%)" if p.get("percent") is not None else ""
        t.add_row("read", ", ".join(read) + pct + (f" at {', '.join(rates)}" if rates else ""))
    if p.get("windows") and not failed:
        age = f"last window {fmt_duration(p['updated_age_s'])} ago" if p.get("updated_age_s") is not None else ""
        t.add_row("planner", "; ".join(x for x in (who, age, f"planning eta {fmt_duration(p.get('eta_s'))}") if x))


def progress_table(status: dict) -> Table:
    """The run's totals: state, a bar of batches done, samples, tokens, rate, ETA, skips; while the plan
    is written, the planning's progress and the batches planned so far."""
    t = Table(title=f"run {status['run_id']}", show_header=False, title_justify="left", box=None, padding=(0, 1))
    t.add_column(style="bold", no_wrap=True)
    t.add_column(overflow="fold")  # a long address wraps whole rather than ending in "…" at 80 columns
    total, done = status["batches_total"], status["batches_done"]
    state = status["state"]
    state_style = {"done": "green", "failed": "red", "plan_failed": "red", "running": "cyan", "stalled": "yellow",
                   "planning": "yellow", "cancelled": "yellow", "queued": "yellow"}.get(state, "")
    # A Ctrl-C while planning is a stop the same command resumes, not an error: said in yellow
    stopped = state == "plan_failed" and str(status.get("plan_error") or "").startswith("interrupted")
    t.add_row("state", Text(state + (" (stopped by you: resumable)" if stopped else ""),
                            style="yellow" if stopped else state_style))
    cancelled = status.get("cancelled")
    if cancelled and state == "cancelled":
        now = "; --now: running batches stop before their marker" if cancelled.get("now") else \
            "; running batches finish"
        t.add_row("cancelled", Text(f"by {cancelled.get('by')} at {cancelled.get('at')}{now}", style="yellow"))
        t.add_row("to resume", Text(status.get("resume") or ""))
    bad = status.get("markers_unreadable") or []
    if bad:  # counted done (their batches are not sent again), but nothing certifies their shards
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5:,} more" if len(bad) > 5 else "")
        run = status["address"]
        t.add_row("damaged", Text(f"{plural(len(bad), 'marker')} that do not parse ({shown}): counted done, their "
                                  f"shards not certified; python -m producer verify {run}, then python -m producer "
                                  f"reconcile {run} --repair and the same run command", style="red"))
    if status.get("stalled_reason"):
        queued = state == "queued"
        t.add_row("waiting" if queued else "stalled", Text(status["stalled_reason"], style="yellow"))
        t.add_row("to start" if queued else "to restart", Text(status.get("restart") or ""))
    for w in status.get("lease_wait") or []:
        back = f"in about {fmt_duration(w['back_in_s'])}" if w.get("back_in_s") else "soon"
        t.add_row("reclaim", Text(f"{w['worker']} (lost) held {plural(len(w['batches']), 'batch')} of the run: a live "
                                  f"worker puts them back on the queue when its lease (HSX_LEASE_S) ends, {back}; "
                                  "nothing to do", style="yellow"))
    for g in status.get("parked") or []:
        # the reason whole (the worker bounds it): cut at a fixed length it ended mid-word
        t.add_row("parked", Text(f"{plural(len(g['batches']), 'batch')}: {g['reason']}", style="yellow"))
        t.add_row("fix", Text(g["fix"]))
    for r in status.get("workers") or []:
        if r.get("paused") and r.get("online"):
            t.add_row("paused", Text(f"{_who(r)}: paused: {r['paused']}", style="yellow"))
    t.add_row("address", Text(status["address"]))
    t.add_row("model", Text(status["model"]))
    streaming = status.get("planning") is not None  # the plan is still written: totals are so far
    if state == "plan_failed":
        t.add_row("planning", Text(f"did not finish: {status.get('plan_error')}",
                                   style="yellow" if stopped else "red"))
        command = (status.get("planner") or {}).get("command") or "the same `python -m producer run` / `enqueue` command"
        windows = (status.get("planning") or {}).get("windows")
        after = f"it resumes after the {plural(windows, 'window')} written" if windows else "it plans the run from the start"
        t.add_row("to resume", Text(f"run {command} again: {after}"))
    if streaming:
        _planning_rows(t, status)
    if status["planned"] or total:
        so_far = " planned so far" if streaming else ""
        pct = 100 * done / total if total else 0.0
        bar = Table.grid(padding=(0, 1))
        bar.add_row(ProgressBar(total=max(total, 1), completed=done, width=40),
                    Text(f"{done:,} / {total:,} {noun(total, 'batch')}{so_far} ({pct:.1f}%)"))
        t.add_row("progress", bar)
        t.add_row("samples", f"{status['samples_done']:,} / {status['samples_total']:,}{so_far}"
                  + (f"  ({status['samples_quarantined']:,} quarantined)" if status["samples_quarantined"] else ""))
        estimated = (status.get("planning") or {}).get("tokens_estimated")
        t.add_row("tokens", f"{status['tokens_done']:,} / {status['tokens_total']:,}{so_far}"
                  + (f" (about {estimated:,} in all)" if streaming and estimated else "")
                  + (" in the conversations as given" if status.get("regenerate") else ""))
        if status.get("regenerate"):
            t.add_row("generated", f"{status.get('tokens_generated') or 0:,} tokens generated by the target")
        if status.get("bytes_stored"):
            t.add_row("stored", f"{fmt_bytes(status['bytes_stored'])} in shards; longest batch "
                                f"{fmt_duration(status.get('batch_seconds_max'))}")
        samples_s = f", {status['samples_per_s']:,.1f} samples/s" if status.get("samples_per_s") else ""
        if status.get("regenerate"):  # what a regenerate run makes is answers: its rate is generated tokens
            samples_s = f", {status['samples_per_s']:,.1f} conversations/s" if status.get("samples_per_s") else ""
            status = dict(status, tokens_per_s=status.get("generated_tokens_per_s"),
                          overall_tokens_per_s=status.get("overall_generated_tokens_per_s"))
        unit = "generated tok/s" if status.get("regenerate") else "tok/s"
        if state == "done":
            t.add_row("rate", f"{_rate(status['overall_tokens_per_s'], unit)}{samples_s} (first batch to last)")
        else:
            window = status.get("rate_window_s")
            recent = (f"{_rate(status['tokens_per_s'], unit)} over the last {fmt_duration(window)}" if window
                      else "- (a rate needs two batches done)")
            if state in ("stalled", "cancelled", "failed", "plan_failed") and status.get("overall_tokens_per_s"):
                recent = "none now (nothing runs it)"  # the recent window would only decay as the stop ages
                samples_s = ""  # the recent samples/s decays the same way: only the overall rate means anything
            t.add_row("rate", f"{recent}{samples_s}, {_rate(status['overall_tokens_per_s'], unit)} overall")
        if state == "done":
            t.add_row("eta", "done")
        elif state not in ("plan_failed", "failed", "cancelled"):  # nothing will finish them: no time to give
            t.add_row("eta", fmt_duration(status["eta_s"]) + (" (planning and extraction)" if streaming else ""))
    if status["skipped"]:
        t.add_row("skipped", ", ".join(f"{k} {v:,}" for k, v in status["skipped"].items()) + " (at planning)")
    broker = status.get("broker")
    if broker and not (broker.get("error") and state == "done"):  # a finished `producer run` stopped its broker
        if broker.get("error"):
            t.add_row("broker", Text(f"{broker['url']}: {broker['error']}", style="red"))
        else:
            q = broker.get("queue") or {}
            t.add_row("queue", f"{q.get('waiting', 0):,} waiting, {q.get('claimed', 0):,} claimed on '{broker['queue_name']}' "
                               f"(all runs on {broker['url']})")
            nh = broker.get("not_held") or {}
            if nh.get("count"):
                t.add_row("claims", Text("of this run, " + not_held_text(nh, done=nh.get("done")), style="yellow"))
    t.add_row("failures", Text(str(status["batches_failed"]), style="red" if status["batches_failed"] else ""))
    return t


#: The workers table's columns (name, justify). Every header is shown whole (``min_width``) and every
#: cell wraps or folds instead of ending in "…": at 80 columns a table of ten no-wrap columns cut its
#: headers to ``work…`` / ``dev…`` and squeezed the note to nothing (issue 22, item 7). So the GPU
#: readings are lines of the device cell, each running batch a line of its own, and a row's note
#: (why it is paused, how it died) a line under the table, where it has the full width.
WORKER_COLUMNS = (("worker", "left"), ("device", "left"), ("batch", "left"), ("tok/s", "right"),
                  ("batches", "right"), ("heartbeat", "left"))


def _who(r: dict) -> str:
    """A worker row's name: :func:`hsx.fleet.worker_label` (``cpu0@vm pid 7197``), as every view names it."""
    from hsx.fleet import worker_label

    return r.get("label") or worker_label(r.get("name"), r.get("host"), r.get("pid"))


def _batch_cell(r: dict) -> str:
    """The batches a worker runs, one a line; for a dead one, those it held when it died, said so."""
    if r.get("held_at_death"):
        return "when it died:\n" + "\n".join(r["held_at_death"])
    return "\n".join(map(str, r.get("running") or [])) or "-"


def _device_cell(r: dict) -> str:
    """The device, then the GPU's readings (utilisation, memory, temperature and power), one line each."""
    gpu = r.get("gpu") or {}
    lines = [gpu.get("name") or r.get("device") or ("no GPU" if r.get("no_gpu") else "-")]
    if gpu.get("utilization_pct") is not None:
        lines.append(f"{gpu['utilization_pct']}% util")
    if gpu.get("memory_total_bytes"):
        lines.append(f"{fmt_bytes(gpu.get('memory_used_bytes'))} / {fmt_bytes(gpu.get('memory_total_bytes'))}")
    temp = " ".join(x for x in (f"{gpu['temperature_c']}C" if gpu.get("temperature_c") is not None else "",
                                f"{gpu['power_w']:.0f}W" if gpu.get("power_w") is not None else "") if x)
    if temp:
        lines.append(temp)
    return "\n".join(lines)


def workers_table(status: dict) -> RenderableType:
    """One row per worker process: worker, device with its GPU readings, running batches, tokens/s,
    batches done, state and heartbeat age; under the table, each paused or dead worker's note.
    Readable at 80 columns: no header is cut and no cell ends in an ellipsis (:data:`WORKER_COLUMNS`)."""
    rows = status["workers"]
    if not rows:
        if status.get("broker"):
            hint = ""
        elif status.get("run_broker") == "embedded":  # no HSX_BROKER_URL to set: its `producer run` is asked while it runs
            hint = " (a `python -m producer run` starts its own workers; they are asked while it runs)"
        else:
            hint = " (set HSX_BROKER_URL to ask the workers for live GPU stats)"
        return Text(f"no workers seen yet{hint}", style="dim")
    t = Table(title="workers", title_justify="left")
    for name, justify in WORKER_COLUMNS:
        t.add_column(name, justify=justify, min_width=len(name), overflow="fold")
    notes: list[Text] = []
    for r in rows:
        who = _who(r)
        beat = "-" if r.get("heartbeat_age_s") is None else f"{fmt_duration(r['heartbeat_age_s'])} ago"
        if r.get("state") == "loading" and r.get("loading_s") is not None:
            beat = f"loading the target ({fmt_duration(r['loading_s'])}), {beat}"
        elif r.get("state"):
            beat = f"{r['state']}, {beat}"
        style = "dim" if r.get("online") is False else ""
        t.add_row(who, _device_cell(r), _batch_cell(r),
                  _rate(r.get("generated_tokens_per_s" if "generated_tokens_per_s" in r else "tokens_per_s"), ""),
                  f"{r.get('batches_done', 0):,}", beat, style=style)
        if r.get("paused"):
            notes.append(Text(f"{who}: paused: {r['paused']}", style="yellow"))
        elif r.get("exit"):
            notes.append(Text(f"{who}: {r['exit']}", style="red"))
    return Group(t, *notes) if notes else t


#: Characters of a failed batch's error that the failures table shows (``status --json`` has all of it).
FAILURE_CHARS = 300


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
        error = str(f.get("error", "?"))
        if len(error) > FAILURE_CHARS:  # said as cut: an error that simply stopped read as the whole of it
            error = error[:FAILURE_CHARS] + " ... (cut; --json has it whole)"
        t.add_row(batch, str(f.get("host", "-")), str(f.get("at", "-")), Text(error))
    if len(failures) > limit:
        t.caption = f"... and {len(failures) - limit} more (--json lists them all)"
    return t


def not_held_text(nh: dict, done: int | None = None) -> str:
    """What the claims no live worker holds are, and what brings each kind back (``not_held`` of
    ``producer/fleetview.py``); ``done``: how many of them are of batches whose marker exists."""
    parts = []
    for w in nh["lost_workers"]:
        when = f"in about {fmt_duration(w['back_in_s'])}" if w["back_in_s"] > 0 else "now (its lease has ended)"
        parts.append(f"{w['claims']:,} of lost worker {w['label']}: a live worker puts them back when its lease "
                     f"(HSX_LEASE_S) ends, {when}")
    if nh["stopped"]:
        parts.append(f"{nh['stopped']:,} of workers that stopped: a live worker puts them back at its next look")
    if nh["unlisted"]:
        parts.append(f"{nh['unlisted']:,} listed by no worker (acks lost when the broker restarted, or a worker that "
                     "died as it took them): a live worker that serves the run puts them back, or drops those whose "
                     f"batch is done, {fmt_duration(nh['lease_s'])} (HSX_LEASE_S) after it first sees them")
    if done:
        parts.append(f"{done:,} of them {'is' if done == 1 else 'are'} of batches already done: nothing is redone")
    if nh.get("visibility_at"):
        first, last = nh["visibility_at"], nh.get("visibility_last_at") or nh["visibility_at"]
        parts.append(f"with no live worker, the broker's visibility timeout (HSX_VISIBILITY_TIMEOUT_S, "
                     f"{fmt_duration(nh['visibility_timeout_s'])}) returns them to the queue at "
                     + (first if first == last else f"{first} to {last}") + " (the delivering workers' clocks)")
    return f"{nh['count']:,} claimed by no live worker: " + "; ".join(parts)


def _held_at_death(w: dict) -> str:
    """A dead worker's last listed tasks: not held now; each put back or finished since, unless still claimed."""
    tasks = w.get("held_at_death") or []
    if not tasks:
        return "-"
    shown = [f"{t['run_url'].rstrip('/').rsplit('/', 1)[-1]}/{t['batch']} ({t['phase']}"
             + (", still claimed)" if t.get("still_claimed") else ", put back or done since)") for t in tasks[:6]]
    return "when it died:\n" + "\n".join(shown) + (" ..." if len(tasks) > 6 else "")


def fleet_view(fleet: dict) -> RenderableType:
    """``status`` without a run: the broker's queue, every worker (live, and gone within the hour)
    with its roots, model, state and the tasks it holds, the runs with messages, the parked messages."""
    b = fleet["broker"]
    q = b.get("queue") or {}
    # the broker's address in a row of its own, folded at any character (a title wraps at words: a
    # socket path was cut in its middle)
    head = Table(title="fleet", show_header=False, title_justify="left", box=None, padding=(0, 1))
    head.add_column(style="bold", no_wrap=True)
    head.add_column(overflow="fold")
    head.add_row("broker", b["url"])
    live = [w for w in fleet["workers"] if w["live"]]
    head.add_row("workers", f"{len(live):,} live" + (f", {len(fleet['workers']) - len(live):,} gone in the last hour"
                                                   if len(fleet["workers"]) > len(live) else ""))
    head.add_row("queue", f"'{b['queue_name']}': {q.get('waiting', 0):,} waiting, {q.get('claimed', 0):,} claimed")
    nh = b.get("not_held") or {}
    if nh.get("count"):
        head.add_row("not held", Text(not_held_text(nh), style="yellow"))
    parked_n = sum(p["batches"] for p in fleet["parked"])
    head.add_row("parked", Text(f"{plural(parked_n, 'batch')} of {plural(len(fleet['parked']), 'run')}",
                                style="yellow" if parked_n else ""))
    head.add_row("at", fleet.get("at") or "-")
    parts: list[RenderableType] = [head]
    lost_back = {w["worker"]: w["back_in_s"] for w in nh.get("lost_workers") or []}
    if fleet["workers"]:
        t = Table(title="workers", title_justify="left")
        for name in ("worker", "roots", "model", "state", "tasks", "seen"):
            t.add_column(name, min_width=len(name), overflow="fold")  # whole headers, no "…" at 80 columns
        for w in fleet["workers"]:
            state = w["state"]
            if state == "paused" and w.get("paused_reason"):
                state = f"paused: {w['paused_reason']}" + (f" (for {fmt_duration(w['paused_s'])})" if w.get("paused_s")
                                                           else "")
            elif state == "loading" and w.get("loading_s") is not None:
                state = f"loading the target (for {fmt_duration(w['loading_s'])})"
            elif state == "lost" and w["worker"] in lost_back:
                back = lost_back[w["worker"]]
                state = ("lost: its claims are put back " + (f"in about {fmt_duration(back)}" if back > 0 else "now")
                         + " (its lease)")
            if w["live"]:
                # a line each: joined by commas, a narrow terminal folded ``run/b000007`` in its middle
                tasks = "\n".join(f"{t['run_url'].rstrip('/').rsplit('/', 1)[-1]}/{t['batch']} ({t['phase']})"
                                   for t in w["tasks"][:6]) + ("\n..." if len(w["tasks"]) > 6 else "")
            else:
                tasks = _held_at_death(w)
            style = "" if w["live"] else "dim"
            who = w.get("label") or w["worker"]
            t.add_row(who, "\n".join(w.get("roots") or []) or "-", w.get("model") or "(the run's)",
                      Text(state, style="yellow" if w["state"] == "paused" else ""), tasks or "-",
                      f"{fmt_duration(w['age_s'])} ago", style=style)
        parts.append(t)
    else:
        parts.append(Text("no worker has written its presence on this broker in the last hour", style="dim"))
    if fleet["runs"]:
        t = Table(title="runs", title_justify="left")
        columns = [("run", "left"), ("queued", "right"), ("held", "right"), ("parked", "right")]
        not_held_col = any(r.get("not_held") for r in fleet["runs"])
        if not_held_col:
            columns.append(("not held", "right"))
        for name, justify in columns:
            t.add_column(name, justify=justify)
        for r in fleet["runs"][:50]:
            cells = [r["address"], f"{r['queued']:,}", f"{r['held']:,}",
                     Text(f"{r['parked']:,}", style="yellow" if r["parked"] else "")]
            if not_held_col:
                cells.append(Text(f"{r.get('not_held', 0):,}", style="yellow" if r.get("not_held") else ""))
            t.add_row(*cells)
        if len(fleet["runs"]) > 50:
            t.caption = f"... and {len(fleet['runs']) - 50} more (--json lists them all)"
        parts.append(t)
    for p in fleet["parked"]:
        t = Table(title=f"parked: {p['run_url']}", title_justify="left", show_header=False)
        t.add_column(style="bold")
        t.add_column()
        for g in p["groups"]:
            # the reason whole (the worker bounds it): cut at a fixed length it ended mid-word
            t.add_row("parked", Text(f"{plural(len(g['batches']), 'batch')}: {g['reason']}", style="yellow"))
            t.add_row("by", ", ".join(g["refused_by"]) or "-")
            t.add_row("fix", g["fix"])
        parts.append(t)
    return Group(*parts)


def status_view(status: dict) -> RenderableType:
    """The whole view: progress, workers, failures."""
    parts: list[RenderableType] = [progress_table(status), workers_table(status)]
    failures = failures_table(status)
    if failures is not None:
        parts.append(failures)
    return Group(*parts)
