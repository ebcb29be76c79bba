"""The extraction task's body. Thin on purpose: ids in, the batch job (``workers/extract.py``) does
the work; what a failure does depends on its cause (``workers/causes.py``), and no cause makes this
worker stop taking other runs' tasks. ``workers/app.py`` registers :func:`extract_batch` on the
Celery app (this module imports no app: the app imports it):

- **transient**: ``Task.retry`` sends the task back to the queue with a countdown (doubling from
  ``HSX_TASK_RETRY_BASE_S`` up to ``HSX_TASK_RETRY_MAX_S``, no limit on the count); the new message
  is published before the old one is acknowledged, so the batch is never out of the broker. If the
  broker does not take the retry, the message is rejected with ``requeue=True`` instead.
- **park** (a run this worker does not serve, or cannot read): the message is parked on the broker
  with the reason and this worker's name (``hsx/fleet.py``), then acknowledged; it comes back when
  a worker that serves it looks (``workers/lease.py``) or with ``producer reconcile``. If the
  broker does not take the entry, the message is rejected with ``requeue=True``: never lost.
- **gone** / **cancelled**: acknowledged, nothing written; one log line per run and process.
- **refused** (the message is at fault): dropped with an ERROR line; nothing is read or written.
- **data** / **unknown**: retried through the queue until :data:`workers.causes.TRIES` attempts,
  then ``failures/<batch>.json`` (:class:`hsx.records.Failure`) and the message acknowledged.

A message is checked before anything is written for it (``workers/extract.py`` ``admit``); the
batch is listed in this process's presence from its delivery and in its status record from its
start (``workers/heartbeat.py``), which is what holds its lease (``workers/lease.py``).
"""

from __future__ import annotations

import logging
import threading

from celery.exceptions import Reject, Retry

from settings import get_settings
from workers.causes import (CANCELLED, DATA, GONE, PARK, REFUSED, TRANSIENT, TRIES, UNKNOWN, classify,
                            retry_countdown)
from workers.extract import extract_batch as _extract_batch
from workers.extract import record_failure, run_exists
from workers.heartbeat import worker_name

log = logging.getLogger(__name__)

#: how ``workers/app.py`` registers :func:`extract_batch`: acknowledged after it returns (a worker that
#: dies first leaves the message to be delivered again), never a retry limit (transient causes retry
#: for as long as they last; the others count their attempts, ``workers.causes.TRIES``).
TASK_OPTIONS = {"bind": True, "acks_late": True, "reject_on_worker_lost": True, "max_retries": None}

_said_lock = threading.Lock()
_said: set[tuple[str, str]] = set()  # (cause, run address): the one line per run and process already logged


def _once(cause: str, run_url: str) -> bool:
    with _said_lock:
        if (cause, run_url) in _said:
            return False
        _said.add((cause, run_url))
        return True


def park_message(task_id: str | None, run_url: str, batch: str, exc: BaseException, settings) -> None:
    """Park the message of ``batch`` of ``run_url`` on the broker (``hsx/fleet.py``) with the reason.

    Raises whatever redis raises when the broker does not take it (the caller then requeues the message)."""
    from hsx.access import ModelNotServed, NotServed
    from hsx.broker import redis_client
    from hsx.fleet import Parked, park

    text = str(exc)
    cause = "model" if isinstance(exc, ModelNotServed) else "not_served" if isinstance(exc, NotServed) else "unreadable"
    entry = Parked(run_url=run_url, batch=batch, task_id=task_id, reason=f"{exc.__class__.__name__}: {text}"[:2000],
                   cause=cause, refused_by=[worker_name()])
    stored = park(redis_client(settings.broker_url), settings.queue, entry)
    level = logging.ERROR if _once("park", run_url) else logging.INFO
    log.log(level, "batch %s of %s parked (this worker cannot serve it; it serves every other run as before): %s. "
            "It comes back to the queue when a worker that serves it looks, or with `producer reconcile %s`",
            batch, run_url, entry.reason, run_url)
    return stored


def extract_batch(self, run_url: str, batch: str) -> dict:
    """Extract batch ``batch`` of the run stored at ``run_url``; no-op if its marker exists. ``self``:
    the bound Celery task (:data:`TASK_OPTIONS`: acknowledged late, so only once the marker exists).

    Returns ``{"status", "batch", ...}``: ``done``, ``already_done``, ``lost_race``, or what was done
    with a message this worker did not run: ``parked``, ``gone``, ``cancelled``, ``refused``.

    Raises:
        celery.exceptions.Retry: a transient error, or a data error before its last attempt; the task is back in the queue.
        celery.exceptions.Reject: the broker took neither a retry nor a parked entry; requeued.
        Exception: a data (or unknown) error at its last attempt, recorded in ``failures/``.
    """
    settings = get_settings()
    shown = str(batch)[:80]
    try:
        return _extract_batch(run_url, batch, settings, task_id=self.request.id)
    except Exception as exc:
        cause = classify(exc)
        retries = self.request.retries or 0
        if cause in (DATA, UNKNOWN) and not run_exists(run_url, settings):
            cause = GONE  # the run was deleted while the batch ran
        if cause == TRANSIENT or (cause in (DATA, UNKNOWN) and retries + 1 < TRIES):
            countdown = retry_countdown(retries, settings.task_retry_base_s, settings.task_retry_max_s)
            log.warning("batch %s: %s error, retrying through the queue in %.1f s (attempt %d%s): %s: %s",
                        batch, cause, countdown, retries + 2, "" if cause == TRANSIENT else f" of {TRIES}",
                        exc.__class__.__name__, exc)
            try:
                raise self.retry(exc=exc, countdown=countdown, max_retries=None)
            except Retry:
                raise
            except Exception as send_exc:  # the broker did not take the new message: keep the old one
                raise Reject(f"retry of batch {batch} not sent ({send_exc}); requeued", requeue=True) from exc
        if cause == PARK:
            try:
                park_message(self.request.id, run_url, shown, exc, settings)
            except Exception as park_exc:  # the broker did not take the entry: keep the message
                raise Reject(f"batch {batch} not parked ({park_exc}); requeued", requeue=True) from exc
            return {"status": "parked", "batch": shown, "error": str(exc)[:500]}
        if cause in (GONE, CANCELLED):
            if _once(cause, run_url):
                said = str(exc) if str(run_url) in str(exc) else f"run {run_url}: {exc}"  # the error often names the run
                log.log(logging.ERROR if cause == GONE else logging.WARNING,
                        "%s; its queued batches are acknowledged without work (this is said once per run)", said)
            return {"status": cause, "batch": shown, "error": str(exc)[:500]}
        if cause == REFUSED:
            # Never run, never put back (any worker would meet it again), nothing written for it.
            log.error("batch %s of %s dropped: %s: %s", shown, run_url, exc.__class__.__name__, exc)
            return {"status": "refused", "batch": shown, "error": str(exc)[:500]}
        log.error("batch %s failed %d times (%s error): %s: %s; recorded in failures/%s.json", batch, retries + 1,
                  cause, exc.__class__.__name__, exc, batch)
        record_failure(run_url, batch, exc, settings)
        raise
