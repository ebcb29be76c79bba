"""``python -m producer reconcile RUN_ADDRESS``: put back what a crash lost, clean what it left.

A batch is done if and only if its marker exists. A batch without a marker is, at any moment,
either **queued** (a message waits in the broker's queue), **running** (a live worker lists it in
its presence on the broker, ``hsx/fleet.py``: prefetched, waiting for a retry, or in progress),
**parked** (a worker could not serve it and put it aside with the reason), or **lost**: its
message was acknowledged after a failure (the task raised; ``failures/<batch>.json`` says why),
or it was claimed by a worker process that died (the message sits among kombu's claims,
and Redis would only hand it out again after the visibility timeout, hours later), or the broker
lost it (a restart without AOF). Reconcile enqueues every lost batch again, and removes its
failure record so that ``run`` and ``status`` wait for the new attempt; it puts the run's parked
messages back on the queue (once the cause is fixed, a worker that serves them takes them).
Unacknowledged deliveries of batches that have their marker are stale (a dead worker's, or a
duplicate's): they are removed from the broker. A cancelled run (``producer cancel``) is cleaned
but nothing of it is enqueued: ``producer run`` / ``enqueue`` of the same run resumes it.

Running is known from the workers' presences only, never from ``celery inspect active`` alone: a
task that finished while the broker was down stays in ``inspect`` indefinitely, and trusting it
left a batch that had no marker unsent for good. A presence is live while the broker's clock says
it was written within ``HSX_LEASE_S`` (``producer/fleetview.py``; a process of this host that is
gone is dead at once).

It also removes what dead attempts left in the store, once older than a grace period (default
one hour, far above the time between a shard's upload and its marker): shards that no marker
names, unfinished multipart uploads (S3) and temp files (local). With ``repair`` it first runs
``verify`` and, for every batch whose stored shard was read and found bad (altered, missing,
malformed, wrong schema, wrong counts or tokens), deletes the marker and the shard so that the
batch is redone; a batch verify could not read (``unverified``: the store did not answer) is left
as it is.

Looking at the broker: the queue's messages and kombu's claims are read through
``hsx/brokerlayout.py``; message bodies are decoded only when their content type is JSON (never
unpickled). A race (a message claimed between the looks, before its worker's presence lists it)
can make reconcile enqueue a batch that is in fact running; that is harmless: the second delivery
finds the marker, or loses the marker race and deletes its own shard.

A run whose plan is still written (streamed one window at a time, ``hsx/plan.py``) is reconciled
on the batches of the windows written so far: the planner enqueues each window's batches as it
writes it, so a batch of an earlier window that is neither done, queued nor running was lost
like any other. The report says the plan is not complete (``plan_complete``, ``plan_note``), and
the batches of the newest window are left alone for :data:`ENQUEUE_GRACE_S` after a live planner
wrote it (``just_planned``): it is still sending them to the queue.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from types import SimpleNamespace

from hsx.brokerlayout import claims, drop_claims
from hsx.fleet import read_parked, take_parked
from hsx.layout import PLAN_WINDOWS_PREFIX, SHARDS_PREFIX, marker_key, names_under
from hsx.plan import planned_batches, planning_failed, read_planning_record, window_id
from hsx.records import BatchSummary, Cancelled, Failure, Marker, PlanWindow, done_batches, read_failures
from hsx.runconfig import load_run
from hsx.store import Store
from producer.fleetview import BrokerView, broker_view
from producer.words import plural
from settings import Settings

log = logging.getLogger(__name__)

#: default age (seconds) before an unnamed shard or an unfinished upload counts as abandoned.
DEFAULT_GRACE_S = 3600.0
#: seconds after a live planner wrote a window during which its batches are not counted lost: the
#: planner enqueues them just after writing the window (``producer/planner.py``, ``on_window``).
ENQUEUE_GRACE_S = 30.0
#: verify problem kinds that mean the batch's stored shard (or its marker) was read and found bad:
#: redo the batch. ``unverified`` (the store did not answer) is not one of them: nothing is known
#: to be wrong, and deleting a good marker and shard would lose finished work.
REPAIRABLE = {"shard_altered", "shard_missing", "shard_unreadable", "schema", "counts", "token_echo",
              "loss_mask_echo", "missing_samples", "unplanned_sample", "marker_unreadable", "marker_mismatch",
              "config_mismatch", "recompute"}


def _is_connection_error(exc: BaseException) -> bool:
    import redis.exceptions

    return isinstance(exc, (ConnectionError, OSError, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError))


def clear_finished_claims(broker_url: str, run_url: str, done: set[str], *, dry_run: bool = False) -> list[str]:
    """Drop kombu's claims (:func:`hsx.brokerlayout.drop_claims`) of the deliveries of this run whose
    batch has its marker; returns those batches (one entry per message, sorted).

    Such an entry is stale: a worker that died after the marker (or a message delivered twice)
    leaves it, and kombu would hand it out again after the visibility timeout only to find the
    marker; meanwhile it inflates ``status``'s count of claimed messages. Dropping it is safe even if
    a live worker still holds the message: its acknowledgement is the same removal, which does
    nothing on a missing entry, and the batch is done either way.
    """
    from hsx.broker import redis_client

    client = redis_client(broker_url)
    stale = [c for c in claims(client) if c.run_url == run_url and c.batch in done]
    if stale and not dry_run:
        drop_claims(client, [c.tag for c in stale])
    return sorted(c.batch for c in stale)


def _enqueue(run_store: Store, run_url: str, config, batches: list[BatchSummary], settings: Settings,
             broker_url: str) -> list[str]:
    """Send one task per batch (the same message ``enqueue`` sends); returns the batches sent."""
    from producer.enqueue import enqueue_batches

    import kombu.pools

    planned = SimpleNamespace(run_store=run_store, batches=batches, config=config, run_url=run_url)
    try:  # reconcile has just read the broker: the batches are neither queued nor running
        return enqueue_batches(planned, settings, broker_url, skip_in_flight=False).enqueued
    except Exception as exc:  # a pooled connection from before a broker restart: once more, fresh
        if not _is_connection_error(exc):
            raise
        kombu.pools.reset()
        return enqueue_batches(planned, settings, broker_url, skip_in_flight=False).enqueued


def repair_bad_batches(run_store: Store, settings: Settings | None = None) -> dict[str, list[str]]:
    """Run ``verify``; for each batch whose stored output is bad, delete its marker and its shard.

    Returns ``{batch: [problem kinds]}`` of the batches repaired (they now count as not done).
    """
    from producer.regenerate import verify_regenerated
    from producer.verify import verify_run

    # a regenerate run's shards are JSON lines: its own checks, with verify's problem kinds (producer/regenerate.py)
    report = verify_regenerated(run_store) or verify_run(run_store, settings=settings)
    bad: dict[str, list[str]] = {}
    for p in report["problems"]:
        if p["kind"] in REPAIRABLE:
            for b in p["batch"].split(","):
                bad.setdefault(b.strip(), []).append(p["kind"])
    for batch in sorted(bad):
        try:
            marker = Marker.read(run_store, batch)
        except ValueError:  # RecordFormatError: the marker is what is bad; its shard is left to the cleanup
            marker = None
        run_store.delete(marker_key(batch))
        key = marker.shard.key if marker is not None else None
        if key:
            run_store.delete(key)
        log.warning("repair: batch %s had %s; removed its marker%s", batch, ", ".join(bad[batch]),
                    f" and shard {key}" if key else " (it did not parse: its shard, named by no marker now, is removed "
                    "by a later reconcile once older than the grace period)")
    return bad


def reconcile_run(run_store: Store, settings: Settings, broker_url: str | None, *, grace_s: float | None = DEFAULT_GRACE_S,
                  repair: bool = False, dry_run: bool = False, skip: frozenset[str] | set[str] = frozenset(),
                  unpark: bool = True) -> dict:
    """Reconcile the run at ``run_store`` with the broker at ``broker_url`` (see the module doc).

    ``grace_s``: age in seconds after which unnamed shards and unfinished uploads are removed;
    None: remove nothing. ``dry_run``: report what would be done, change nothing. ``skip``:
    batches reported as lost but not enqueued (``run`` gives up on a batch after a few redos).
    ``unpark``: put the run's parked messages back on the queue.

    Returns the report: ``run_id``, ``address``, ``batches_total``, ``batches_done``,
    ``repaired`` ({batch: kinds}), ``queued``, ``running``, ``orphaned_deliveries`` (batch lists),
    ``lost`` (``[{batch, why}]``: neither queued, running nor parked), ``enqueued`` (the lost
    batches sent again; none without a broker, with ``dry_run`` or for a cancelled run),
    ``parked`` (``[{batch, reason, cause, refused_by}]``: the run's parked messages found),
    ``unparked`` (those put back on the queue; a parked batch that has its marker is only
    removed), ``cancelled`` (the run's ``cancelled.json`` as JSON, or None), ``cleared_claims``
    (batches with a marker whose stale unacknowledged deliveries were removed from the broker, one
    entry per message; :func:`clear_finished_claims`), ``removed_shards``, ``kept_shards`` (shards no marker
    names, younger than ``grace_s``: an attempt still writing, maybe; removed by a later reconcile),
    ``removed_incomplete``,
    ``workers`` (live workers on the broker), ``workers_asked`` (whether presences were read),
    ``dry_run``, ``broker``, ``seconds``.

    A plan not complete yet: the batches of the windows written so far are reconciled;
    ``plan_complete`` is False, ``plan_note`` says so (None once complete), ``windows`` counts the
    windows written (None once complete), ``just_planned`` lists the newest window's batches left
    alone because a live planner is enqueueing them (:data:`ENQUEUE_GRACE_S`).

    Raises:
        hsx.store.MissingKey: no run.json at ``run_store``.
        hsx.errors.RecordFormatError: a damaged batch list or window record.
        redis errors: the broker does not answer.
    """
    t0 = time.perf_counter()
    config = load_run(run_store)
    batches, complete = planned_batches(run_store)
    run_url = run_store.url
    plan_note, windows, just_planned = None, None, set()
    if not complete:
        plan_note, windows, just_planned = _plan_in_progress(run_store, batches)
        log.warning("reconcile %s: %s", config.run_id, plan_note)
    repaired = {} if (not repair or dry_run) else repair_bad_batches(run_store, settings)
    cancelled = Cancelled.read(run_store)
    done = done_batches(run_store)
    missing = [b for b in batches if b.batch not in done]
    view = BrokerView()
    if broker_url and missing:
        view = broker_view(settings, broker_url, run_url)
    elif broker_url:  # nothing left to run: only parked leftovers (duplicates of done batches) to clear
        from hsx.broker import redis_client

        view.parked = {p.batch: p for p in read_parked(redis_client(broker_url), settings.queue, run_url)}
    failures = read_failures(run_store, done)
    lost = []
    why: dict[str, str] = {}
    for b in missing:
        name = b.batch
        if name in view.queued or name in view.running or name in view.parked or name in just_planned:
            continue
        lost.append(b)
        if name in repaired:
            why[name] = "repaired: " + ", ".join(sorted(set(repaired[name])))
        elif name in view.orphaned:
            why[name] = "its worker died (delivered, never acknowledged)"
        elif name in failures:
            why[name] = "failed: " + failures[name].error[:200]
        else:
            why[name] = "not queued, not running and not parked"
    if broker_url and lost:
        # One view reads presences before claims and markers first: a delivery made, or a batch finished,
        # while it read looked lost (seen: "its worker died" of a batch a live worker had just taken).
        # Enqueue's look decides, as for every message sent: markers last, a second look at unlisted claims.
        from producer.enqueue import where_batches_are

        found = where_batches_are(settings, broker_url, run_url, run_store, [b.batch for b in lost])
        lost = [b for b in lost if b.batch not in found]
        why = {name: text for name, text in why.items() if name not in found}
    cleared: list[str] = []
    if broker_url:
        cleared = clear_finished_claims(broker_url, run_url, done, dry_run=dry_run)
    enqueued: list[str] = []
    unparked: list[str] = []
    by_name = {b.batch: b for b in batches}
    if broker_url and not dry_run and view.parked and (unpark or cancelled is not None):
        from hsx.broker import redis_client

        client = redis_client(broker_url)
        back = []
        for name in sorted(view.parked):
            # HDEL decides: of several callers (a worker that serves it, another reconcile) one sends it
            if take_parked(client, settings.queue, run_url, name) and name in by_name and name not in done \
                    and cancelled is None:
                back.append(by_name[name])
        if back:
            unparked = _enqueue(run_store, run_url, config, back, settings, broker_url)
    todo = [b for b in lost if b.batch not in skip]
    if todo and not dry_run and broker_url and cancelled is None:
        for b in todo:
            Failure.delete(run_store, b.batch)
        enqueued = _enqueue(run_store, run_url, config, todo, settings, broker_url)

    removed_shards: list[str] = []
    kept_shards: list[str] = []  # unnamed, but younger than the grace period: a live attempt's, maybe
    removed_incomplete: list[str] = []
    if grace_s is not None:
        named = set()
        for batch in done_batches(run_store):
            try:
                m = Marker.read(run_store, batch)
            except ValueError:  # RecordFormatError: verify reports it
                continue
            if m is not None:
                named.add(m.shard.key)
        cutoff = time.time() - grace_s
        for key, mtime in sorted(run_store.list_modified(SHARDS_PREFIX).items()):
            if key not in named and mtime < cutoff:
                if not dry_run:
                    run_store.delete(key)
                removed_shards.append(key)
            elif key not in named:
                kept_shards.append(key)
        if not dry_run:
            removed_incomplete = run_store.remove_incomplete("", older_than_s=grace_s)

    return {
        "run_id": config.run_id,
        "address": run_url,
        "batches_total": len(batches),
        "batches_done": len(done & {b.batch for b in batches}),
        "plan_complete": complete,
        "plan_note": plan_note,
        "windows": windows,
        "just_planned": sorted(just_planned - done),
        "repaired": repaired,
        "queued": sorted(view.queued),
        "running": sorted(view.running),
        "orphaned_deliveries": sorted(view.orphaned),
        "kept_shards": kept_shards,
        "lost": [{"batch": b.batch, "why": why[b.batch]} for b in lost],
        "enqueued": enqueued,
        "parked": [{"batch": p.batch, "reason": p.reason, "cause": p.cause, "refused_by": p.refused_by}
                   for p in view.parked.values()],
        "unparked": unparked,
        "cancelled": cancelled.model_dump(exclude={"schema_version"}) if cancelled is not None else None,
        "cleared_claims": cleared,
        "removed_shards": removed_shards,
        "removed_incomplete": removed_incomplete,
        "workers": view.workers,
        "workers_asked": view.asked,
        "dry_run": dry_run,
        "broker": bool(broker_url),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def _plan_in_progress(run_store: Store, batches: list[BatchSummary]) -> tuple[str, int, set[str]]:
    """(the note, windows written, the newest window's batches a live planner is enqueueing) of a
    plan not complete yet."""
    record = read_planning_record(run_store)
    why = planning_failed(record)
    windows = record.windows if record is not None else None
    if windows is None:  # a failed planner's record may not carry the progress: one listing counts them
        windows = len(names_under(run_store.list(PLAN_WINDOWS_PREFIX), PLAN_WINDOWS_PREFIX))
    just_planned: set[str] = set()
    fresh = (record is not None and why is None and record.updated_unix is not None
             and time.time() - record.updated_unix < ENQUEUE_GRACE_S)
    if fresh and windows:
        try:
            newest = PlanWindow.read(run_store, window_id(windows - 1))
        except ValueError:  # RecordFormatError: verify names it
            newest = None
        if newest is not None:
            just_planned = {b.batch for b in newest.batches}
    so_far = (f"{plural(len(batches), 'batch')} of the windows written so far" if batches
              else "no window is written yet")
    if why:
        state = f"its planning stopped ({why}); run the same `producer run` / `enqueue` command again to finish it"
    elif record is None:
        state = "no planner record (plan/planning.json)"
    else:
        state = f"the planner (pid {record.pid} on {record.host}) is still writing it"
    return f"the plan is not complete: reconciling the {so_far}; {state}", windows, just_planned


class RunReconciler:
    """What ``producer run`` calls while it waits: :func:`reconcile_run` without any cleanup, each
    batch enqueued again at most ``max_redo`` times (a batch that fails every time, such as one
    whose every sample is quarantined, ends the run as failed instead of looping)."""

    def __init__(self, run_store: Store, settings: Settings, broker_url: str, max_redo: int = 2):
        self.run_store, self.settings, self.broker_url, self.max_redo = run_store, settings, broker_url, max_redo
        self.redone: dict[str, int] = {}

    def __call__(self) -> list[str]:
        """Reconcile once; returns the batches enqueued again (empty: nothing was lost, or nothing may be redone)."""
        skip = {b for b, n in self.redone.items() if n >= self.max_redo}
        try:
            report = reconcile_run(self.run_store, self.settings, self.broker_url, grace_s=None, skip=skip)
        except Exception as exc:  # the run goes on; its own wait reports what stays undone
            log.warning("reconcile during the run failed: %s", exc)
            return []
        for b in report["enqueued"]:
            self.redone[b] = self.redone.get(b, 0) + 1
        if report["enqueued"]:
            log.info("reconcile: enqueued again %s", ", ".join(f"{x['batch']} ({x['why']})" for x in report["lost"]
                                                             if x["batch"] in report["enqueued"]))
        return report["enqueued"]


@contextmanager
def reconcile_broker(settings: Settings):
    """The broker URL ``reconcile`` talks to: ``HSX_BROKER_URL``; else the embedded broker of this
    machine (``HSX_STATE_DIR``): the one a ``producer run`` has running, or one started from its AOF
    for the duration (batches enqueued there are taken by the next ``producer run``)."""
    from hsx.broker import EmbeddedBroker, running_embedded_broker

    if settings.broker_url:
        yield settings.broker_url
        return
    url = running_embedded_broker(settings.broker_state_dir)
    if url:
        yield url
        return
    broker = EmbeddedBroker(settings.broker_state_dir).start()
    try:
        yield broker.url
    finally:
        broker.stop()


__all__ = ["reconcile_run", "reconcile_broker", "RunReconciler", "clear_finished_claims", "repair_bad_batches",
           "DEFAULT_GRACE_S"]
