"""What a batch does while its store cannot take it, shared by both task kinds (extraction,
``workers/extract.py``, and regeneration, ``workers/generate.py``): transient store errors retried
for ``HSX_STORE_RETRY_S``; a full store paused with the batch in hand (its host buffer and lease:
no retries burned, no forward run again) until there is room; a run cancelled with ``--now``
noticed during the pause.

``job`` is the task's per-batch context (``workers.extract._Job``): it gives ``store``, ``batch``,
``run_url``, ``settings``, ``heartbeat`` and ``phase``.
"""

from __future__ import annotations

import logging
import shutil
import time

from hsx.errors import RunCancelled, StoreFull
from hsx.records import Cancelled
from hsx.store import retry_transient
from settings import Settings

log = logging.getLogger("workers.extract")


def _retry(settings: Settings, what: str, fn):
    """``fn()`` with transient store errors retried for ``HSX_STORE_RETRY_S`` seconds
    (:func:`hsx.store.retry_transient`)."""
    return retry_transient(fn, what, total_s=settings.store_retry_s)


# --- a full store: the batch pauses with its buffer and lease in hand -----------------------------


def store_room(run_store) -> tuple[str, int] | None:
    """``(path, free bytes)`` of a local store's filesystem (what a non-root user may still write);
    None for S3, whose room is known only when a write is refused."""
    if not run_store.location.is_local:
        return None
    try:
        return run_store.location.path, shutil.disk_usage(run_store.location.path).free
    except OSError:
        return None


def _full_reason(run_store, exc: BaseException | None) -> str:
    room = store_room(run_store)
    if room is not None:
        return f"store full at {room[0]} ({room[1] / 2**20:,.0f} MiB free)"
    return f"store full at {run_store.url} ({str(exc)[:300] if exc else 'no room'})"


def until_room(job, what: str, fn, need_bytes: int):
    """``fn()``, and while the store answers that it is full (:class:`hsx.errors.StoreFull`), a pause:
    the worker holds the batch (its host buffer and lease: no retries burned, no forward run again),
    says ``paused: store full at <path> (<free> free)`` in its presence and status records, and
    calls ``fn`` again once ``need_bytes`` are free (a local store: checked every
    ``HSX_HEARTBEAT_S``, at most 5 s) or every 30 s (S3: its room is only known by trying). Raises
    RunCancelled if the run is cancelled with ``--now`` meanwhile."""
    pause = _Pause(job, what, need_bytes)
    try:
        while True:
            try:
                return fn()
            except StoreFull as exc:
                pause.wait(exc)
    finally:
        pause.end()


def _room_before_forward(job, need_bytes: int) -> None:
    """A local store without room for the shard pauses the worker before the forward runs."""
    room = store_room(job.store)
    if room is None or room[1] >= need_bytes:
        return
    pause = _Pause(job, "run the forward", need_bytes)
    try:
        pause.wait(None)
    finally:
        pause.end()


class _Pause:
    """One pause of a batch for room in a full store (:func:`until_room`)."""

    def __init__(self, job, what: str, need_bytes: int):
        self.job, self.what, self.need = job, what, need_bytes
        self.since: float | None = None

    def wait(self, exc: BaseException | None) -> None:
        """Pause until the store has the room needed (local), or for 30 s (S3)."""
        job, settings = self.job, self.job.settings
        if self.since is None:
            self.since = time.monotonic()
            log.error("batch %s: %s, before it could %s: this worker pauses until there is room (%s MiB needed); "
                      "free space on the store, nothing needs restarting", job.batch, _full_reason(job.store, exc),
                      self.what, f"{self.need / 2**20:,.0f}")
        poll = max(0.5, min(settings.heartbeat_s, 5.0))
        deadline = time.monotonic() + max(30.0, 6 * settings.heartbeat_s)
        last_line = time.monotonic()
        while True:
            job.heartbeat.pause(_full_reason(job.store, exc))
            job.phase("paused")
            room = store_room(job.store)
            if room is not None and room[1] >= self.need:
                return
            if room is None and time.monotonic() >= deadline:
                return
            if time.monotonic() - last_line >= 60:
                last_line = time.monotonic()
                log.warning("batch %s: still paused, %s (%.0f s so far)", job.batch, _full_reason(job.store, exc),
                            time.monotonic() - self.since)
            _check_cancelled_now(job)
            time.sleep(poll)

    def end(self) -> None:
        if self.since is not None:
            self.job.heartbeat.resume()
            log.warning("batch %s: the store has room again; resumed after %.0f s paused", self.job.batch,
                        time.monotonic() - self.since)


def _check_cancelled_now(job) -> None:
    """Raise RunCancelled if the run was cancelled with ``--now`` (``producer cancel --now``)."""
    try:
        cancelled = Cancelled.read(job.store)
    except Exception:  # a store that does not answer: the batch goes on
        return
    if cancelled is not None and cancelled.now:
        raise RunCancelled(f"run at {job.run_url} was cancelled with --now ({cancelled.by}, {cancelled.at}): batch "
                           f"{job.batch} stopped before its marker")
