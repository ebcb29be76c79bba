"""The Celery wiring both sides share: app settings, the queue, the task name.

The producer sends tasks by name (``app.send_task``) and never imports ``workers``; the workers
register the task under the same name. Settings follow docs/FACTS.md section 5: late acks with
reject-on-worker-lost (a killed worker's batch is delivered again), prefetch 1, the threads pool
with one thread (heartbeats keep flowing during a long forward), JSON only, and one visibility
timeout far above the longest task, the same on every app that talks to the broker.
"""

from __future__ import annotations

from typing import Iterable

from celery import Celery

from hsx.brokerlayout import EXTRACT_TASK, restore_options
from hsx.records import BatchSummary
from settings import Settings


def celery_config(settings: Settings, broker_url: str) -> dict:
    """Celery configuration for ``broker_url`` (result backend: the same server, where the worker's
    deduplication of finished tasks looks)."""
    transport = {"visibility_timeout": settings.visibility_timeout_s, **restore_options(settings.visibility_timeout_s)}
    return dict(
        broker_url=broker_url,
        result_backend=broker_url,
        broker_transport_options=transport,
        result_backend_transport_options=transport,
        broker_connection_retry_on_startup=True,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_track_started=True,
        task_send_sent_event=True,
        worker_send_task_events=True,
        worker_prefetch_multiplier=1,
        worker_deduplicate_successful_tasks=True,
        worker_pool="threads",
        worker_concurrency=settings.task_threads,
        worker_hijack_root_logger=False,
        task_default_queue=settings.queue,
        task_routes={EXTRACT_TASK: {"queue": settings.queue}},
        result_expires=7 * 24 * 3600,
        result_extended=True,
    )


def make_celery(settings: Settings, broker_url: str, name: str = "hsx") -> Celery:
    """A configured Celery app. Raises nothing; connection errors appear on first use."""
    app = Celery(name)
    app.conf.update(celery_config(settings, broker_url))
    return app


def task_argsrepr(run_id: str, batch: str, num_samples=None, num_tokens=None) -> str:
    """What Flower, ``celery inspect`` and worker logs show as a task's arguments: run, batch,
    samples, tokens. The message itself carries only ``[run_url, batch]``; this is its ``argsrepr`` header."""
    text = f"run={run_id} batch={batch}"
    if num_samples is not None:
        text += f" samples={num_samples} tokens={num_tokens}"
    return text


def send_batches(settings: Settings, broker_url: str, run_url: str, run_id: str, batches: Iterable[BatchSummary],
                 on_sent=None) -> dict[str, str]:
    """Send one extraction task per batch of the run at ``run_url`` (its plan's summaries: the
    message carries the name, ``argsrepr`` the samples and tokens too) onto ``HSX_QUEUE``; returns
    ``{batch: task id}``. The task id is
    ``<run_id>.<batch>.<8 hex>``: readable in Flower, new for every send. ``on_sent(batch)`` is
    called after each. Raises whatever kombu raises when the broker does not take a message."""
    import uuid

    app = make_celery(settings, broker_url, name="hsx-send")
    sent: dict[str, str] = {}
    try:
        with app.producer_or_acquire() as producer:
            for b in batches:
                batch = b.batch
                task_id = f"{run_id}.{batch}.{uuid.uuid4().hex[:8]}"
                app.send_task(EXTRACT_TASK, args=[run_url, batch], queue=settings.queue, task_id=task_id,
                              producer=producer, kwargsrepr="{}",
                              argsrepr=task_argsrepr(run_id, batch, b.num_samples, b.num_tokens))
                sent[batch] = task_id
                if on_sent is not None:
                    on_sent(batch)
    finally:
        app.close()
    return sent
