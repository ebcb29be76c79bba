"""Celery tasks. Thin on purpose: ids in, the batch job (workers/extract.py) does the work; what a
failure does depends on its cause (``workers/causes.py``):

- **transient**: ``Task.retry`` sends the task back to the queue with a countdown (doubling from
  ``HSX_TASK_RETRY_BASE_S`` up to ``HSX_TASK_RETRY_MAX_S``, no limit on the count); the new message
  is published before the old one is acknowledged, so the batch is never out of the broker. If the
  broker does not take the retry, the message is rejected with ``requeue=True`` instead.
- **permanent**: this worker process refuses tasks from now on: it cancels its own consumer of the
  queue (``app.control.cancel_consumer``, Celery 5 "Remote control"), logs why at ERROR, says
  ``refusing`` with the error in its status records and its ``hsx_refusing`` inspect reply, and
  rejects the message with ``requeue=True`` (``celery.exceptions.Reject``), so healthy workers take
  it. A task that reaches a refusing process before the cancel took effect is rejected the same way.
- **refused** (a run outside this worker's store roots, a bad batch name, another model than its
  ``HSX_MODEL``): the message is dropped with an ERROR line; nothing is read or written for it.
- **data** (and an unknown error that came back :data:`workers.causes.UNKNOWN_RETRIES` times):
  ``failures/<batch>.json`` (:class:`hsx.records.Failure`), and the message is acknowledged: the
  batch is failed.

The batch is listed in the process's status record (phase ``claimed``) from the start of the task,
which is what holds its lease (``workers/lease.py``).
"""

from __future__ import annotations

import logging
import threading
import time

from celery.exceptions import Reject, Retry

from hsx.queue import EXTRACT_TASK
from settings import get_settings
from workers.app import app
from workers.causes import DATA, PERMANENT, REFUSED, TRANSIENT, UNKNOWN, UNKNOWN_RETRIES, classify, retry_countdown
from workers.extract import _run_store
from workers.extract import extract_batch as _extract_batch
from workers.extract import record_failure
from workers.heartbeat import process_heartbeat

log = logging.getLogger(__name__)

_refusal_lock = threading.Lock()
_refusal: dict | None = None


def refusal() -> dict | None:
    """``{"error", "since", "batch", "run"}`` once this process refuses tasks, else None."""
    return _refusal


def _refuse(task, exc: BaseException, run_url: str, batch: str, settings) -> None:
    """Stop this worker process taking tasks (the module doc); idempotent."""
    global _refusal
    error = f"{exc.__class__.__name__}: {exc}"[:2000]
    with _refusal_lock:
        first = _refusal is None
        if first:
            _refusal = {"error": error, "since": time.time(), "batch": batch, "run": run_url}
    if not first:
        return
    log.error("worker %s refuses tasks from now on: batch %s of %s failed with an error a retry cannot fix: %s. "
              "The batch goes back to the queue for the other workers; fix the cause and restart this worker.",
              task.request.hostname, batch, run_url, error)
    process_heartbeat(settings.heartbeat_s).refuse(error)
    try:
        task.app.control.cancel_consumer(settings.queue, destination=[task.request.hostname], reply=False)
    except Exception as cancel_exc:  # the task is rejected anyway; later ones too (refusal() is set)
        log.warning("could not cancel this worker's consumer of %r: %s", settings.queue, cancel_exc)


def _claim(run_url: str, batch: str, settings) -> bool:
    """List the batch in this process's status record (its lease); False when the store does not open."""
    try:
        store = _run_store(run_url, settings)
    except Exception:  # the job itself opens it again and fails with the error
        return False
    process_heartbeat(settings.heartbeat_s).phase(run_url, store, batch, "claimed")
    return True


@app.task(bind=True, name=EXTRACT_TASK, acks_late=True, reject_on_worker_lost=True, max_retries=None)
def extract_batch(self, run_url: str, batch: str) -> dict:
    """Extract batch ``batch`` of the run stored at ``run_url``; no-op if its marker exists.

    Raises:
        celery.exceptions.Retry: a transient error; the task is back in the queue.
        celery.exceptions.Reject: a permanent error (or this process refuses tasks); requeued.
        Exception: the data error (or an unknown one, after its retries), recorded in ``failures/``.
    """
    settings = get_settings()
    refused = refusal()
    if refused is not None:
        raise Reject(f"this worker refuses tasks since {refused['error']}", requeue=True)
    claimed = _claim(run_url, batch, settings)
    try:
        return _extract_batch(run_url, batch, settings)
    except Exception as exc:
        cause = classify(exc)
        retries = self.request.retries or 0
        if cause == TRANSIENT or (cause == UNKNOWN and retries < UNKNOWN_RETRIES):
            countdown = retry_countdown(retries, settings.task_retry_base_s, settings.task_retry_max_s)
            log.warning("batch %s: %s error, retrying through the queue in %.1f s (retry %d): %s: %s",
                        batch, cause, countdown, retries + 1, exc.__class__.__name__, exc)
            try:
                raise self.retry(exc=exc, countdown=countdown, max_retries=None)
            except Retry:
                raise
            except Exception as send_exc:  # the broker did not take the new message: keep the old one
                raise Reject(f"retry of batch {batch} not sent ({send_exc}); requeued", requeue=True) from exc
        if cause == REFUSED:
            # Never run, never put back (this worker would meet it again), nothing written for it.
            log.error("batch %s of %s dropped: %s: %s", str(batch)[:80], run_url, exc.__class__.__name__, exc)
            return {"status": "refused", "batch": str(batch)[:80], "error": str(exc)[:500]}
        if cause == PERMANENT:
            _refuse(self, exc, run_url, batch, settings)
            raise Reject(f"batch {batch}: {exc.__class__.__name__}: {exc}", requeue=True) from exc
        if cause == UNKNOWN:
            log.error("batch %s failed %d times with %s: failing it", batch, retries + 1, exc.__class__.__name__)
        assert cause in (DATA, UNKNOWN)
        record_failure(run_url, batch, exc, settings)
        raise
    finally:
        if claimed:
            process_heartbeat(settings.heartbeat_s).finished(run_url, batch, certified=False)
