"""What a failed task does, by the cause of its error (``workers/tasks.py`` acts on it).

No error of one message, one run or one batch makes a worker stop taking the others' tasks.

| cause | examples | what happens |
|---|---|---|
| ``transient`` | a store timeout, refused connection, HTTP 5xx or throttling that outlasted ``HSX_STORE_RETRY_S``; a full spool (``SpoolFull``); a broker hiccup; CUDA out of memory; a worker of K GPUs whose group broke (``GroupBroken``: the process then exits and the launcher restarts the group) | the task goes back to the queue through Celery (``Task.retry``) after ``HSX_TASK_RETRY_BASE_S`` doubling up to ``HSX_TASK_RETRY_MAX_S``, for as long as it takes; no failure record. A **full store** is not an error of a task: the worker pauses with the batch in hand and goes on when there is room (``workers/extract.py``, :func:`~workers.extract.until_room`) |
| ``park`` | a run this worker does not serve: outside its store roots, another checkpoint than its ``HSX_MODEL`` or than the one the run was planned for (``hsx.access.NotServed``); a run it cannot read: credentials refused, bucket missing (a non-transient ``StoreError``), a ``run.json`` this code cannot read (``RunFormatError``), a bad setting (``BadConfig``) | the message is **parked** on the broker (``hsx/fleet.py``: the reason and this worker) and acknowledged; this worker goes on with the next message. It comes back to the queue by itself when a worker that serves it (and has not refused it) looks, or with ``producer reconcile RUN``; ``status`` shows ``parked`` with the reason |
| ``gone`` | the run's address holds no run (``RunGone``: deleted) | the message is acknowledged with one ERROR line per run and process; nothing is written |
| ``cancelled`` | ``producer cancel`` (``RunCancelled``) | acknowledged, nothing written; one line per run and process |
| ``refused`` | the message is at fault: its run address is not a store URL, its batch is not a batch name or not in the run's plan (``hsx.access.Refused``) | the message is dropped (acknowledged) with an ERROR line naming it; nothing is read or written for it: no worker could run it |
| ``data`` | the batch's own data: a damaged plan file (``BadPlan``), every sample with NaN/Inf hidden states (``NonFiniteBatch``), a fidelity check that fails (``FidelityError``), a key missing mid-batch (``MissingKey``) | tried :data:`TRIES` times through the queue, then failed: ``failures/<batch>.json`` (:class:`hsx.records.Failure`), shown by ``status`` and ``verify``; the message acknowledged |
| ``unknown`` | anything else (a bug) | as ``data`` |
"""

from __future__ import annotations

import errno
import sys

from hsx.errors import (BadConfig, BadPlan, FidelityError, GroupBroken, RunCancelled, RunConflict, RunFormatError, RunGone, SpoolFull,
                        StoreError, StoreFull)
from hsx.store import MissingKey

TRANSIENT, PARK, GONE, CANCELLED, REFUSED, DATA, UNKNOWN = (
    "transient", "park", "gone", "cancelled", "refused", "data", "unknown")
#: Attempts at a batch whose error is its own data's, or of no known cause, before it is failed.
TRIES = 3
_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a full disk or quota (ENOSPC, EDQUOT, ``StoreFull``)."""
    return any(isinstance(e, StoreFull) or (isinstance(e, OSError) and e.errno in _DISK_FULL) for e in _chain(exc))


def _broker_error(exc: BaseException) -> bool:
    import kombu.exceptions
    import redis.exceptions

    return isinstance(exc, (kombu.exceptions.OperationalError, redis.exceptions.ConnectionError,
                            redis.exceptions.TimeoutError, ConnectionError, TimeoutError))


def classify(exc: BaseException) -> str:
    """The cause of a task's error: one of the module's constants (table above)."""
    from hsx.access import NotServed, Refused

    if isinstance(exc, NotServed):  # the worker's configuration, not the message: another may serve it
        return PARK
    if isinstance(exc, Refused):
        return REFUSED
    if isinstance(exc, RunGone):
        return GONE
    if isinstance(exc, RunCancelled):
        return CANCELLED
    if isinstance(exc, (SpoolFull, StoreFull, GroupBroken)):
        return TRANSIENT
    if isinstance(exc, StoreError):
        return TRANSIENT if exc.transient or disk_full(exc) else PARK
    if isinstance(exc, (BadPlan, FidelityError, MissingKey)):
        return DATA
    if isinstance(exc, (BadConfig, RunFormatError, RunConflict)):
        return PARK
    if _broker_error(exc) or disk_full(exc):
        return TRANSIENT
    if _out_of_memory(exc):  # another process may hold the GPU
        return TRANSIENT
    return UNKNOWN


def _out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's ``OutOfMemoryError`` (CUDA's is a subclass), by type. torch is not
    imported for this: a process that never imported it raised none."""
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return oom is not None and isinstance(exc, oom)


def retry_countdown(retries: int, base_s: float, max_s: float) -> float:
    """Seconds before retry number ``retries + 1``: ``base_s * 2**retries``, at most ``max_s``."""
    return min(max_s, base_s * (2 ** min(retries, 30)))
