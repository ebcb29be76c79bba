"""The workers' Celery app: ``celery -A workers worker -Q gpu`` runs one worker on one device.

The broker URL comes from ``HSX_BROKER_URL`` (see settings.py); when ``HSX_MODEL`` is set the
model is loaded and warmed up as the worker starts, before it takes its first task. Each worker
process also runs the reclaimer (``workers/lease.py``): batches of dead workers are enqueued again
once their lease expires. ``celery -A workers inspect hsx_refusing`` (``status`` asks it) tells
whether a process refuses tasks after a permanent error, and why (``workers/tasks.py``).
"""

from __future__ import annotations

import logging

from celery.signals import worker_ready
from celery.worker.control import inspect_command

from hsx.errors import BadConfig
from hsx.queue import make_celery
from settings import get_settings

log = logging.getLogger(__name__)

_settings = get_settings()
if not _settings.broker_url:
    raise BadConfig(
        "HSX_BROKER_URL is not set: a worker needs the broker the producer enqueued into, "
        "e.g. HSX_BROKER_URL=redis://:PASSWORD@HOST:6379/0 (or use 'python -m producer run' on one machine)"
    )

app = make_celery(_settings, _settings.broker_url, name="workers")
app.conf.include = ["workers.tasks"]

import workers.monitor  # noqa: E402,F401  (registers the gpu_stats inspect command and the batch tracker)


@worker_ready.connect
def _preload(**_kwargs) -> None:
    if _settings.model:
        from workers.target import get_target

        get_target(_settings.model, _settings)


@worker_ready.connect
def _start_reclaimer(**_kwargs) -> None:
    from workers.lease import Reclaimer

    Reclaimer(_settings, _settings.broker_url).start()


@inspect_command()
def hsx_refusing(state) -> dict:
    """``{"host", "pid", "refusing"}``: ``refusing`` is None, or ``{"error", "since", "batch", "run"}``
    once this process stopped taking tasks after a permanent error (``workers/tasks.py``)."""
    import os
    import socket

    from workers.tasks import refusal

    r = refusal()
    return {"host": socket.gethostname(), "pid": os.getpid(), "refusing": None if r is None else dict(r)}
