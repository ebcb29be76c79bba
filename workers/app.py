"""The workers' Celery app: ``celery -A workers worker -Q gpu`` runs one worker on one device.

The broker URL comes from ``HSX_BROKER_URL`` (see settings.py); when ``HSX_MODEL`` is set the
model is loaded and warmed up as the worker starts, before it takes its first task. Each worker
process also runs the reclaimer (``workers/lease.py``): batches of dead workers are enqueued again
once their lease expires, and messages it can serve that another worker parked come back. From
start to exit it writes its presence on the broker (``hsx/fleet.py``: its roots, model, state and
the tasks it holds; ``workers/heartbeat.py``).
"""

from __future__ import annotations

import logging

from celery.signals import task_postrun, task_received, task_rejected, task_revoked, task_unknown, worker_ready

from hsx.errors import BadConfig
from hsx.queue import EXTRACT_TASK, make_celery
from settings import get_settings

log = logging.getLogger(__name__)

_settings = get_settings()
if not _settings.broker_url:
    raise BadConfig(
        "HSX_BROKER_URL is not set: a worker needs the broker the producer enqueued into, "
        "e.g. HSX_BROKER_URL=redis://:PASSWORD@HOST:6379/0 (or use 'python -m producer run' on one machine)"
    )

app = make_celery(_settings, _settings.broker_url, name="workers")

# The app imports what runs on it, one way: the task's body (workers/tasks.py imports no app) and the
# gpu_stats inspect command (workers/monitor.py).
from workers import faults, monitor, tasks  # noqa: E402,F401
from workers.heartbeat import process_heartbeat, runs_dir  # noqa: E402

extract_batch = app.task(name=EXTRACT_TASK, **tasks.TASK_OPTIONS)(tasks.extract_batch)


@worker_ready.connect
def _attach_presence(sender=None, **_kwargs) -> None:
    from hsx.access import allowed_roots

    process_heartbeat(_settings.heartbeat_s).attach_broker(
        _settings.broker_url, _settings.queue, [str(r) for r in allowed_roots(_settings)], _settings.model,
        node=getattr(sender, "hostname", None))


@worker_ready.connect
def _preload(**_kwargs) -> None:
    if _settings.model:
        from workers.target import get_target

        heartbeat = process_heartbeat(_settings.heartbeat_s)
        heartbeat.loading(True)  # the presence says so: a first GPU worker compiles kernels for minutes
        try:
            target = get_target(_settings.model, _settings)
        finally:
            heartbeat.loading(False)
        listed = runs_dir()
        if listed:  # the launcher tells a death while loading from one after it, and says the worker is ready
            import os

            from workers.launcher import write_ready

            try:
                write_ready(listed / str(os.getpid()), target)
            except OSError as exc:
                log.warning("ready file not written in %s: %s", listed, exc)


@worker_ready.connect
def _start_reclaimer(**_kwargs) -> None:
    from workers.lease import Reclaimer

    Reclaimer(_settings, _settings.broker_url).start()


def _held(request) -> tuple[str | None, list]:
    return getattr(request, "id", None), list(getattr(request, "args", None) or [])


@task_received.connect
def _on_received(request=None, **_kwargs) -> None:
    # The presence lists a task from its delivery on (prefetched, or held for a retry's countdown):
    # a live worker's claim is never taken for a dead one's (workers/lease.py).
    faults.hooks().at_received()  # HSX_FAULTS=die_received (tests): dies here, before the presence lists it
    task_id, args = _held(request)
    if task_id and getattr(request, "name", None) == EXTRACT_TASK and len(args) >= 2:
        process_heartbeat(_settings.heartbeat_s).received(task_id, str(args[0]), str(args[1]))


def _release(task_id) -> None:
    if task_id:
        process_heartbeat(_settings.heartbeat_s).released(str(task_id))


@task_postrun.connect
def _on_postrun(task_id=None, **_kwargs) -> None:
    _release(task_id)


@task_revoked.connect
def _on_revoked(request=None, **_kwargs) -> None:
    _release(getattr(request, "id", None))


@task_rejected.connect
def _on_rejected(message=None, **_kwargs) -> None:
    _release(((getattr(message, "headers", None) or {}).get("id")))


@task_unknown.connect
def _on_unknown(id=None, **_kwargs) -> None:  # noqa: A002 (the signal's own argument name)
    _release(id)
