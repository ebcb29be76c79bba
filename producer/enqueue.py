"""Enqueueing: one Celery task per planned batch that has no marker yet, on the ``gpu`` queue.

Messages carry ids only (the run's store URL and the batch name); the worker reads the batch
from the plan. Re-enqueueing a batch that is queued or running already is harmless: the second
delivery finds the marker and does nothing.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from core.marker import done_batches
from core.queue import EXTRACT_TASK, make_celery
from settings import Settings


@dataclass
class EnqueueResult:
    enqueued: list[str] = field(default_factory=list)
    already_done: list[str] = field(default_factory=list)
    task_ids: dict[str, str] = field(default_factory=dict)


def task_argsrepr(run_id: str, batch: dict) -> str:
    """What Flower, ``celery inspect`` and worker logs show as a task's arguments: run, batch, samples, tokens.

    The message itself carries only ``[run_url, batch]``; this is the ``argsrepr`` header beside it.
    """
    return f"run={run_id} batch={batch['batch']} samples={batch['num_samples']} tokens={batch['num_tokens']}"


def enqueue_batches(planned, settings: Settings, broker_url: str, progress=None) -> EnqueueResult:
    """Send one task per batch of ``planned`` (a :class:`producer.planner.PlannedRun`) without a marker."""
    done = done_batches(planned.run_store)
    result = EnqueueResult()
    todo = []
    for b in planned.batches:
        (result.already_done if b["batch"] in done else todo).append(b["batch"])
    by_name = {b["batch"]: b for b in planned.batches}
    if not todo:
        return result
    app = make_celery(settings, broker_url, name="producer")
    task = progress.add_task("enqueueing", total=len(todo)) if progress else None
    try:
        with app.producer_or_acquire() as producer:
            for batch in todo:
                task_id = f"{planned.config.run_id}.{batch}.{uuid.uuid4().hex[:8]}"
                app.send_task(
                    EXTRACT_TASK,
                    args=[planned.run_url, batch],
                    queue=settings.queue,
                    task_id=task_id,
                    producer=producer,
                    argsrepr=task_argsrepr(planned.config.run_id, by_name[batch]),
                    kwargsrepr="{}",
                )
                result.enqueued.append(batch)
                result.task_ids[batch] = task_id
                if progress:
                    progress.advance(task)
    finally:
        app.close()
    return result
