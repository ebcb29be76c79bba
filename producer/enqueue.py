"""Enqueueing: one Celery task per planned batch that has no marker yet, on the ``gpu`` queue.

Messages carry ids only (the run's store URL and the batch name); the worker reads the batch
from the plan. A batch that is queued (a message of it waits in the broker's queue) or running (a
live worker holds its delivery: ``inspect active`` / ``reserved``) is not sent again, so a second
``enqueue`` of a run still in progress sends only what is lost (``producer/reconcile.py``'s
``broker_view`` decides). A duplicate that slips through a race (a message claimed between the
looks) is still harmless: the second delivery finds the marker and does nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hsx.broker import redis_client
from hsx.fleet import register_runs
from hsx.queue import send_batches
from hsx.records import done_batches
from settings import Settings


@dataclass
class EnqueueResult:
    """What :func:`enqueue_batches` did, by batch name."""

    enqueued: list[str] = field(default_factory=list)
    already_done: list[str] = field(default_factory=list)
    """Batches with a marker: nothing sent."""
    in_flight: dict[str, str] = field(default_factory=dict)
    """Batches not sent because the broker holds them: ``{batch: "queued" | "running"}``."""
    task_ids: dict[str, str] = field(default_factory=dict)


def enqueue_batches(planned, settings: Settings, broker_url: str, progress=None, *, skip_in_flight: bool = True,
                    inspect_timeout_s: float | None = None, batches: list[dict] | None = None) -> EnqueueResult:
    """Send one task per batch of ``planned`` (a :class:`producer.planner.PlannedRun`, or a
    :class:`producer.planner.PlanJob` with ``batches``: a window's) that has no marker and, with
    ``skip_in_flight``, is neither queued nor running on the broker.

    The workers are asked (``inspect``, up to ``inspect_timeout_s``, default
    ``HSX_INSPECT_TIMEOUT_S``) only when a batch to send has a delivered, unacknowledged message,
    so enqueueing a fresh run costs no wait. Raises whatever redis raises when the broker does not
    answer.
    """
    from producer.reconcile import broker_view

    batches = planned.batches if batches is None else batches
    if not batches:
        return EnqueueResult()
    done = done_batches(planned.run_store)
    result = EnqueueResult()
    todo = []
    for b in batches:
        (result.already_done if b["batch"] in done else todo).append(b["batch"])
    by_name = {b["batch"]: b for b in batches}
    if todo and skip_in_flight:
        timeout = settings.inspect_timeout_s if inspect_timeout_s is None else inspect_timeout_s
        view = broker_view(settings, broker_url, planned.config.run_id, planned.run_url, inspect_timeout_s=timeout,
                           only=set(todo))
        for batch in todo:
            if batch in view.queued:
                result.in_flight[batch] = "queued"
            elif batch in view.running:
                result.in_flight[batch] = "running"
        todo = [b for b in todo if b not in result.in_flight]
    if not todo:
        return result
    task = progress.add_task("enqueueing", total=len(todo)) if progress else None
    register_runs(redis_client(broker_url), settings.queue, [planned.run_url])
    sent = send_batches(settings, broker_url, planned.run_url, planned.config.run_id, [by_name[b] for b in todo],
                        on_sent=(lambda _b: progress.advance(task)) if progress else None)
    result.enqueued += list(sent)
    result.task_ids.update(sent)
    return result


class WindowSender:
    """``on_window`` of :func:`producer.planner.plan_run`: enqueues each window's batches as soon as
    they are in the store, and sums up what it did in :attr:`result`.

    One ``enqueued`` progress task counts the batches sent over the whole plan.
    """

    def __init__(self, settings: Settings, broker_url: str, progress=None):
        self.settings, self.broker_url, self.progress = settings, broker_url, progress
        self.result = EnqueueResult()
        self._task = None
        self._called = False
        self.first_sent_at: float | None = None

    def __call__(self, job, batches: list[dict]) -> None:
        import time

        # Only the first call can hold batches that are already queued or running (a resumed plan's
        # windows, or a finished plan's batches); a window written since, by this planner, was never
        # sent. Skipping the queue scan for those keeps each window's enqueue O(window), not O(queue)
        # (the scan reads every queued message). A concurrent planner of the same run may send one
        # twice: the second delivery finds the marker.
        first = not self._called
        self._called = True
        part = enqueue_batches(job, self.settings, self.broker_url, None, batches=batches, skip_in_flight=first)
        if part.enqueued and self.first_sent_at is None:
            self.first_sent_at = time.time()
        self.result.enqueued += part.enqueued
        self.result.already_done += part.already_done
        self.result.in_flight.update(part.in_flight)
        self.result.task_ids.update(part.task_ids)
        if self.progress is not None:
            n = len(self.result.enqueued)
            if self._task is None:
                self._task = self.progress.add_task("enqueued", total=None)
            self.progress.update(self._task, completed=n, total=n,
                                 info=f"{len(self.result.already_done):,} already done" if self.result.already_done else "")
