"""Enqueueing: one Celery task per planned batch that has no marker yet, on the ``gpu`` queue.

Messages carry ids only (the run's store URL and the batch name); the worker reads the batch
from the plan. A batch that is done (its marker), queued (a message of it waits in the broker's
queue), running (a live worker's presence lists it: ``hsx/fleet.py``, or a delivery of it was
claimed a moment ago and its worker has not listed it yet) or parked (a worker could not serve it)
is not sent again, so a second ``enqueue`` of a run still in progress sends only what is lost
(:func:`where_batches_are` decides).

A batch moves forward through queue, claim, presence, marker, ack, and each look reads those places
in that order, the markers last: a batch that moves while it is looked at is met again further on,
never missed (reading the markers first sent a batch that finished between the looks again). A
claim no live worker lists is either a delivery of the last second, which its worker lists within
its presence's write gap, or a dead consumer's (lost): it is looked at again
:data:`UNLISTED_CONFIRM_S` later, as is every batch found nowhere while the run has batches in
flight (a message between the queue and the claims, or put back by a reclaimer, at the first
look). A duplicate that still slips through is harmless: the second delivery finds the marker.

Before anything is planned, :func:`check_output` compares the ``--output`` with the store roots
the live workers on the broker serve (their presences) and with ``HSX_STORE_URL`` /
``HSX_ALLOWED_STORES`` where those are set: a run no worker serves would only park.

Enqueueing a run that was cancelled (``producer cancel``) resumes it: :class:`WindowSender`
removes ``cancelled.json`` before it sends the first batch, and stops the planning (raising
:class:`hsx.errors.RunCancelled`) if the run is cancelled again while it plans.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from hsx.access import allowed_roots, normalise
from hsx.broker import redis_client
from hsx.errors import BadConfig, RunCancelled
from hsx.fleet import broker_time, read_parked, read_presences, register_runs
from hsx.queue import send_batches
from hsx.records import BatchSummary, Cancelled, done_batches
from hsx.store import mask_url
from producer.words import plural
from settings import Settings


class NotServedOutput(BadConfig):
    """``enqueue --output`` names a store no live worker on the broker serves (or one outside
    ``HSX_STORE_URL`` / ``HSX_ALLOWED_STORES`` set here); ``--force`` enqueues anyway."""


def check_output(settings: Settings, broker_url: str, output: str, model: str | None = None, *,
                 force: bool = False) -> list[str]:
    """Refuse an ``--output`` that the workers on the broker would not serve; returns notes to print.

    The roots compared (by whole path segments after resolving links, :func:`hsx.access.normalise`):
    the union of the live workers' roots (their presences, ``producer/fleetview.py``), and
    ``HSX_STORE_URL`` plus ``HSX_ALLOWED_STORES`` when either is set explicitly here (the
    default ``./out`` is not a statement about the fleet). No live worker and nothing set: allowed
    (workers may start later), with a note. A live worker that serves the output but loads another
    ``HSX_MODEL`` than ``model``: a note (names are compared, not checkpoints).

    Raises:
        NotServedOutput: the output lies outside those roots and ``force`` is not given; the
            message names the output, the roots and the fixes.
        BadConfig: the output is not a store URL.
        redis errors: the broker does not answer.
    """
    from producer.fleetview import alive_presences, serves

    target = normalise(output)
    shown = mask_url(output)
    notes: list[str] = []
    _now, live = alive_presences(redis_client(broker_url), settings.queue, settings.lease_s)
    explicit = "store_url" in settings.model_fields_set or bool(settings.allowed_stores)
    problems = []
    if live:
        roots = sorted({r for p in live for r in p.roots})
        serving = [p for p in live if serves(p, output)]
        if not serving:
            problems.append(f"--output {shown} (resolved: {target}) is outside every store root served by the "
                            f"{plural(len(live), 'live worker')} on this broker: {', '.join(roots) or 'none'}")
        elif model and all(p.model and p.model != model for p in serving):
            notes.append(f"note: the live workers that serve {target} load HSX_MODEL={', '.join(sorted({p.model for p in serving}))}, "
                         f"this run's model is {model}: if that is not the same checkpoint, its batches park until a "
                         "worker with it (or with no HSX_MODEL) serves the root")
    if explicit:
        mine = allowed_roots(settings)
        if not any(r.contains(target) for r in mine):
            problems.append(f"--output {shown} (resolved: {target}) is outside HSX_STORE_URL / HSX_ALLOWED_STORES set "
                            f"here: {', '.join(str(r) for r in mine)}")
    if problems and not force:
        raise NotServedOutput(
            "; and ".join(problems) + ". Its batches would only park on the broker until a worker that serves it "
            "appears. Fix: give an --output under those roots; or start workers that serve it (their HSX_STORE_URL, "
            "or add it to HSX_ALLOWED_STORES) and set the same here; or pass --force to enqueue anyway (the messages "
            "then park, and come back when such a worker looks or with `producer reconcile RUN`). Nothing was planned "
            "or sent")
    if problems:
        notes.append("warning: --force: " + "; and ".join(problems) + ": its batches park until a worker that serves "
                     "it looks (or `producer reconcile RUN`)")
    if not live:
        notes.append(f"note: no live worker on this broker yet (no presence written within HSX_LEASE_S = "
                     f"{settings.lease_s:.0f} s): the batches wait in queue '{settings.queue}' for workers that serve "
                     f"{target}")
    return notes


@dataclass
class EnqueueResult:
    """What :func:`enqueue_batches` did, by batch name."""

    enqueued: list[str] = field(default_factory=list)
    already_done: list[str] = field(default_factory=list)
    """Batches with a marker: nothing sent."""
    in_flight: dict[str, str] = field(default_factory=dict)
    """Batches not sent because the broker holds them: ``{batch: "queued" | "running" | "parked"}``."""
    task_ids: dict[str, str] = field(default_factory=dict)
    resumed: dict | None = None
    """The ``cancelled.json`` this enqueue removed (the run had been cancelled), as JSON; else None."""


#: seconds between the two looks at a claim that no live worker lists: a live worker lists each
#: delivery in its presence within one write gap (1 s, ``workers/heartbeat.py`` MIN_WRITE_GAP_S);
#: three gaps, as ``workers/lease.py`` gives a dead worker's unlisted claims.
UNLISTED_CONFIRM_S = 3.0


@dataclass
class Look:
    """Where a run's batches stood at one look: the broker's places, then the markers."""

    state: dict[str, str] = field(default_factory=dict)
    """``{batch: "done" | "running" | "queued" | "unlisted" | "parked"}``; a batch found nowhere (or
    claimed only by dead workers) is absent. One state a batch, the first of that order it is in."""
    unlisted: dict[str, set[str]] = field(default_factory=dict)
    """``{batch: delivery tags}`` of its claims that no presence lists."""

    def active(self) -> bool:
        """Whether any batch of the run was in the broker's hands (queued, running or claimed)."""
        return any(s in ("running", "queued", "unlisted") for s in self.state.values())


def look(settings: Settings, client, run_url: str, run_store) -> Look:
    """One look at where the batches of ``run_url`` are: the queue, the live workers' presences, the
    claims (delivered, not acknowledged), the parked messages, and last the markers.

    A batch only moves forward through that order (queued, claimed, listed, marker written, acked),
    so one that moves during the look is met in a later place. Raises whatever redis raises when
    the broker does not answer.
    """
    from hsx.brokerlayout import claims, queued_of
    from producer.fleetview import gone_here, unheld_claims

    queued = queued_of(client, settings.queue, run_url).get(run_url, {})
    now = broker_time(client)
    everyone = read_presences(client, settings.queue)
    alive = {p.worker for p in everyone if p.live(now, settings.lease_s) and not gone_here(p)}
    running = {t.batch for p in everyone if p.worker in alive for t in p.tasks if t.run_url == run_url and t.batch}
    found = [c for c in claims(client) if c.run_url == run_url]
    # every claim, even one delivered a moment ago: the second look, not a clock, tells a fresh one from a dead one's
    unheld = {u.claim.tag: u.why for u in unheld_claims(found, everyone, alive, grace_s=0.0)}
    unlisted: dict[str, set[str]] = {}
    for c in found:
        if c.tag not in unheld:
            running.add(c.batch)  # a live worker lists it (by its task id alone, perhaps)
        elif unheld[c.tag] == "unlisted":  # a dead worker's (listed, not live) claim is lost: sent again, as always
            unlisted.setdefault(c.batch, set()).add(c.tag)
    parked = {p.batch for p in read_parked(client, settings.queue, run_url)}
    done = done_batches(run_store)  # last: a batch that finished during the look is seen here
    out = Look(unlisted=unlisted)
    for kind, names in (("parked", parked), ("unlisted", unlisted), ("queued", queued), ("running", running),
                        ("done", done)):
        out.state.update(dict.fromkeys(names, kind))  # later kinds win: done over running over queued...
    return out


def where_batches_are(settings: Settings, broker_url: str, run_url: str, run_store, batches: list[str],
                      confirm_s: float | None = None) -> dict[str, str]:
    """``{batch: "done" | "queued" | "running" | "parked"}`` for those of ``batches`` that need no
    message now; the others are lost (or never sent) and need one.

    A second :func:`look`, ``confirm_s`` (default :data:`UNLISTED_CONFIRM_S`) seconds later when a
    claim nobody listed was seen, is taken of the batches the first found nowhere or unlisted, if the
    run had any batch in flight: an unlisted claim still there with the same delivery tag is a dead
    consumer's (lost); a batch claimed anew, or listed, queued or done by then, is not sent.
    """
    client = redis_client(broker_url)
    first = look(settings, client, run_url, run_store)
    where = {b: first.state[b] for b in batches if first.state.get(b) not in (None, "unlisted")}
    doubtful = [b for b in batches if b not in where]
    if not doubtful or not first.active():
        return where
    if any(first.state.get(b) == "unlisted" for b in doubtful):
        time.sleep(UNLISTED_CONFIRM_S if confirm_s is None else confirm_s)
    second = look(settings, client, run_url, run_store)
    for b in doubtful:
        state = second.state.get(b)
        if state == "unlisted":  # the same delivery, unlisted both times: its consumer is gone
            state = None if second.unlisted[b] & first.unlisted.get(b, set()) else "running"
        if state is not None:
            where[b] = state
    return where


def enqueue_batches(planned, settings: Settings, broker_url: str, progress=None, *, skip_in_flight: bool = True,
                    batches: list[BatchSummary] | None = None) -> EnqueueResult:
    """Send one task per batch of ``planned`` (a :class:`producer.planner.PlannedRun`, or a
    :class:`producer.planner.PlanJob` with ``batches``: a window's) that has no marker and, with
    ``skip_in_flight``, is neither queued, running nor parked on the broker
    (:func:`where_batches_are`). Each batch lands in exactly one of the result's ``already_done``,
    ``in_flight`` and ``enqueued``.

    Reading the broker costs no ``inspect`` round trip: the queue's messages, kombu's claims and the
    workers' presences; it waits :data:`UNLISTED_CONFIRM_S` only when a claim of the run was
    listed by no worker. Raises whatever redis raises when the broker does not answer.
    """
    batches = planned.batches if batches is None else batches
    if not batches:
        return EnqueueResult()
    result = EnqueueResult()
    names = [b.batch for b in batches]
    where = dict.fromkeys(done_batches(planned.run_store), "done")  # a marker stays: no look needed for those
    left = [b for b in names if b not in where]
    if left and skip_in_flight:  # reconcile (False) looked at the broker itself
        where.update(where_batches_are(settings, broker_url, planned.run_url, planned.run_store, left))
    todo = []
    for batch in names:
        state = where.get(batch)
        if state == "done":
            result.already_done.append(batch)
        elif state is not None:
            result.in_flight[batch] = state
        else:
            todo.append(batch)
    if not todo:
        return result
    by_name = {b.batch: b for b in batches}
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

    def __call__(self, job, batches: list[BatchSummary]) -> None:
        """Enqueue ``batches`` (a window's, or on the first call every batch already planned).

        Raises:
            hsx.errors.RunCancelled: the run was cancelled (``producer cancel``) since the first call:
                the planning stops here, after the windows written (the same command resumes it).
        """
        import time

        # Only the first call can hold batches that are already queued or running (a resumed plan's
        # windows, or a finished plan's batches); a window written since, by this planner, was never
        # sent. Skipping the queue scan for those keeps each window's enqueue O(window), not O(queue)
        # (the scan reads every queued message). A concurrent planner of the same run may send one
        # twice: the second delivery finds the marker.
        first = not self._called
        self._called = True
        cancelled = Cancelled.read(job.run_store)  # one small read per window
        if cancelled is not None and first:
            # the same command again resumes a cancelled run: the record goes before any batch is sent,
            # so no worker acknowledges the new messages unrun
            Cancelled.delete(job.run_store)
            self.result.resumed = cancelled.model_dump(exclude={"schema_version"})
        elif cancelled is not None:
            raise RunCancelled(f"run {job.config.run_id} at {mask_url(job.run_url)} was cancelled while it was planned "
                               f"({cancelled.by}, {cancelled.at}): planning stopped after the windows written; the "
                               "same command resumes it")
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
