"""Worker status records: ``<run>/workers/<host>-<pid>.json``, one per worker process and run.

A background thread of each worker process writes the record of every run it has a batch of,
every ``HSX_HEARTBEAT_S`` seconds and soon after a change (at most once a second), so that
``python -m producer status`` can show, from the store alone, which workers serve a run, what
each batch is doing, and when and why a worker is paused. Writes are best effort: a store that
is down delays the record, never a batch. A record not updated for three heartbeats is stale (the
process is gone or cut off from the store).

The record is :class:`hsx.records.WorkerStatus` (its fields and units are documented there); its
key is :func:`hsx.layout.worker_key`. ``state`` is ``working`` (a batch of this run in progress),
``paused`` (a batch of this run waits for the spool), ``idle`` (none), ``refusing`` (the process
stopped taking tasks after a permanent error: ``workers/causes.py``) or ``stopped`` (the process
exited normally); ``batches`` lists the batches whose lease the process holds
(``workers/lease.py``).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from hsx.processes import pid_namespace
from hsx.records import BatchLease, SpoolStatus, WorkerStatus

log = logging.getLogger(__name__)

#: shortest gap between two writes of one run's record (seconds).
MIN_WRITE_GAP_S = 1.0


def _list_run(run_url: str) -> None:
    """Add ``run_url`` to ``<HSX_WORKER_RUNS_DIR>/<pid>.runs``, where ``python -m workers`` finds the
    runs whose record of this process to mark ``stopped`` if the process dies (``workers/launcher.py``)."""
    from settings import get_settings

    try:
        runs_dir = get_settings().worker_runs_dir
        if runs_dir is not None:
            with open(Path(runs_dir) / f"{os.getpid()}.runs", "a") as f:
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
        self.refusing: dict | None = None  # {"reason", "since"} once the process refuses tasks

    def _run(self, run_url: str, store) -> dict:
        run = self._runs.get(run_url)
        if run is None:
            run = self._runs[run_url] = {"store": store, "batches": {}, "done": 0, "dirty": True, "last": 0.0, "final": None}
            _list_run(run_url)
        return run

    def phase(self, run_url: str, store, batch: str, phase: str) -> None:
        """Batch ``batch`` of the run at ``run_url`` (its store: ``store``) entered ``phase``."""
        with self._lock:
            run = self._run(run_url, store)
            run["batches"][batch] = {"batch": batch, "phase": phase, "since": time.time()}
            run["dirty"], run["final"] = True, None
            self._ensure_thread()
        self._wake.set()

    def finished(self, run_url: str, batch: str, certified: bool) -> None:
        """The batch's task is over; ``certified``: this process wrote its marker."""
        with self._lock:
            run = self._runs.get(run_url)
            if run is None:
                return
            run["batches"].pop(batch, None)
            run["done"] += int(certified)
            run["dirty"] = True
        self._wake.set()

    def refuse(self, reason: str) -> None:
        """The process stops taking tasks because of ``reason``: every record says ``refusing`` from now
        on, and keeps being written every interval so that ``status`` sees a live, refusing worker."""
        with self._lock:
            if self.refusing is None:
                self.refusing = {"reason": reason, "since": time.time()}
            for run in self._runs.values():
                run["dirty"], run["final"] = True, None
            self._ensure_thread()
        self._wake.set()

    def record(self, run_url: str, state_override: str | None = None) -> WorkerStatus:
        """The record of ``run_url`` as it would be written now (see the module doc)."""
        with self._lock:
            run = self._runs[run_url]
            batches = sorted(run["batches"].values(), key=lambda b: b["batch"])
            done = run["done"]
        spool = self.spool
        paused = any(b["phase"] == "paused" for b in batches)
        refusing = self.refusing
        state = state_override or ("refusing" if refusing else "paused" if paused else "working" if batches else "idle")
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
            paused_reason=(spool.paused_reason if spool is not None else None) if paused else None,
            paused_since=_utc(spool.paused_since if spool is not None else None) if paused else None,
            refusing_reason=refusing["reason"] if refusing else None,
            refusing_since=_utc(refusing["since"]) if refusing else None,
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
                if not body.batches and self.refusing is None:
                    run["final"] = body.state
        except Exception as exc:  # the store may be down: the next beat tries again
            with self._lock:
                run["dirty"] = True
            log.debug("worker status for %s not written: %s", run_url, exc)

    def _due(self) -> list[str]:
        now = time.monotonic()
        with self._lock:
            return [url for url, r in self._runs.items()
                    if r["final"] is None and now - r["last"] >= MIN_WRITE_GAP_S
                    and (r["dirty"] or now - r["last"] >= self.interval_s)]

    def _loop(self) -> None:
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

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="hsx-heartbeat", daemon=True)
            self._thread.start()
            atexit.register(self.stop)

    def stop(self) -> None:
        """Write ``stopped`` records for every run (at normal process exit)."""
        for url in list(self._runs):
            self.write(url, state_override="stopped")


_heartbeat: Heartbeat | None = None
_heartbeat_lock = threading.Lock()


def process_heartbeat(interval_s: float = 5.0) -> Heartbeat:
    """This process's :class:`Heartbeat` (created on first use)."""
    global _heartbeat
    with _heartbeat_lock:
        if _heartbeat is None:
            _heartbeat = Heartbeat(interval_s)
        return _heartbeat
