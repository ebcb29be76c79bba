"""A run's progress: batches, samples and tokens done, rate, ETA, workers, failures.

Everything about the run itself comes from the store (plan, markers, failure records, the
workers' heartbeat files, ``cancelled.json``), so ``status`` works from any machine that can read
the store, with no broker. When a broker URL is known, the worker rows also get the workers'
presences on the broker (``hsx/fleet.py``: state, pause reason, the tasks each holds, written
even when the store cannot take a status record) and what each worker process answers to the
``gpu_stats`` inspect command (GPU utilisation, memory, temperature, power, clocks, its recent
tokens/s; see ``workers/monitor.py``); the run gets its parked messages (``parked``, grouped by
reason with the fix: ``producer/fleetview.py``) and the queue's length.

Where a worker row's fields come from, in order of precedence:

| source | what | when |
|---|---|---|
| presence (``hsx:<queue>:workers``) | online, state (working, paused with the reason: a full store, the spool; loading its target at its start, since when; idle), the batches of this run it holds with their phase, Celery node name | a broker is known and the presence was written within :data:`HEARTBEAT_STALE_BEATS` heartbeats; the worker serves the run's root or holds a batch of it |
| ``gpu_stats`` reply | GPU readings, recent tokens/s | a broker URL is known and the worker answers within ``HSX_INSPECT_TIMEOUT_S`` |
| ``<run>/workers/<host>-<pid>.json`` (``workers/heartbeat.py``) | state (working, paused, idle, stopped), the batches in progress with their phase, why it is paused (spool backpressure, a full store), spool use, last heartbeat | the worker served a batch of this run |
| markers | batches and tokens it certified for this run, its tokens/s over the last :data:`RATE_WINDOW_S` | always |

Rows are matched by (host, pid). An idle worker writes one record when it goes idle and no more
for that run, so an old ``idle`` record without a broker says ``idle`` (``online`` null: not
known), never ``stopped``; with a broker its presence says whether it lives.

A run with ``cancelled.json`` (``producer cancel``) and batches left is ``cancelled`` (``cancelled``
holds the record, ``resume`` the command that resumes it), whatever else it would be.

**A run whose plan is still written** (the plan is streamed one window at a time, ``hsx/plan.py``)
is ``planning``: its batches so far are those of the windows written (each window's batches are
enqueued as it is written, so workers extract them meanwhile), and ``batches_total`` /
``samples_total`` / ``tokens_total`` count those so far (``skipped``: the windows' skipped records). ``planning`` (null once the plan is
complete) says how far the planning got, from the windows and ``plan/planning.json``: ``windows``,
``batches`` (= ``batches_enqueued``: the planner hands each window's batches to the queue as it
writes it), ``samples``, ``tokens`` (planned so far), ``records_read`` / ``records_total`` and
``bytes_read`` / ``bytes_total`` of the dataset (a total is null when not known), ``percent`` (of
the records when their total is known, as with ``--limit``, else of the bytes), ``records_per_s`` /
``bytes_per_s`` (since the planning started), ``elapsed_s``, ``updated_at`` / ``updated_age_s``
(when the last window was written), ``num_proc``, ``eta_s`` (the planning alone: the fraction
left at the rate so far, less the time since the last window) and ``tokens_estimated`` (the
plan's tokens, extrapolated from those planned per fraction read). The run's ``eta_s`` then counts
the planning: the larger of the planning's ETA and the estimated tokens not done over the current
extraction rate (null before a rate). A planner that failed (or whose process on this host is
gone) makes the run ``plan_failed``, with the windows it wrote. While the planner writes windows,
idle workers are not a stall (they wait for the next window): the run is ``stalled`` only when
planned batches are left, no live worker works on them, and no window came for
:data:`PLANNING_STALL_GRACE_S`.
"""

from __future__ import annotations

from hsx.times import unix_seconds as _ts

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

from hsx.layout import PLAN_WINDOWS_PREFIX, marker_key, names_under
from hsx.processes import pid_alive, pid_namespace
from hsx.plan import plan_complete, planning_failed, read_batch_list, read_planning_record
from hsx.records import (BatchSummary, Cancelled, Marker, Planning, PlanWindow, Stats, WorkerStatus, done_batches, read_failures,
                         read_heartbeats)
from hsx.runconfig import load_run
from hsx.store import MissingKey, Store, exists, mask_url
from producer.words import plural

#: Seconds of recent markers the current rate (and the ETA) is measured over (at least the last
#: RATE_MIN_MARKERS markers, whenever they came).
RATE_WINDOW_S = 120.0
RATE_MIN_MARKERS = 4


def recent_window(arrivals: list[tuple[float, float]], now: float, window_s: float = RATE_WINDOW_S,
                  min_markers: int = RATE_MIN_MARKERS) -> tuple[float | None, float | None]:
    """``(units per second, seconds measured over)`` at which markers arrive now, from ``(arrival time, units)``.

    The markers of the last ``window_s`` seconds (at least the last ``min_markers``): the units of
    every marker after the first, over the time from the first to ``now``. The first one only
    opens the window: its work began before it, with the model load and the warm-up for a worker's
    first batch, which an average from the start of the run would count (a 27B run showed 3,620
    tok/s that way while its steady rate was 7,900). Measured up to ``now``, so a run that stalls
    shows a falling rate. The seconds are the span actually measured (less than ``window_s`` early
    in a run). ``(None, None)`` with fewer than two markers.
    """
    arrivals = sorted(arrivals)
    recent = [a for a in arrivals if a[0] >= now - window_s]
    if len(recent) < min_markers:
        recent = arrivals[-min_markers:]
    if len(recent) < 2:
        return None, None
    span = max(now, recent[-1][0]) - recent[0][0]
    return (sum(u for _, u in recent[1:]) / span, span) if span > 0 else (None, None)


def _span_floor(timed: list[dict]) -> float:
    """The shortest span a rate is taken over: a millisecond when every marker has its
    ``finished_unix``, else a second (``finished_at``'s resolution)."""
    return 0.001 if all(m.get("precise") for m in timed) else 1.0


#: A stretch this long (seconds) with no batch of the run in flight is a stop (Ctrl-C, every worker
#: gone, ``cancel``): the run's overall rate leaves it out, so a run resumed after a night's stop
#: still shows the rate it runs at. Shorter waits (a worker loading, a queue briefly empty) count.
STOPPED_GAP_S = 300.0


def busy_span(timed: list[dict], gap_s: float = STOPPED_GAP_S) -> float:
    """Seconds from the first batch's start to the last one's end, less every stretch longer than
    ``gap_s`` in which no batch was in flight (markers' ``start``/``end``, Unix seconds); at least
    :func:`_span_floor`."""
    spans = sorted((m["start"], m["end"]) for m in timed)
    total, (lo, hi) = 0.0, spans[0]
    for start, end in spans[1:]:
        if start - hi > gap_s:  # nothing ran for a while: the run was stopped
            total, lo = total + (hi - lo), start
        hi = max(hi, end)
    return max(total + (hi - lo), _span_floor(timed))


def recent_rate(arrivals: list[tuple[float, float]], now: float, window_s: float = RATE_WINDOW_S,
                min_markers: int = RATE_MIN_MARKERS) -> float | None:
    """The rate of :func:`recent_window` alone: units per second now, None with fewer than two markers."""
    return recent_window(arrivals, now, window_s, min_markers)[0]


#: A heartbeat record not updated for this many of its intervals is stale (``online: False``),
#: as workers/heartbeat.py defines it.
HEARTBEAT_STALE_BEATS = 3
#: The interval assumed for a record that does not state its ``heartbeat_s``.
HEARTBEAT_DEFAULT_S = 5.0
#: While the plan is written, quiet workers make the run ``stalled`` only once no window came for
#: this long: the batches of a window just written are still being enqueued and picked up, and
#: workers that finished every earlier batch wait, idle, for them.
PLANNING_STALL_GRACE_S = HEARTBEAT_STALE_BEATS * HEARTBEAT_DEFAULT_S

#: Seconds a worker may say ``loading`` (its target loaded and warmed up at its start) before the run
#: is called stalled for it: a first GPU worker compiles its kernels for minutes (a 27B's first node
#: took 134 s from start to ready on an H100, BENCHMARKS.md, "Seventh session"); half an hour is not that.
LOADING_STALL_S = 1800.0
#: threads that read window records.
WINDOW_READ_THREADS = 8


def _iso(ts: float | None) -> str | None:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="seconds") if ts is not None else None


def workers_log_path(settings, run_id: str) -> Path:
    """Where ``producer run`` logs the workers it starts for ``run_id``: that file's presence tells
    ``status`` that the run ran on this machine."""
    return settings.broker_state_dir.parent / "logs" / f"workers-{run_id}.log"


def queue_length(broker_url: str, queue: str, client=None) -> dict:
    """``{"waiting": n, "claimed": m}``: messages in ``queue`` on the broker, and messages claimed by a
    worker and not yet acknowledged (on every queue of the broker: :class:`hsx.brokerlayout.Lengths`).

    Raises whatever redis raises when the broker does not answer.
    """
    from hsx.broker import redis_client
    from hsx.brokerlayout import lengths

    counts = lengths(client if client is not None else redis_client(broker_url), queue)
    return {"waiting": counts.waiting, "claimed": counts.claimed}


class BrokerProbe:
    """Reads the fleet's keys on a broker (presences, parked messages, the queue's length) and asks
    the workers for ``gpu_stats``; one Celery app and one redis client, reused."""

    def __init__(self, settings, broker_url: str):
        from hsx.broker import redis_client
        from hsx.queue import make_celery

        self.settings = settings
        self.broker_url = broker_url
        self.app = make_celery(settings, broker_url, name="hsx-status")
        self.client = redis_client(broker_url)

    def workers(self) -> dict[str, dict]:
        """Celery node name -> its ``gpu_stats`` reply, for every worker that answers in time."""
        replies = self.app.control.broadcast("gpu_stats", reply=True, timeout=self.settings.inspect_timeout_s)
        out = {}
        for reply in replies or []:
            for name, body in reply.items():
                if isinstance(body, dict) and "error" not in body:
                    out[name] = body
        return out

    def poll(self, run_url: str | None = None) -> dict:
        """``{"url", "queue_name", "queue", "now", "presences", "gone", "parked", "not_held", "workers"}``,
        or ``{"url", "queue_name", "error"}`` when the broker does not answer. ``now``: the broker's
        clock; ``presences``: the live workers' (``producer/fleetview.py``), as JSON; ``gone``: the
        presences of workers dead (stale or stopped) within the last hour, as JSON; ``parked``: the
        parked messages of ``run_url`` as JSON (none without it); ``not_held``: the claims of
        ``run_url`` no live worker holds (:func:`producer.fleetview.not_held`; null without it);
        ``workers``: the ``gpu_stats`` replies."""
        from hsx.brokerlayout import claims
        from hsx.fleet import broker_time, read_parked, read_presences
        from producer.fleetview import FLEET_FORGET_S, gone_here, not_held, unheld_claims

        settings, client = self.settings, self.client
        out = {"url": mask_url(self.broker_url), "queue_name": settings.queue}
        try:
            out["queue"] = queue_length(self.broker_url, settings.queue, client)
            # the claims before the presences: a delivery made in between is listed by then (fleetview)
            found = [c for c in claims(client) if c.run_url == run_url] if run_url else []
            now = broker_time(client)
            everyone = read_presences(client, settings.queue)
            live = [p for p in everyone if p.live(now, settings.lease_s) and not gone_here(p)]
            alive = {p.worker for p in live}
            out["now"] = now
            out["presences"] = [p.model_dump() for p in live]
            out["gone"] = [p.model_dump() for p in everyone if p.worker not in alive and now - p.stamp <= FLEET_FORGET_S]
            out["parked"] = ([p.model_dump() for p in read_parked(client, settings.queue, run_url)]
                             if run_url else [])
            out["not_held"] = not_held(unheld_claims(found, everyone, alive), now, settings) if run_url else None
            out["workers"] = self.workers()
        except Exception as exc:
            out["error"] = f"{exc.__class__.__name__}: {exc}"
        return out

    def close(self) -> None:
        self.app.close()
        self.client.close()


def _gpu_row(gpus: list[dict]) -> dict | None:
    if not gpus:
        return None
    g = gpus[0]
    keys = ("index", "name", "utilization_pct", "memory_used_bytes", "memory_total_bytes", "temperature_c", "power_w",
            "power_limit_w", "sm_clock_mhz")
    return {k: g.get(k) for k in keys}


def planning_progress(windows: list[PlanWindow], record: Planning | None, now: float,
                      failed: bool = False) -> dict:
    """How far the planning of a plan still being written got: the ``planning`` object of the
    status (the module docstring lists its fields).

    ``windows``: the windows written so far, in order; ``record``: ``plan/planning.json`` (None:
    absent or unreadable; a failed planner's record may lack the progress fields, which then come
    from the windows alone); ``failed``: the planning will not go on (no ETA).
    """
    rec = record if record is not None else Planning(state="planning")
    last = windows[-1] if windows else None
    batches = sum(len(w.batches) for w in windows)
    # The windows are the truth for what is planned; the record, rewritten just after each window,
    # adds the bytes and the times (and may lag one window behind for a moment).
    records_read = max((n for n in (rec.records_read, last.records_read if last else None) if n is not None), default=None)
    bytes_read, bytes_total, records_total = rec.bytes_read, rec.bytes_total, rec.records_total
    if records_total and records_read is not None:  # exact counts (--limit, --sample): not the file's bytes
        fraction = min(records_read / records_total, 1.0)
    elif bytes_total and bytes_read is not None:
        fraction = min(bytes_read / bytes_total, 1.0)
    else:
        fraction = None
    elapsed = (rec.updated_unix - rec.started_unix) if rec.updated_unix is not None and rec.started_unix is not None else None
    fast = elapsed is not None and elapsed > 0
    tokens = sum(b.num_tokens for w in windows for b in w.batches)
    eta = None
    if fraction and fast and not failed:
        # the fraction left at the rate of the fraction done, less what has passed since the last window
        eta = round(max(elapsed * (1.0 - fraction) / fraction - max(now - rec.updated_unix, 0.0), 0.0), 1)
    return {
        "windows": len(windows),
        "batches": batches,
        "batches_enqueued": batches,
        "samples": sum(w.num_samples for w in windows),
        "tokens": tokens,
        "records_read": records_read,
        "records_total": records_total,
        "bytes_read": bytes_read,
        "bytes_total": bytes_total,
        "percent": round(100.0 * fraction, 1) if fraction is not None else None,
        "records_per_s": round(records_read / elapsed, 1) if fast and records_read is not None else None,
        "bytes_per_s": round(bytes_read / elapsed, 1) if fast and bytes_read is not None else None,
        "elapsed_s": round(elapsed, 1) if elapsed is not None else None,
        "updated_at": rec.updated_at,
        "updated_age_s": round(max(now - rec.updated_unix, 0.0), 1) if rec.updated_unix is not None else None,
        "num_proc": rec.num_proc,
        "eta_s": eta,
        "tokens_estimated": round(tokens / fraction) if fraction and tokens else None,
    }


def _heartbeat_batches(h: WorkerStatus) -> list[str]:
    """``b000003 (forward)`` for each batch a heartbeat record says is in progress."""
    return [f"{b.batch} ({b.phase})" if b.phase else b.batch for b in h.batches]


class RunWatch:
    """Reads a run's progress from its store, remembering the markers it has read (for ``--watch``).

    Args:
        run_store: the run (``<output>/<run_id>``).
        probe: a :class:`BrokerProbe` for worker GPU stats and the queue; None: store only.
        broker: the run's broker as :func:`run_broker` tells it (``"embedded"``, a masked URL, or
            None: not known); the ``restart`` advice of a stalled run depends on it.
        settings: the lease, heartbeat and S3 settings status reads; None: the probe's, else
            ``get_settings()``.
    """

    def __init__(self, run_store: Store, probe: BrokerProbe | None = None, broker: str | None = None,
                 settings=None):
        self.run_store = run_store
        self.probe = probe
        self.broker = broker
        self._settings = settings if settings is not None else probe.settings if probe is not None else None
        self.embedded_live: bool | None = None
        """Whether an embedded broker of a ``producer run`` answers on this machine (None: not asked,
        ``--no-broker``): for a run on the embedded broker that no worker took, queued or stalled."""
        self.config = load_run(run_store)  # MissingKey: no run here
        self.batches: list[BatchSummary] = []
        """The batches planned so far: the batch list once the plan is complete, else the windows'."""
        self.plan_complete = False
        """``plan/batches.json`` was read: ``batches`` is final and not read again."""
        self.windows: list[PlanWindow] = []
        """The plan's windows written so far (while the plan is not complete; empty for runs made before windows)."""
        self._window_cache: dict[str, PlanWindow] = {}  # a window record is written once: read once
        self.stats: Stats | None = None
        self.markers: dict[str, dict] = {}

    @property
    def settings(self):
        """The settings the lease times and the start command are read from (see the class doc)."""
        if self._settings is None:
            from settings import get_settings

            self._settings = get_settings()
        return self._settings

    def _read_marker(self, batch: str) -> dict | None:
        try:
            m = Marker.read(self.run_store, batch)
        except ValueError:  # RecordFormatError: verify reports it
            return None
        if m is None:
            return None
        end = m.finished_unix if m.finished_unix else _ts(m.finished_at)
        seconds = m.seconds or 0.0
        worker = m.worker
        return {
            "samples": m.num_samples,
            "quarantined": m.num_quarantined or 0,
            "tokens": m.num_tokens,
            "planned_tokens": m.num_tokens if m.planned_tokens is None else m.planned_tokens,
            # a regenerate batch's marker counts the tokens the target generated here (hsx.regen.RegenMarker)
            "supervised": m.supervised_tokens or 0,
            "seconds": seconds,
            "bytes": m.shard.bytes,
            "end": end,
            "start": end - seconds if end is not None else None,
            "precise": bool(m.finished_unix),  # milliseconds; finished_at alone has a resolution of one second
            "host": worker.host if worker else None,
            "pid": worker.pid if worker else None,
            "device": worker.device if worker else None,
        }

    def _read_plan(self) -> None:
        """``batches``: the batch list once the plan is complete (read once), else the batches of the
        windows written so far (read again each poll; each window record only once)."""
        store = self.run_store
        if plan_complete(store):
            try:
                self.batches = read_batch_list(store)
            except MissingKey:  # deleted between the two looks: read the windows this time
                pass
            else:
                self.plan_complete, self.windows, self._window_cache = True, [], {}
                try:
                    self.stats = Stats.read(store)
                except ValueError:  # RecordFormatError: the counts of skipped records are only shown
                    self.stats = None
                return
        self.windows = self._read_windows()
        self.batches = [b for w in self.windows for b in w.batches]

    def _read_windows(self) -> list[PlanWindow]:
        """The windows written so far, in order up to the first gap (as :func:`hsx.records.read_windows`),
        reading only the records not read by an earlier poll; a damaged record is left out (``verify`` names it)."""
        store = self.run_store
        names = names_under(store.list(PLAN_WINDOWS_PREFIX), PLAN_WINDOWS_PREFIX)
        new = [n for n in names if n not in self._window_cache]

        def read(name: str) -> PlanWindow | None:
            try:
                return PlanWindow.read(store, name)
            except ValueError:  # RecordFormatError: read it again next time
                return None

        with ThreadPoolExecutor(WINDOW_READ_THREADS) as pool:
            for name, window in zip(new, pool.map(read, new)):
                if window is not None:
                    self._window_cache[name] = window
        out: list[PlanWindow] = []
        for w in sorted(self._window_cache.values(), key=lambda w: w.window):
            if w.window != len(out):
                break
            out.append(w)
        return out

    def poll(self, now: float | None = None) -> dict:
        """The run's status now (the JSON ``status --json`` prints; fields in the README and, for a
        run still planning, the module docstring)."""
        now = time.time() if now is None else now
        store = self.run_store
        planner, plan_error, planning = None, None, None
        if not self.plan_complete:
            self._read_plan()
        by_name = {b.batch: b for b in self.batches}
        done = done_batches(store) & set(by_name)
        for gone in set(self.markers) - done:  # a marker deleted to rerun its batch
            del self.markers[gone]
        new = sorted(done - set(self.markers))
        unreadable: list[str] = []  # markers that exist but do not parse: counted done, their shards not certified
        with ThreadPoolExecutor(16) as pool:
            for batch, m in zip(new, pool.map(self._read_marker, new)):
                if m is not None:
                    self.markers[batch] = m
                elif exists(store, marker_key(batch)):  # not deleted since the listing: damaged
                    unreadable.append(batch)
        failures = read_failures(store, done)

        total = len(by_name)
        tokens_total = sum(b.num_tokens for b in self.batches)
        tokens_done = sum(by_name[b].num_tokens for b in done)
        rate = self._rate(now, finished=self.plan_complete and len(done) == total)
        remaining_tokens = tokens_total - tokens_done
        if self.plan_complete and len(done) == total:
            state, eta = "done", 0.0
            rate["tokens_per_s"] = rate["overall_tokens_per_s"]  # nothing is running: the run's own rate
            rate["samples_per_s"] = rate["overall_samples_per_s"]
        elif not self.plan_complete:
            record = read_planning_record(store)
            plan_error = planning_failed(record)
            planner = record.model_dump(exclude={"schema_version"}) if record is not None else None
            planning = planning_progress(self.windows, record, now, failed=plan_error is not None)
            state = "plan_failed" if plan_error else "planning"
            eta = None if plan_error else self._planning_eta(planning, tokens_done, rate["tokens_per_s"])
        else:
            left = set(by_name) - done
            state = "failed" if left and left <= set(failures) else "running"
            eta = round(remaining_tokens / rate["tokens_per_s"], 1) if rate["tokens_per_s"] else None

        generated = self._generated(now, finished=self.plan_complete and len(done) == total) if self.regenerate else {}
        broker = self.probe.poll(store.url) if self.probe is not None else None
        workers = self._workers(now, broker)
        parked = None
        if broker is not None and "error" not in broker:
            from hsx.fleet import Parked, Presence
            from producer.fleetview import parked_groups

            entries = [Parked.model_validate(p) for p in broker.get("parked") or [] if p.get("batch") not in done]
            known = [Presence.model_validate(p) for p in [*(broker.get("presences") or []), *(broker.get("gone") or [])]]
            parked = parked_groups(entries, store.url, self.config.model_name, presences=known)
        stalled_reason = restart = None
        # While windows keep coming, idle workers wait for the next one: no stall (PLANNING_STALL_GRACE_S).
        quiet_planner = (state == "planning" and len(done) < total and planning["updated_age_s"] is not None
                         and planning["updated_age_s"] > PLANNING_STALL_GRACE_S)
        # A lost worker's batches come back by themselves once its lease ends, if a live worker is there
        # to put them back and take them: until then the run waits, it is not stalled.
        lease_wait = [{"worker": w["label"], "batches": [b for b, _ in w["_held"] if b not in done],
                       "back_in_s": w["reclaim_in_s"]} for w in workers
                      if (w.get("reclaim_in_s") or 0) > 0 and any(b not in done for b, _ in w["_held"])]
        if parked or not any(w["online"] for w in workers) or (self.broker == "embedded" and self.embedded_live is False):
            # parked batches need a fix; no live worker, a start; a `producer run` gone with its broker and workers
            # (a double Ctrl-C): nothing puts them back but the same command again
            lease_wait = []
        if (state == "running" or quiet_planner) and (workers or parked) and not lease_wait \
                and not any(self._works_on_it(w, now) for w in workers):
            # Workers reported (or parked its messages), but no live one works on the run now: no ETA.
            planning_now = state == "planning"
            state, eta = "stalled", None
            stalled_reason, restart = self._stalled(workers, planning=planning_now, parked=parked or [])
        elif state == "running" and not workers and not parked:
            # No worker has ever reported on the run: nothing runs it, whatever the queue holds.
            state, eta = "queued", None
            stalled_reason, restart = self._not_taken(broker)
            if self.broker == "embedded" and self.embedded_live is False:
                state = "stalled"  # its `producer run` is gone: no worker will come for these batches
        cancelled = Cancelled.read(store) if not (self.plan_complete and len(done) == total) else None
        resume = None
        if cancelled is not None:  # `producer cancel`: nothing of it starts until the same command runs again
            state, eta, stalled_reason, restart = "cancelled", None, None, None
            resume = ("run the same `python -m producer run` / `enqueue` command again (the same dataset and "
                      "options give the same run id): it removes cancelled.json and enqueues every batch without a marker"
                      + self._planned_by())
        if state in ("failed", "cancelled", "plan_failed"):
            # Nothing runs it: no ETA, and no current rate (the recent window would only decay); the
            # overall rate stays, as the rate it ran at.
            eta = None
            rate.update(tokens_per_s=None, samples_per_s=None, rate_window_s=None)
            if generated:
                generated["generated_tokens_per_s"] = None
        if state not in ("running", "planning"):
            lease_wait = []
        online = [w for w in workers if w["online"]]
        if eta is not None and online and all(w.get("paused") for w in online):
            eta = None  # every live worker waits (a full store, a full spool): the recent rate says nothing of the rest
        for w in workers:
            w.pop("_held", None)
        broker_out = None
        if broker is not None:
            broker_out = {k: v for k, v in broker.items() if k not in ("workers", "presences", "gone", "parked", "now")}
            if broker_out.get("not_held") is not None:  # of those claims, the batches done since: nothing is redone
                broker_out["not_held"] = dict(broker_out["not_held"], done=sum(
                    1 for _run, b in broker_out["not_held"]["batches"] if b in done))
        if self.stats is not None:
            skipped = self.stats.skipped.counts
        else:  # a plan still written: its windows' counts so far (each window counts its own records)
            skipped = {}
            for w in self.windows:
                for reason, n in w.skipped.counts.items():
                    skipped[reason] = skipped.get(reason, 0) + n
        return {
            "run_id": self.config.run_id,
            "address": store.url,
            "model": self.config.model_name,
            "state": state,
            "stalled_reason": stalled_reason,
            "restart": restart,
            "run_broker": self.broker,
            "planned": self.plan_complete,
            "plan_complete": self.plan_complete,
            "plan_error": plan_error,
            "planner": planner,
            "planning": planning,
            "batches_total": total,
            "batches_done": len(done),
            "batches_failed": len(failures),
            "samples_total": sum(b.num_samples for b in self.batches),
            "samples_done": sum(by_name[b].num_samples for b in done),
            "samples_stored": sum(m["samples"] for m in self.markers.values()),
            "samples_quarantined": sum(m["quarantined"] for m in self.markers.values()),
            "tokens_total": tokens_total,
            "tokens_done": tokens_done,
            "skipped": dict(sorted(skipped.items())),
            "samples_skipped": int(sum(skipped.values())),
            "worker_seconds": round(sum(m["seconds"] for m in self.markers.values()), 3),
            "batch_seconds_max": round(max((m["seconds"] for m in self.markers.values()), default=0.0), 3),
            "bytes_stored": sum(m["bytes"] for m in self.markers.values()),
            "markers_unreadable": unreadable,
            **rate,
            "regenerate": self.regenerate,
            **generated,
            "eta_s": eta,
            "workers": workers,
            "broker": broker_out,
            "lease_wait": lease_wait or None,
            "parked": parked,
            "batches_parked": None if parked is None else sum(len(g["batches"]) for g in parked),
            "cancelled": cancelled.model_dump(exclude={"schema_version"}) if cancelled is not None else None,
            "resume": resume,
            "failures": {b: f.model_dump(exclude={"schema_version"}) for b, f in failures.items()},
            "at": _iso(now),
        }

    @staticmethod
    def _planning_eta(planning: dict, tokens_done: int, tokens_per_s: float | None) -> float | None:
        """Seconds left of a run still planning: the larger of the planning's ETA and the estimated
        tokens not done over the extraction rate; None before an extraction rate or a token estimate."""
        estimated = planning["tokens_estimated"]
        if estimated is None or not tokens_per_s:
            return None
        extract_s = max(estimated - tokens_done, 0) / tokens_per_s
        return round(max(extract_s, planning["eta_s"] or 0.0), 1)

    @staticmethod
    def _works_on_it(w: dict, now: float) -> bool:
        """A live worker row that runs a batch of the run, or certified one within three heartbeats
        (the moment between two batches is not a stall), or loads its target at its start (for at
        most :data:`LOADING_STALL_S`)."""
        if not w["online"]:
            return False
        if w.get("state") == "loading":
            return w.get("loading_s") is None or w["loading_s"] <= LOADING_STALL_S
        last = _ts(w.get("last_batch_at"))
        return bool(w["running"]) or (last is not None and now - last <= HEARTBEAT_STALE_BEATS * HEARTBEAT_DEFAULT_S)

    def _stalled(self, workers: list[dict], planning: bool = False, parked: list[dict] = ()) -> tuple[str, str]:
        """(why no worker works on the run, the command that restarts it); ``planning``: the plan is
        still written (by a live planner); ``parked``: the run's parked messages, grouped."""
        from producer.fleetview import parked_line

        lost = [w for w in workers if w.get("state") == "lost"]
        stopped = [w for w in workers if w.get("state") == "stopped"]
        loading = [w for w in workers if w.get("state") == "loading" and w["online"]]
        # live ones, and idle records the store cannot date (rows known from markers alone say nothing)
        idle = [w for w in workers if w.get("state") not in ("lost", "stopped", "loading")
                and (w["online"] or (w["online"] is None and w.get("state") == "idle"))]
        parts = [parked_line(g) for g in parked]
        if loading:
            longest = max(w.get("loading_s") or 0.0 for w in loading)
            parts.append(f"{len(loading)} still loading the target after {longest / 60:.0f} min (stuck? see the "
                         "worker's log)")
        if lost:
            parts.append(f"{len(lost)} lost (no heartbeat): " + ", ".join(w["label"] + self._lease_note(w) for w in lost))
        restarting = self.broker == "embedded" and self.embedded_live and not planning
        if idle:
            known = [w for w in idle if w["online"]]
            unknown = len(idle) - len(known)
            parts.append(f"{len(idle)} idle" + (f" ({unknown} not known to be alive: an idle worker writes no more "
                                                "records for a run; ask the broker, without --no-broker)" if unknown
                                                else "")
                         # a live `producer run` enqueues its batches itself: nothing for the user to reconcile
                         + ("" if restarting else f" (is anything queued? `python -m producer reconcile {self.run_store.url}`)"))
        if stopped:
            parts.append(f"{len(stopped)} worker{'s' if len(stopped) != 1 else ''} stopped (the process exited)")
        if not parts:
            parts.append("every worker that served it has stopped")
        restart = self._restart(parked[0]["fix"] if parked else None, planning,
                                serving=sum(1 for w in workers if w["online"]))
        why = "no worker is working on the run: " + "; ".join(parts)
        if self.broker == "embedded" and self.embedded_live is False:  # its workers were that command's own
            why = ("the `python -m producer run` that ran it is not running on this machine (stopped by a Ctrl-C, or "
                   "it failed): its finished batches keep their markers; " + why)
        elif restarting:
            # that command still runs: it restarts a worker that died (workers/launcher.py), or stops with the error
            why = ("restarting: the `python -m producer run` on this machine still runs and restarts its workers that "
                   "died (up to its restart limit, then it stops and says why); meanwhile " + why)
            first = f"for the parked batches: {parked[0]['fix']}; then " if parked else ""
            restart = (f"{first}nothing while that command runs: it restarts its workers; why one died is in "
                       f"HSX_CACHE_DIR/logs/workers-{self.config.run_id}.log")
        if planning:
            why += " (the planner still writes the plan)"
        return why, restart

    def _lease_note(self, w: dict) -> str:
        """`` (its 2 batches come back by themselves when its lease ends, in about 1m10s)`` for a lost
        row whose undone batches wait for its lease; `` (its lease ended: ...)`` once they are due;
        else ``""``."""
        from producer.statusview import fmt_duration

        back = w.get("reclaim_in_s")
        if back is None:
            return ""
        left = sum(1 for b, _ in w.get("_held", []) if b not in self.markers)
        n = plural(left, "batch")
        if self.broker == "embedded" and self.embedded_live is False:  # no worker and no broker left to put them back
            return f" (it held {n}: the same `python -m producer run` command again enqueues {'it' if left == 1 else 'them'})"
        if back > 0:
            verb = "comes back by itself" if left == 1 else "come back by themselves"
            return f" (its {n} {verb} when its lease ends, in about {fmt_duration(back)})"
        return (f" (its lease ended: its {n} {'was' if left == 1 else 'were'} due back {fmt_duration(-back)} ago; if "
                "neither queued nor running, reconcile)")

    def _not_taken(self, broker: dict | None) -> tuple[str, str]:
        """(why no batch of the run was taken, the command that starts workers for it) when no worker
        ever reported on the run; ``broker``: what the probe read (None: not asked)."""
        root = self.run_store.url.rsplit("/", 1)[0]
        asked = broker is not None and "error" not in broker
        if self.broker == "embedded":
            if self.embedded_live:
                return ("no worker has taken a batch yet: the `python -m producer run` on this machine is starting "
                        "its workers (they load and warm up the model first)",
                        "nothing: its workers take the batches once started; if none does, read its workers log "
                        f"(HSX_CACHE_DIR/logs/workers-{self.config.run_id}.log)")
            if self.embedded_live is False:
                return ("no worker took a batch of the run, and the `python -m producer run` that planned it is not "
                        "running on this machine (it was stopped before its workers took one)", self._restart())
            return ("no worker has taken a batch yet; whether its `python -m producer run` still runs is not known "
                    "(--no-broker)", self._restart())
        waiting = ""
        if asked and (broker.get("queue") or {}).get("waiting") is not None:
            waiting = f" ({broker['queue']['waiting']:,} messages wait on '{broker.get('queue_name')}', all runs)"
        start = self._worker_command(root)
        reason = "queued: no worker has taken a batch of the run yet" + waiting
        if self.broker:
            return reason, f"start workers on the run's broker that serve its store: {start}"
        return reason, (f"start workers on the broker it was enqueued on, serving its store: {start}; or, for a "
                        "`python -m producer run`, run the same command again")

    def _worker_command(self, root: str) -> str:
        """The command that starts a worker for this run, in backquotes (then a note on the S3 keys):
        ``python -m workers`` with the run's broker (masked), its store root, for an S3 store the
        endpoint and region status itself uses and placeholders for the keys (a secret is never
        printed), and the run's model as ``HSX_MODEL``."""
        import shlex

        env = [f"HSX_BROKER_URL={self.broker or 'redis://...'}", f"HSX_STORE_URL={shlex.quote(root)}"]
        note = ""
        if root.startswith("s3://"):
            settings = self.settings
            if settings.s3_endpoint_url:
                env.append(f"HSX_S3_ENDPOINT_URL={mask_url(settings.s3_endpoint_url)}")
            if settings.s3_region:
                env.append(f"HSX_S3_REGION={settings.s3_region}")
            env += ["HSX_S3_ACCESS_KEY_ID=<access key id>", "HSX_S3_SECRET_ACCESS_KEY=<secret access key>"]
            note = " (the S3 keys: yours, or leave them out for the AWS_* variables or a profile)"
        env.append(f"HSX_MODEL={shlex.quote(self.config.model_name)}")
        return f"`{' '.join(env)} python -m workers`{note}"

    def _planned_by(self) -> str:
        """``; it was: `<the command that planned the run>``` (plan/stats.json), or "" when not recorded."""
        command = getattr(self.stats, "command", None)
        return f"; it was: `{command}`" if command else ""

    def _restart(self, fix_first: str | None = None, planning: bool = False, serving: int = 0) -> str:
        """The command that restarts a stalled run, for the broker it was run on; ``fix_first``: what
        its parked messages need first; ``serving``: live workers that serve the run (none: the advice
        is to start some; else only the fix, and reconcile)."""
        if serving and self.broker != "embedded":  # workers are there: starting more fixes nothing
            live = f"{plural(serving, 'live worker')} {'serves' if serving == 1 else 'serve'} the run: start no other"
            if fix_first:
                return f"for the parked batches: {fix_first} ({live})"
            return (f"{live}; `python -m producer reconcile {self.run_store.url}` if batches are neither queued nor "
                    "running")
        first = f"for the parked batches: {fix_first}; then " if fix_first else ""
        rerun = "run the same `python -m producer run` command again"
        if planning and self.broker == "embedded":  # the run's own workers are gone, its planner is not
            return (f"{first}stop the `python -m producer run` that still plans it (Ctrl-C) and run it again: it "
                    "resumes the plan after the windows written and enqueues every batch without a marker")
        if self.broker == "embedded":  # run's own broker is gone with it; a new run enqueues every missing batch
            return f"{first}{rerun}: it enqueues every batch without a marker{self._planned_by()}"
        reconcile = (f"; then `python -m producer reconcile {self.run_store.url}` if batches are neither queued "
                     "nor running")
        if self.broker:
            return f"{first}start workers on the run's broker: `HSX_BROKER_URL={self.broker} python -m workers`{reconcile}"
        return (f"{first}{rerun} (a run enqueued on a broker of yours: start workers on it, "
                f"`HSX_BROKER_URL=redis://... python -m workers`){reconcile}")

    def _rate(self, now: float, finished: bool = False) -> dict:
        """Tokens/s over the recent window (the current rate, for the ETA) and over the whole run so far.
        ``finished``: every batch is done: the window ends at the last marker, not ``now`` (a finished
        run's rate and ``rate_window_s`` do not change as it ages)."""
        timed = [m for m in self.markers.values() if m["end"] is not None]
        out = {"tokens_per_s": None, "samples_per_s": None, "overall_tokens_per_s": None, "overall_samples_per_s": None,
               "started_at": None, "last_done_at": None, "rate_window_s": None}
        if not timed:
            return out
        start = min(m["start"] for m in timed)
        last = max(m["end"] for m in timed)
        out["started_at"], out["last_done_at"] = _iso(start), _iso(last)
        span = busy_span(timed)
        out["overall_tokens_per_s"] = round(sum(m["planned_tokens"] for m in timed) / span, 1)
        out["overall_samples_per_s"] = round(sum(m["samples"] + m["quarantined"] for m in timed) / span, 2)
        at = last if finished else now
        tokens, window = recent_window([(m["end"], m["planned_tokens"]) for m in timed], at)
        samples = recent_rate([(m["end"], m["samples"] + m["quarantined"]) for m in timed], at)
        out["tokens_per_s"] = round(tokens, 1) if tokens is not None else None
        out["samples_per_s"] = round(samples, 2) if samples is not None else None
        out["rate_window_s"] = round(window, 1) if window is not None else None
        return out

    @property
    def regenerate(self) -> bool:
        """A regenerate run: its batches answer conversations (their tokens as planned are the
        conversations as given; what the target generated is in the markers)."""
        from hsx.regen import is_regenerate

        return is_regenerate(self.config)

    def _generated(self, now: float, finished: bool) -> dict:
        """A regenerate run's generated tokens: done, per second over the recent window (at the last
        marker once ``finished``) and first batch to last."""
        timed = [m for m in self.markers.values() if m["end"] is not None]
        out = {"tokens_generated": sum(m["supervised"] for m in self.markers.values()),
               "generated_tokens_per_s": None, "overall_generated_tokens_per_s": None}
        if timed:
            span = busy_span(timed)
            out["overall_generated_tokens_per_s"] = round(sum(m["supervised"] for m in timed) / span, 1)
            at = max(m["end"] for m in timed) if finished else now
            recent, _ = recent_window([(m["end"], m["supervised"]) for m in timed], at)
            out["generated_tokens_per_s"] = (out["overall_generated_tokens_per_s"] if finished
                                             else round(recent, 1) if recent is not None else None)
        return out

    def _workers(self, now: float, broker: dict | None) -> list[dict]:
        """One row per worker process, merged by (host, pid) from markers, heartbeat files, presences
        and gpu_stats replies.

        A dead row (``lost``, ``stopped``) runs nothing: its ``running`` is empty and the batches it
        listed last are ``held_at_death`` (``b000052 (forward)``, ``; done since`` once the batch has
        its marker). A ``lost`` row (no heartbeat; its launcher did not see it die) that held
        batches still without a marker has ``reclaim_in_s``: seconds until a live worker has put
        them back, once its lease ends (its presence's broker stamp, else its record's last
        heartbeat, plus ``HSX_LEASE_S`` and the looks of :func:`producer.fleetview.reclaim_grace_s`)."""
        rows: dict[tuple, dict] = {}

        def row(host, pid) -> dict:
            key = (host, pid)
            if key not in rows:
                rows[key] = {"name": None, "host": host, "pid": pid, "device": None, "gpu": None, "no_gpu": None,
                             "state": None, "loading_s": None, "running": [], "tokens_per_s": None, "batches_done": 0, "tokens_done": 0,
                             "last_batch_at": None, "last_heartbeat": None, "heartbeat_age_s": None, "paused": None,
                             "paused_since": None, "spool": None, "online": None, "sources": []}
            return rows[key]

        recent: dict[tuple, list] = {}
        for m in self.markers.values():
            r = row(m["host"], m["pid"])
            if "markers" not in r["sources"]:
                r["sources"].append("markers")
            r["device"] = r["device"] or m["device"]
            r["batches_done"] += 1
            r["tokens_done"] += m["planned_tokens"]
            if m["end"] is not None:
                last = _ts(r["last_batch_at"])
                if last is None or m["end"] > last:
                    r["last_batch_at"] = _iso(m["end"])
                recent.setdefault((m["host"], m["pid"]), []).append(m)
        for key, ms in recent.items():
            # Up to the worker's own last marker: a worker that finished keeps the rate it worked at
            # (its state and heartbeat age say that it stopped); the run's rate is the one that decays.
            rate = recent_rate([(m["end"], m["planned_tokens"]) for m in ms], max(m["end"] for m in ms))
            rows[key]["tokens_per_s"] = round(rate, 1) if rate is not None else None
            if self.regenerate:
                gen = recent_rate([(m["end"], m["supervised"]) for m in ms], max(m["end"] for m in ms))
                rows[key]["generated_tokens_per_s"] = round(gen, 1) if gen is not None else None

        for h in read_heartbeats(self.run_store):  # workers/heartbeat.py writes them
            r = row(h.host, h.pid)
            r["sources"].append("heartbeat")
            r["device"] = h.device or r["device"]
            r["state"] = h.state
            r["running"] = _heartbeat_batches(h)
            r["paused"] = h.paused_reason if h.state == "paused" or h.paused_reason else None
            r["paused_since"] = h.paused_since
            r["spool"] = h.spool.model_dump() if h.spool is not None else None
            beat = _ts(h.updated_at)
            # A process of this host that is gone is dead now, not three heartbeats from now (a
            # `producer run` stopped with a second Ctrl-C kills its workers and their launcher).
            gone = (h.state != "stopped" and h.host == socket.gethostname() and h.pid_ns is not None
                    and h.pid_ns == pid_namespace() and not pid_alive(h.pid))
            if beat is not None:
                r["last_heartbeat"] = _iso(beat)
                r["heartbeat_age_s"] = round(max(now - beat, 0.0), 1)
                stale_s = HEARTBEAT_STALE_BEATS * (h.heartbeat_s or HEARTBEAT_DEFAULT_S)
                fresh = now - beat <= stale_s
                r["online"] = h.state != "stopped" and fresh and not gone
                if h.state == "idle" and not fresh and not gone:
                    # An idle worker writes one record and no more for this run: alive or not, the store
                    # cannot tell (its presence on the broker can, below). Never "stopped".
                    r["online"] = None
                elif h.state == "idle" and gone:
                    r["state"] = "stopped"
                if h.state not in ("stopped", "idle") and not r["online"]:
                    r["state"] = "lost"  # killed, or cut off from the store: its batches are reclaimed after the lease
            if h.state == "stopped" and h.exit:
                r["state"] = "lost"  # python -m workers found it dead (killed, non-zero exit) and marked its record
                r["exit"] = h.exit  # how, when (loading, serving) and the likely cause (workers/launcher.py describe_death)
            r["_held"] = [(b.batch, b.phase) for b in h.batches]

        self._merge_presences(broker, row, rows)

        for name, reply in ((broker or {}).get("workers") or {}).items():
            if (reply.get("host"), reply.get("pid")) not in rows and not any(
                    x.get("run_id") == self.config.run_id for x in reply.get("running") or []):
                # every worker on the broker answers inspect: one that neither serves this run (its records and
                # presence say) nor runs a batch of it is another run's, and must not count as serving this one
                continue
            r = row(reply.get("host"), reply.get("pid"))
            r["sources"].append("inspect")
            r["name"] = name
            r["device"] = reply.get("device") or r["device"]
            r["gpu"] = _gpu_row(reply.get("gpus") or [])
            r["no_gpu"] = reply.get("no_gpu")
            if not {"heartbeat", "presence"} & set(r["sources"]):  # those name the phase too; gpu_stats only the batch
                r["running"] = [x.get("batch") for x in reply.get("running") or [] if x.get("run_id") == self.config.run_id]
            if reply.get("tokens_per_s") is not None:
                r["tokens_per_s"] = reply["tokens_per_s"]
            r["online"] = True
            if r["state"] in ("lost", None) or (r["state"] == "idle" and "presence" not in r["sources"]):
                # alive after all (its records are late: the store is slow, down or full)
                r["state"] = "working" if r["running"] else "idle"
            if r["last_heartbeat"] is None:
                r["last_heartbeat"] = reply.get("at")
                r["heartbeat_age_s"] = 0.0
        self._mark_dead(broker, rows)
        return sorted(rows.values(), key=lambda r: (str(r["host"]), str(r["name"]), r["pid"] or 0))

    def _mark_dead(self, broker: dict | None, rows: dict) -> None:
        """Every row's ``label`` (:func:`hsx.fleet.worker_label`; a dead row's node name from its last
        presence), and a dead row's ``held_at_death`` and ``reclaim_in_s`` (see :meth:`_workers`)."""
        from hsx.fleet import Presence, worker_label
        from producer.fleetview import reclaim_grace_s

        last_seen = {}  # a lost worker's last presence: still "live" by the lease for a while, then gone
        if broker and "error" not in broker:
            for raw in [*(broker.get("gone") or []), *(broker.get("presences") or [])]:
                p = Presence.model_validate(raw)
                last_seen[(p.host, p.pid)] = p
        settings = self.settings
        for key, r in rows.items():
            r.setdefault("_held", [])
            r["held_at_death"], r["reclaim_in_s"] = [], None
            dead = last_seen.get(key)
            if r["online"] is False and r["state"] in ("lost", "stopped"):
                r["name"] = r["name"] or (dead.node if dead is not None else None)
                r["running"] = []
                r["held_at_death"] = [f"{b} ({phase}{'; done since' if b in self.markers else ''})" if phase else
                                      f"{b}{' (done since)' if b in self.markers else ''}" for b, phase in r["_held"]]
                undone = [b for b, _ in r["_held"] if b not in self.markers]
                if r["state"] == "lost" and not r.get("exit") and undone:  # no launcher put them back: the lease does
                    grace = settings.lease_s + reclaim_grace_s(settings)
                    if dead is not None and dead.state != "stopped" and broker.get("now"):
                        r["reclaim_in_s"] = round(dead.stamp + grace - broker["now"], 1)
                    elif r["heartbeat_age_s"] is not None:
                        r["reclaim_in_s"] = round(grace - r["heartbeat_age_s"], 1)
            r["label"] = worker_label(r["name"], r["host"], r["pid"])

    def _merge_presences(self, broker: dict | None, row, rows: dict) -> None:
        """Merge the live workers' presences (``broker["presences"]``) into the rows: a presence
        written within :data:`HEARTBEAT_STALE_BEATS` heartbeats makes its row online and gives its
        state, pause reason (a full store: the store took no record) and this run's batches. Rows
        are added for presences that hold a batch of the run or serve its root."""
        from hsx.fleet import Presence
        from producer.fleetview import same_store, serves

        if not broker or "error" in broker:
            return
        url = self.run_store.url
        beat_s = self.probe.settings.heartbeat_s if self.probe is not None else HEARTBEAT_DEFAULT_S
        fresh_s = max(HEARTBEAT_STALE_BEATS * beat_s, PLANNING_STALL_GRACE_S)  # never tighter than a default record
        broker_now = broker.get("now") or time.time()
        for raw in broker.get("presences") or []:
            p = Presence.model_validate(raw)
            age = max(broker_now - p.stamp, 0.0)
            mine = [t for t in p.tasks if t.batch and same_store(t.run_url, url)]
            if age > fresh_s or not (mine or (p.host, p.pid) in rows or serves(p, url)):
                continue  # a quiet presence: the records (and the lease) decide
            r = row(p.host, p.pid)
            r["sources"].append("presence")
            r["name"] = p.node or r["name"]
            r["device"] = p.device or r["device"]
            r["online"] = True
            r["state"] = ("paused" if p.state == "paused" else "working" if mine
                          else "loading" if p.state == "loading" else "idle")
            if r["state"] == "loading" and p.loading_since:
                r["loading_s"] = round(max(time.time() - p.loading_since, 0.0), 1)  # the worker's clock and ours
            r["running"] = [f"{t.batch} ({t.phase})" for t in mine if t.batch not in self.markers]
            r["paused"] = p.paused_reason if p.state == "paused" else None
            r["paused_since"] = _iso(p.paused_since) if p.state == "paused" and p.paused_since else None
            if r["heartbeat_age_s"] is None or age < r["heartbeat_age_s"]:
                r["last_heartbeat"] = _iso(time.time() - age)
                r["heartbeat_age_s"] = round(age, 1)
        for r in rows.values():  # an old idle record and no fresh presence: the broker says it is not alive
            if r["online"] is None and r["state"] == "idle" and "presence" not in r["sources"]:
                r["online"] = False


def run_broker(settings, run_id: str, broker_url: str | None) -> str | None:
    """The broker a run was served on, as far as this machine can tell: ``"embedded"`` (``producer
    run`` without ``HSX_BROKER_URL``: its embedded broker runs, or this machine has its workers'
    log), ``HSX_BROKER_URL`` masked, or None (not known).

    ``broker_url``: the one ``status`` resolved (:func:`producer.flower.resolve_broker_url`).
    """
    if settings.broker_url:
        return mask_url(settings.broker_url)
    if (broker_url and broker_url.startswith("redis+socket://")) or workers_log_path(settings, run_id).exists():
        return "embedded"
    return None


def run_status(run_store: Store, probe: BrokerProbe | None = None) -> dict:
    """Progress of the run at ``run_store`` (one poll of a :class:`RunWatch`).

    Raises:
        MissingKey: no run.json there.
    """
    return RunWatch(run_store, probe).poll()
