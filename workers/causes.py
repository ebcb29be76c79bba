"""What a failed task does, by the cause of its error (``workers/tasks.py`` acts on it).

| cause | examples | what happens |
|---|---|---|
| ``transient`` | a store timeout, refused connection, HTTP 5xx or throttling that outlasted ``HSX_STORE_RETRY_S``; a full store disk or spool (ENOSPC); a broker hiccup; CUDA out of memory | the task goes back to the queue through Celery (``Task.retry``) after ``HSX_TASK_RETRY_BASE_S`` doubling up to ``HSX_TASK_RETRY_MAX_S``, for as long as it takes; no failure record |
| ``permanent`` | credentials refused, bucket missing (a non-transient ``StoreError``), a bad setting (``BadConfig``), a checkpoint that is not the run's model, a ``run.json`` this code cannot read (``RunFormatError``, written by a newer hsx), a run this worker does not serve (outside its store roots, another checkpoint than its ``HSX_MODEL``: ``hsx.access.NotServed``) | this worker stops taking tasks (``refusing``, the error in its log and in ``status``); the message goes back to the queue for healthy workers |
| ``refused`` | the task's message is at fault: its run address is not a store URL, or its batch is not a batch name (``hsx.access.Refused``) | the message is dropped (acknowledged) with an ERROR line naming it; nothing is read or written for it, and the worker goes on with other tasks: no worker could run it |
| ``data`` | every sample of the batch had NaN/Inf hidden states (``FidelityError``); the run or the batch's plan is not in the store (``MissingKey``: the run was deleted, or the message names a batch that was never planned) | the batch is failed: ``failures/<batch>.json`` (:class:`hsx.records.Failure`; best effort: the run may be gone), the message acknowledged. A message that names what is not there is that message's problem, not the worker's: refusing would let one deleted run idle every worker |
| ``unknown`` | anything else (a bug) | retried like a transient error :data:`UNKNOWN_RETRIES` times, then failed like a data error |
"""

from __future__ import annotations

import errno

from hsx.errors import BadConfig, FidelityError, NonFiniteBatch, RunConflict, RunFormatError, SpoolFull, StoreError
from hsx.store import MissingKey

TRANSIENT, PERMANENT, DATA, UNKNOWN, REFUSED = "transient", "permanent", "data", "unknown", "refused"
#: Retries through Celery of a task whose error is of no known cause, before it is failed.
UNKNOWN_RETRIES = 2
#: The text by which the one data error is told from the other ``FidelityError`` (the model
#: mismatch, a worker's fault): workers/extract.py raises it when every sample is non-finite.
NONFINITE_TEXT = "NaN/Inf hidden states"
_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _disk_full(exc: BaseException) -> bool:
    return any(isinstance(e, OSError) and e.errno in _DISK_FULL for e in _chain(exc)) \
        or "No space left on device" in str(exc)


def _broker_error(exc: BaseException) -> bool:
    import kombu.exceptions
    import redis.exceptions

    return isinstance(exc, (kombu.exceptions.OperationalError, redis.exceptions.ConnectionError,
                            redis.exceptions.TimeoutError, ConnectionError, TimeoutError))


def classify(exc: BaseException) -> str:
    """The cause of a task's error: :data:`TRANSIENT`, :data:`PERMANENT`, :data:`DATA` or :data:`UNKNOWN` (table above)."""
    from hsx.access import NotServed, Refused

    if isinstance(exc, NotServed):  # the worker's configuration, not the message: others may serve it
        return PERMANENT
    if isinstance(exc, Refused):
        return REFUSED
    if isinstance(exc, SpoolFull):
        return TRANSIENT
    if isinstance(exc, StoreError):
        # A full store disk is freed by someone (or the spool drains): it is waited for, not refused.
        return TRANSIENT if exc.transient or _disk_full(exc) else PERMANENT
    if isinstance(exc, NonFiniteBatch) or (isinstance(exc, FidelityError) and NONFINITE_TEXT in str(exc)):
        return DATA
    if isinstance(exc, FidelityError):
        return PERMANENT
    if isinstance(exc, MissingKey):
        return DATA
    if isinstance(exc, (BadConfig, RunFormatError, RunConflict)):
        return PERMANENT
    if _broker_error(exc) or _disk_full(exc):
        return TRANSIENT
    if type(exc).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError: another process may hold the GPU
        return TRANSIENT
    return UNKNOWN


def retry_countdown(retries: int, base_s: float, max_s: float) -> float:
    """Seconds before retry number ``retries + 1``: ``base_s * 2**retries``, at most ``max_s``."""
    return min(max_s, base_s * (2 ** min(retries, 30)))
