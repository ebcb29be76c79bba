"""Worker status records: ``<run>/workers/<host>-<pid>.json``, one per worker process and run.

A background thread of each worker process writes the record of every run it has a batch of,
every ``HSX_HEARTBEAT_S`` seconds and soon after a change (at most once a second), so that
``python -m producer status`` can show, from the store alone, which workers serve a run, what
each batch is doing, and when and why a worker is paused. Writes are best effort: a store that
is down delays the record, never a batch. A record not updated for three heartbeats is stale (the
process is gone or cut off from the store).

The record is :class:`hsx.records.WorkerStatus` (its fields and units are documented there); its
key is :func:`hsx.layout.worker_key`. ``state`` is ``working`` (a batch of this run in progress),
``paused`` (a batch of this run waits for the spool or for room in a full store), ``idle`` (none)
or ``stopped`` (the process exited normally); ``batches`` lists the batches in progress.

A second thread writes the process's **presence** on the broker (:class:`hsx.fleet.Presence`:
its roots and model, its state and pause reason, every task it holds, stamped with the broker's
clock) every ``HSX_HEARTBEAT_S`` and soon after a change; it
never waits for a store write (a hung S3 request must not let a live batch's lease expire). The presence is what holds a batch's lease
(``workers/lease.py``), what ``enqueue`` reads to learn the roots the fleet serves, and how a
worker's state reaches ``status`` when the store cannot take a record (a full disk).

The :class:`Heartbeat` is the process's one tracker of its batches: the records, the presence and
the ``gpu_stats`` reply (``workers/monitor.py``: the batches running, those done, the recent
tokens/s, :meth:`Heartbeat.activity`) are all read from it.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
from collections import deque
from datetime import datetime, timezone
from pathlib import Path

from hsx.processes import pid_namespace
from hsx.records import BatchLease, SpoolStatus, WorkerStatus

log = logging.getLogger(__name__)

#: shortest gap between two writes of one run's record (seconds).
MIN_WRITE_GAP_S = 1.0
#: seconds of finished batches that the process's ``tokens_per_s`` averages over (:meth:`Heartbeat.activity`).
RATE_WINDOW_S = 300.0
#: finished batches kept for the rate (the window is cut to these many).
RATE_HISTORY = 256

#: Set by ``python -m workers`` for its children, never by hand (so no setting): a directory where
#: each worker process lists the runs it writes status records for (``<pid>.runs``, one run address
#: a line), so that the launcher can mark the records of a child that died as ``stopped``.
RUNS_DIR_ENV = "HSX_WORKER_RUNS_DIR"


#: ``<HSX_WORKER_RUNS_DIR>/<pid>.beat``: touched by the presence thread about once a second, so that the
#: launcher can tell a child that is alive but hung (SIGSTOP, stuck holding the GIL) from a working one.
BEAT_SUFFIX = ".beat"


def runs_dir() -> Path | None:
    """The directory of :data:`RUNS_DIR_ENV`, or None outside a launcher's child."""
    value = os.environ.get(RUNS_DIR_ENV)
    return Path(value) if value else None


def _list_run(run_url: str) -> None:
    """Add ``run_url`` to ``<HSX_WORKER_RUNS_DIR>/<pid>.runs``, where ``python -m workers`` finds the
    runs whose record of this process to mark ``stopped`` if the process dies (``workers/launcher.py``)."""
    try:
        listed = runs_dir()
        if listed is not None:
            with open(listed / f"{os.getpid()}.runs", "a") as f:
                f.write(run_url + "\n")
    except Exception as exc:  # best effort: a status record is not worth a failed batch
        log.debug("runs list not written: %s", exc)


def _utc(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="seconds")


def worker_name() -> str:
    """``<host>-<pid>``: the record's file name without ``.json``."""
    return f"{socket.gethostname()}-{os.getpid()}"


class Heartbeat:
    """The status records of one worker process (thread-safe; the writer thread starts on first use)."""

    def __init__(self, interval_s: float = 5.0):
        self.interval_s = interval_s
        self.started = time.time()
        self.device: str | None = None
        self.spool = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._runs: dict[str, dict] = {}  # run_url -> {"store", "batches", "done", "dirty", "last", "final"}
        self._thread: threading.Thread | None = None
        self.paused: dict | None = None  # {"reason", "since"}: the process waits for room in a full store
        self.loading_since: float | None = None  # unix time: the worker's target is being loaded at its start
        # the broker presence (hsx/fleet.py): set by attach_broker at worker start
        self._broker = None  # {"url", "queue", "roots", "model", "node"}
        self._redis = None  # one client (and connection pool) for every presence write
        self._held: dict[str, dict] = {}  # task id -> {"task_id", "run_url", "batch", "phase"}
        # deliveries of each held task id: a retry's message (same id) can arrive before the attempt ends
        self._deliveries: dict[str, int] = {}
        self._presence_wake = threading.Event()
        self._presence_thread: threading.Thread | None = None
        self._served: list[str] = []  # run addresses, oldest first (bounded)
        self._presence_dirty = True
        self._presence_last = 0.0
        self._started_broker: float = 0.0
        self._done_total = 0
        self._tokens_total = 0
        self._finished: deque[tuple[float, float, int]] = deque(maxlen=RATE_HISTORY)  # (start, end, tokens), wall clock

    def _run(self, run_url: str, store) -> dict:
        run = self._runs.get(run_url)
        if run is None:
            run = self._runs[run_url] = {"store": store, "batches": {}, "done": 0, "dirty": True, "last": 0.0, "final": None}
            _list_run(run_url)
        return run

    def attach_broker(self, broker_url: str, queue: str, roots: list[str], model: str | None,
                      node: str | None = None) -> None:
        """Write this process's presence on the broker from now on (``hsx/fleet.py``); starts the thread."""
        with self._lock:
            self._broker = {"url": broker_url, "queue": queue, "roots": list(roots), "model": model, "node": node}
            self._presence_dirty = True
            self._ensure_thread()
        self._wake_all()

    def received(self, task_id: str, run_url: str, batch: str) -> None:
        """This process got the task (prefetched, or held for its retry countdown): listed in its presence."""
        with self._lock:
            self._held.setdefault(task_id, {"task_id": task_id, "run_url": run_url, "batch": batch, "phase": "received"})
            self._deliveries[task_id] = self._deliveries.get(task_id, 0) + 1
            self._presence_dirty = True
        self._wake_all()

    def released(self, task_id: str) -> None:
        """One delivery of the task is over (acknowledged, retried, rejected or revoked). The task stays
        listed while another delivery of it is held: Celery's retry sends the same task id again, and
        the new message may be received before the attempt that sent it has ended."""
        with self._lock:
            left = self._deliveries.get(task_id, 1) - 1
            if left > 0:
                self._deliveries[task_id] = left
                if task_id in self._held:
                    self._held[task_id]["phase"] = "received"
            else:
                self._deliveries.pop(task_id, None)
                if self._held.pop(task_id, None) is not None:
                    self._presence_dirty = True
        self._wake_all()

    def served(self, run_url: str) -> None:
        """Remember a run this process served (the healer's list of runs, in its presence)."""
        with self._lock:
            if run_url not in self._served:
                self._served = [*self._served[-63:], run_url]
                self._presence_dirty = True

    def pause(self, reason: str) -> None:
        """The process waits for room in a full store: ``paused`` with ``reason``, in its presence and records."""
        with self._lock:
            if self.paused is None or self.paused["reason"] != reason:
                self.paused = {"reason": reason, "since": time.time(),
                               "broker_since": (self.paused or {}).get("broker_since")}
            self._presence_dirty = True
            for run in self._runs.values():
                run["dirty"], run["final"] = True, None
        self._wake_all()

    def loading(self, active: bool) -> None:
        """The process loads and warms up its target before it takes tasks (``HSX_MODEL``,
        ``workers/app.py``): its presence says ``loading`` from when, so that ``status`` does not
        call a worker that compiles kernels for minutes idle (nor the run stalled). Written at once."""
        with self._lock:
            self.loading_since = time.time() if active else None
            self._presence_dirty = True
        self._wake_all()

    def resume(self) -> None:
        """The pause of :meth:`pause` is over."""
        with self._lock:
            self.paused = None
            self._presence_dirty = True
            for run in self._runs.values():
                run["dirty"] = True
        self._wake_all()

    def phase(self, run_url: str, store, batch: str, phase: str, task_id: str | None = None) -> None:
        """Batch ``batch`` of the run at ``run_url`` (its store: ``store``) entered ``phase``."""
        now = time.time()
        with self._lock:
            run = self._run(run_url, store)
            started = run["batches"].get(batch, {}).get("started", now)
            run["batches"][batch] = {"batch": batch, "phase": phase, "since": now, "started": started, "task_id": task_id}
            run["dirty"], run["final"] = True, None
            for held in self._held.values():
                if held["run_url"] == run_url and held["batch"] == batch:
                    held["phase"] = phase
            if task_id is not None and task_id not in self._held:
                self._held[task_id] = {"task_id": task_id, "run_url": run_url, "batch": batch, "phase": phase}
            self._presence_dirty = True
            self._ensure_thread()
        self._wake_all()

    def finished(self, run_url: str, batch: str, certified: bool, tokens: int = 0) -> None:
        """The batch's task is over; ``certified``: this process wrote its marker, for a shard of ``tokens``
        tokens (they count toward the process's rate)."""
        now = time.time()
        with self._lock:
            run = self._runs.get(run_url)
            if run is None:
                return
            entry = run["batches"].pop(batch, None)
            run["done"] += int(certified)
            self._done_total += int(certified)
            if certified:
                self._tokens_total += tokens
                self._finished.append((entry["started"] if entry else now, now, tokens))
            run["dirty"] = True
            self._presence_dirty = True
        self._wake_all()

    def activity(self, now: float | None = None) -> dict:
        """What this process runs and has run, for the ``gpu_stats`` reply (``workers/monitor.py``):
        ``running`` (``[{run_id, batch, task_id, started_at, seconds}]``), ``batches_done`` and
        ``tokens_done`` (certified since the process started), ``tokens_per_s`` (tokens of the
        batches finished in the last :data:`RATE_WINDOW_S` seconds over the wall time they span,
        overlapping batches counted once; None before the first) and ``last_batch_at``."""
        now = time.time() if now is None else now
        with self._lock:
            batches = sorted(((url, b) for url, run in self._runs.items() for b in run["batches"].values()),
                             key=lambda ub: ub[1]["started"])
            running = [{"run_id": url.rstrip("/").rsplit("/", 1)[-1], "batch": b["batch"], "task_id": b["task_id"],
                        "started_at": _utc(b["started"]), "seconds": round(now - b["started"], 1)} for url, b in batches]
            recent = [f for f in self._finished if f[1] >= now - RATE_WINDOW_S]
            last = self._finished[-1][1] if self._finished else None
            done, tokens = self._done_total, self._tokens_total
        rate = None
        if recent:
            span = max(f[1] for f in recent) - min(f[0] for f in recent)
            rate = round(sum(f[2] for f in recent) / max(span, 1e-3), 1)
        return {"running": running, "batches_done": done, "tokens_done": tokens,
                "tokens_per_s": rate, "last_batch_at": _utc(last)}

    def record(self, run_url: str, state_override: str | None = None) -> WorkerStatus:
        """The record of ``run_url`` as it would be written now (see the module doc)."""
        with self._lock:
            run = self._runs[run_url]
            batches = sorted(run["batches"].values(), key=lambda b: b["batch"])
            done = run["done"]
        spool = self.spool
        store_full = self.paused
        paused = any(b["phase"] == "paused" for b in batches)
        state = state_override or ("paused" if paused else "working" if batches else "idle")
        usage = None
        if spool is not None:
            try:
                usage = SpoolStatus(**spool.usage().as_dict(), max_fraction=spool.max_fraction,
                                    max_pending_uploads=spool.max_pending_uploads)
            except OSError:
                usage = None
        return WorkerStatus(
            host=socket.gethostname(), pid=os.getpid(), pid_ns=pid_namespace(), worker=worker_name(), device=self.device,
            state=state,
            paused_reason=(store_full["reason"] if store_full else spool.paused_reason if spool is not None else None)
            if paused else None,
            paused_since=_utc(store_full["since"] if store_full else spool.paused_since if spool is not None else None)
            if paused else None,
            batches=[BatchLease(batch=b["batch"], phase=b["phase"], since=_utc(b["since"])) for b in batches],
            batches_done=done, spool=usage, started_at=_utc(self.started), updated_at=_utc(time.time()),
            heartbeat_s=self.interval_s,
        )

    def write(self, run_url: str, state_override: str | None = None) -> None:
        """Write the record of ``run_url`` now (best effort: errors are logged at DEBUG)."""
        with self._lock:
            run = self._runs.get(run_url)
            if run is None:
                return
            run["dirty"] = False
            run["last"] = time.monotonic()
            store = run["store"]
        body = self.record(run_url, state_override)
        try:
            body.write(store)
            with self._lock:
                if not body.batches:
                    run["final"] = body.state
        except Exception as exc:  # the store may be down: the next beat tries again
            with self._lock:
                run["dirty"] = True
            log.debug("worker status for %s not written: %s", run_url, exc)

    def presence(self, state_override: str | None = None):
        """This process's :class:`hsx.fleet.Presence` as it would be written now (unstamped)."""
        from hsx.fleet import HeldTask, Presence

        with self._lock:
            broker = dict(self._broker or {})
            held = [HeldTask(**h) for h in self._held.values()]
            paused = dict(self.paused) if self.paused else None
            served, done = list(self._served), self._done_total
            loading_since = self.loading_since
        busy = [h for h in held if h.phase != "received"]
        if state_override:
            state = state_override
        elif paused or any(h.phase == "paused" for h in held):
            state = "paused"
        else:
            state = "working" if busy else "loading" if loading_since is not None else "idle"
        reason = paused["reason"] if paused else None
        if reason is None and state == "paused" and self.spool is not None:
            reason = self.spool.paused_reason
        return Presence(worker=worker_name(), host=socket.gethostname(), pid=os.getpid(), node=broker.get("node"),
                        roots=broker.get("roots", []), model=broker.get("model"), device=self.device, state=state,
                        paused_reason=reason, paused_since=(paused or {}).get("broker_since"), tasks=held,
                        runs=served, batches_done=done, started=self._started_broker,
                        loading_since=loading_since if state == "loading" else None)

    def write_presence(self, state_override: str | None = None) -> None:
        """Write the presence now (best effort: a broker that is down delays it, never a batch)."""
        from hsx.broker import redis_client
        from hsx.fleet import write_presence

        with self._lock:
            broker = self._broker
            self._presence_dirty = False
            self._presence_last = time.monotonic()
        if broker is None:
            return
        body = self.presence(state_override)
        try:
            if self._redis is None:
                self._redis = redis_client(broker["url"])
            stamped = write_presence(self._redis, broker["queue"], body)
            with self._lock:
                self._started_broker = self._started_broker or stamped.started
                if self.paused is not None and self.paused.get("broker_since") is None:
                    self.paused["broker_since"] = stamped.stamp
        except Exception as exc:
            with self._lock:
                self._presence_dirty = True
            log.debug("presence not written: %s", exc)

    def _presence_due(self) -> bool:
        now = time.monotonic()
        with self._lock:
            return self._broker is not None and now - self._presence_last >= MIN_WRITE_GAP_S / 2 and (
                self._presence_dirty or now - self._presence_last >= self.interval_s)

    def _due(self) -> list[str]:
        now = time.monotonic()
        with self._lock:
            return [url for url, r in self._runs.items()
                    if r["final"] is None and now - r["last"] >= MIN_WRITE_GAP_S
                    and (r["dirty"] or now - r["last"] >= self.interval_s)]

    def _wake_all(self) -> None:
        self._wake.set()
        self._presence_wake.set()

    def _loop(self) -> None:
        """The store records' thread."""
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            time.sleep(MIN_WRITE_GAP_S / 4)  # gather a burst of phase changes into one write
            for url in self._due():
                self.write(url)
            with self._lock:
                pending = any(r["final"] is None and r["dirty"] for r in self._runs.values())
            if pending:
                self._wake.set()
                time.sleep(MIN_WRITE_GAP_S / 2)

    def _presence_loop(self) -> None:
        """The presence's own thread: it holds the leases, so a store write that hangs (an S3 outage
        under boto's retries, a full disk) must never delay it. It also touches the launcher's beat
        file (:data:`BEAT_SUFFIX`)."""
        listed = runs_dir()
        beat = listed / f"{os.getpid()}{BEAT_SUFFIX}" if listed is not None else None
        while True:
            self._presence_wake.wait(min(self.interval_s, 1.0))
            self._presence_wake.clear()
            if beat is not None:
                try:
                    beat.touch()
                except OSError:  # the launcher's directory went away: it judges no hang then
                    pass
            time.sleep(MIN_WRITE_GAP_S / 4)
            if self._presence_due():
                self.write_presence()
            with self._lock:
                pending = self._presence_dirty and self._broker is not None
            if pending:
                self._presence_wake.set()
                time.sleep(MIN_WRITE_GAP_S / 2)

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="hsx-heartbeat", daemon=True)
            self._thread.start()
            self._presence_thread = threading.Thread(target=self._presence_loop, name="hsx-presence", daemon=True)
            self._presence_thread.start()
            atexit.register(self.stop)

    def stop(self) -> None:
        """Write ``stopped`` records for every run and the presence (at normal process exit)."""
        for url in list(self._runs):
            self.write(url, state_override="stopped")
        self.write_presence(state_override="stopped")


_heartbeat: Heartbeat | None = None
_heartbeat_lock = threading.Lock()


def current_heartbeat() -> Heartbeat | None:
    """This process's :class:`Heartbeat` if one was made (None before its first batch or the worker's start)."""
    return _heartbeat


def process_heartbeat(interval_s: float = 5.0) -> Heartbeat:
    """This process's :class:`Heartbeat` (created on first use)."""
    global _heartbeat
    with _heartbeat_lock:
        if _heartbeat is None:
            _heartbeat = Heartbeat(interval_s)
        return _heartbeat
