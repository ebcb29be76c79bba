"""Leases, parked messages and lost messages: what every worker's reclaimer thread looks after,
so that no batch waits for a command.

**Clocks.** Nothing here compares this machine's wall clock with a time another machine wrote.
Two clocks are used, and only these: the **broker's** (Redis ``TIME``, :func:`hsx.fleet.broker_time`),
which stamps every presence and every time this module writes, and this process's own
``time.monotonic()``, which measures how long *this* observer has seen something. A node whose
clock is minutes ahead or behind reclaims nothing early and nothing late.

**The lease** of a delivered message is the presence of the worker that holds it
(:class:`hsx.fleet.Presence`, ``hsx:<queue>:workers``): a worker lists a task from its delivery
(``received``, a prefetched message or a retry waiting for its countdown) through every phase of
its batch (``workers/heartbeat.py``), and rewrites its presence every ``HSX_HEARTBEAT_S``, stamped by
the broker. The claims are kombu's (:func:`hsx.brokerlayout.claims`); each look
sorts each claim by who lists it (its task id, or its run and batch):

- a **live** presence (not ``stopped``, stamped within ``HSX_LEASE_S`` of the broker's now): the
  lease is held (a long batch, a worker paused on a full store); nothing is done;
- only a presence that is ``stopped`` (its launcher saw it die) or **stale** (not rewritten for
  ``HSX_LEASE_S`` by the broker's clock, and seen so by this observer on looks
  :func:`stale_confirm_s` apart): its holder is dead; the claim is reclaimed now. The second look
  is there because a broker that was down makes every presence stale at once; live workers
  rewrite theirs within a heartbeat of its return;
- **no presence** (a consumer that writes none, a message its worker had not listed yet when it
  died): reclaimed once this observer has seen that same delivery unacknowledged and unlisted for
  ``HSX_LEASE_S`` of its own monotonic time.

**A reclaim**, after a check that the batch has no marker (if it has, the worker died after its
marker and before its ack: the stale claim is only dropped):

1. creates ``<run>/reclaims/<batch>-<tag>.<n>.json`` with a conditional create (``Store.create``:
   S3 ``IfNoneMatch``, local ``O_EXCL``): of all the live workers, exactly one wins; no leader;
2. puts the message back with kombu's own restore (:func:`hsx.brokerlayout.restore_claim`, the
   code its visibility-timeout sweep runs): in one Redis transaction the entry leaves the claims
   and the same message is pushed onto the end of the queue that workers take from next
   (``RPUSH``; producers ``LPUSH`` and consumers ``BRPOP``). A stranded
   batch therefore runs next, not after the thousands queued behind it, and the message is never
   lost or doubled in between.

A winner that dies between 1 and 2 leaves the entry in place: once the record is ``HSX_LEASE_S``
old (broker clock), the next look takes attempt ``n + 1``. From a SIGKILL to the batch being next
in line: ``HSX_LEASE_S`` plus two looks (``HSX_RECLAIM_INTERVAL_S`` each, 2 min 30 s by default),
plus the batch a free worker is finishing. A lease that expires under a live worker (cut off from
the broker for longer than the lease) only makes a duplicate, which loses the marker race and
deletes its own shard.

**A death the launcher saw** needs no lease: when ``python -m workers`` reaps a child that died,
it puts back every claim the child's presence (and its status records) listed at once
(:meth:`Reclaimer.reclaim_dead`), then marks the presence ``stopped``, so that any reclaimer takes
what is left at its next look. A message delivered to the child in the second before it died is
claimed but listed by nobody; the claims unlisted at the death and still unlisted
:func:`unlisted_confirm_s` later (a live worker lists its own deliveries within a second) are put
back too (:meth:`Reclaimer.reclaim_unlisted`), instead of waiting for ``HSX_LEASE_S``.

**Parked messages come back** (:meth:`Reclaimer.unpark`): each look reads ``hsx:<queue>:parked``;
an entry this worker serves (its run lies under this worker's roots, the worker is not among those
that refused it, it can read the run, and with ``HSX_MODEL`` the run was planned for that model)
is taken (``HDEL``: of all the workers, one) and sent again. A worker that does not serve it may
take it from the queue first and park it again; the next look of a worker that serves it sends it
again, until one that serves it runs it.

**Lost messages come back** (:meth:`Reclaimer.heal`): at each look, one worker of the fleet is
elected (``SET NX EX``, one look every ``max(HSX_RECLAIM_INTERVAL_S, HSX_LEASE_S / 4)``) and walks
the queue's runs (:func:`hsx.fleet.known_runs`: those enqueued plus those the live workers'
presences served). A planned batch of a run that is neither done (marker), failed (failure
record), claimed, held by a live worker, parked nor queued is noted with the broker time it was
first found so (``hsx:<queue>:unaccounted``); one still unaccounted ``HSX_LEASE_S`` later is
enqueued again with a reclaim record saying why (``lost: ...``, delivery tag ``lost-<ms>``).
A broker that lost its data (restarted without persistence, flushed) so heals with no command:
the live workers rewrite their presences, which name the runs they served. To bound the cost of a
look, the queue is read (``LRANGE`` in chunks) only while it holds at most :data:`HEAL_SCAN_MAX`
messages; a longer queue means a busy fleet, and the look is skipped: lost batches are found once
the queue drains. Cancelled runs are skipped; finished and deleted ones are dropped from the set.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from hsx.brokerlayout import Claim, claims, declare_queue, drop_claims, queued_of, restore_claim, waiting
from hsx.records import BatchSummary

log = logging.getLogger(__name__)

#: attempts of one stale delivery's reclaim (a winner that died before it finished), at most.
MAX_ATTEMPTS = 5
#: the healer reads the queue only while it holds at most this many messages (see the module doc).
HEAL_SCAN_MAX = 20_000
#: seconds a finished run is not looked at again by the healer of this process.
FINISHED_RECHECK_S = 600.0

#: the classes of a claim (:func:`lease_state`).
HELD, DEAD, UNLISTED = "held", "dead", "unlisted"


def stale_confirm_s(settings) -> float:
    """Seconds (this observer's monotonic clock) between the two looks that must both find a
    presence stale before its claims are taken: two heartbeats, at most half the lease, at least 1 s."""
    return max(1.0, min(settings.lease_s / 2, 2 * settings.heartbeat_s))


#: seconds of broker time after its last write that a presence is kept (the elected healer removes older ones).
PRESENCE_KEEP_S = 86400.0


def unlisted_confirm_s(settings) -> float:
    """Seconds after a death the launcher saw before an unlisted claim is taken as the dead worker's:
    three of the presence's shortest write gaps (a live worker lists a delivery within one), at least 3 s."""
    from workers.heartbeat import MIN_WRITE_GAP_S

    return max(3.0, 3 * MIN_WRITE_GAP_S)


def lease_state(claim: Claim, presences, now: float, lease_s: float) -> tuple[str, list]:
    """Who holds ``claim`` at broker time ``now``.

    Returns ``(state, presences)``: :data:`HELD` and the live presences that list it;
    :data:`DEAD` and the presences (stopped or stale) that list it, none of them live;
    :data:`UNLISTED` and ``[]`` when no presence lists it. A presence lists a claim by its task id,
    or by its run and batch (another delivery of the same batch, held by a live worker, keeps it too).
    """
    listing = [p for p in presences
               if p.holds(task_id=claim.task_id, run_url=claim.run_url, batch=claim.batch)]
    live = [p for p in listing if p.live(now, lease_s)]
    if live:
        return HELD, live
    if listing:
        return DEAD, listing
    return UNLISTED, []


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="seconds")


@dataclass
class Look:
    """What one look of the reclaimer did (:meth:`Reclaimer.once`)."""

    reclaimed: list[dict] = field(default_factory=list)
    """Claims put back: ``{"batch", "run_url", "tag", "attempt", "enqueued", "why"}``."""
    unparked: list[dict] = field(default_factory=list)
    """Parked messages sent again: ``{"batch", "run_url", "parked_by", "reason"}``."""
    healed: list[dict] = field(default_factory=list)
    """Lost batches enqueued again: ``{"batch", "run_url", "tag", "attempt", "lost_s"}``."""
    healer: bool = False
    """Whether this process was the elected healer of this look."""


class Reclaimer:
    """Puts back dead workers' claims, parked messages it serves and lost batches (see the module doc).

    Args:
        settings: ``HSX_LEASE_S``, ``HSX_RECLAIM_INTERVAL_S``, ``HSX_HEARTBEAT_S``, the queue, the
            store roots (``HSX_STORE_URL``, ``HSX_ALLOWED_STORES``), ``HSX_MODEL`` and the store credentials.
        broker_url: the broker the workers consume from.
        me: this process's name in the reclaim records and the parked entries (``<host>-<pid>``).
        clock: this observer's monotonic clock (seconds); tests pass their own.
    """

    def __init__(self, settings, broker_url: str, me: str | None = None, clock=time.monotonic):
        from workers.heartbeat import worker_name

        self.settings, self.broker_url = settings, broker_url
        self.me = me or worker_name()
        self.clock = clock
        self._client = None
        self._stores: dict[str, object] = {}
        self._unlisted: dict[str, float] = {}  # delivery tag -> monotonic time first seen unlisted
        self._stale: dict[str, tuple[float, float]] = {}  # worker -> (its stamp, monotonic time first seen stale)
        self._plans: dict[str, dict[str, BatchSummary]] = {}  # run -> its complete plan's batches (it never changes)
        self._finished: dict[str, float] = {}  # run -> monotonic time the healer found it finished
        self._unfit: set[str] = set()  # runs planned for another model than this worker's HSX_MODEL
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # --- the broker and the stores ------------------------------------------------------------

    def client(self):
        """This reclaimer's redis-py client of the broker (one connection pool, reconnecting by itself)."""
        from hsx.broker import redis_client

        if self._client is None:
            self._client = redis_client(self.broker_url)
        return self._client

    def _store(self, run_url: str):
        from hsx.store import open_store

        if run_url not in self._stores:
            self._stores[run_url] = open_store(run_url, self.settings, create=False)
        return self._stores[run_url]

    def _open_run(self, run_url: str):
        """The run's store and config; None when the address surely holds no run any more (deleted).

        Raises a StoreError the store raises (down, credentials refused), RunFormatError."""
        from hsx.access import normalise
        from hsx.runconfig import load_run
        from hsx.store import MissingKey

        root = normalise(run_url)
        if root.is_local and not os.path.isfile(os.path.join(root.path, "run.json")):
            self._stores.pop(run_url, None)
            return None
        store = self._store(run_url)
        try:
            return store, load_run(store)
        except MissingKey:
            self._stores.pop(run_url, None)
            return None

    def _serves(self, run_url: str) -> bool:
        from hsx.access import check_run_allowed

        try:
            check_run_allowed(run_url, self.settings)
            return True
        except Exception:  # NotServed, Refused, BadConfig: not this worker's to open
            return False

    # --- one look -----------------------------------------------------------------------------

    def once(self) -> Look:
        """One look: reclaim the dead workers' claims, send back the parked messages this worker
        serves, and (if elected) heal lost batches. Returns what it did.

        Raises whatever redis raises when the broker does not answer (the thread logs it and goes
        on); a store that fails for one run is logged and skips that run only."""
        from hsx.fleet import broker_time, read_presences

        client = self.client()
        look = Look()
        now = broker_time(client)
        presences = read_presences(client, self.settings.queue)
        look.reclaimed = self.reclaim_stale(presences, now)
        try:
            look.unparked = self.unpark()
        except Exception as exc:  # a broker hiccup: the next look tries again
            log.warning("parked messages not looked at: %s: %s", exc.__class__.__name__, exc)
        try:
            look.healer, look.healed = self.heal()
        except Exception as exc:
            log.warning("lost batches not looked for: %s: %s", exc.__class__.__name__, exc)
        return look

    def reclaim_stale(self, presences, now: float) -> list[dict]:
        """Reclaim every claim whose holder is dead or that nobody lists for ``HSX_LEASE_S`` (module
        doc), given the presences read at broker time ``now``. Returns the reclaims made.

        Raises whatever redis raises when the broker does not answer."""
        lease_s = self.settings.lease_s
        mono = self.clock()
        confirm_s = stale_confirm_s(self.settings)
        client = self.client()
        # Which stale presences this observer has seen stale long enough (the broker-outage guard).
        seen_stale: set[str] = set()
        current = {}
        for p in presences:
            if p.state == "stopped" or p.live(now, lease_s):
                continue
            first = self._stale.get(p.worker)
            if first is None or first[0] != p.stamp:
                first = (p.stamp, mono)
            current[p.worker] = first
            if mono - first[1] >= confirm_s:
                seen_stale.add(p.worker)
        self._stale = current
        done = []
        unlisted_now: dict[str, float] = {}
        for claim in claims(client):
            state, holders = lease_state(claim, presences, now, lease_s)
            why = None
            if state == HELD:
                continue
            if state == DEAD:
                stopped = [p for p in holders if p.state == "stopped"]
                if stopped:
                    why = "its worker died"
                elif all(p.worker in seen_stale for p in holders):
                    age = min(now - p.stamp for p in holders)
                    why = f"lease expired (its worker's presence not rewritten for {age:.0f} s)"
                else:
                    continue  # stale on this look only: confirmed on a later one
            else:
                first = self._unlisted.get(claim.tag, mono)
                unlisted_now[claim.tag] = first
                if mono - first < lease_s:
                    continue
                why = f"lease expired (no worker listed it for {mono - first:.0f} s)"
            try:
                result = self._reclaim(claim, now, why)
            except Exception as exc:  # one run's store down must not stop the others' reclaims
                log.warning("reclaim of batch %s of %s failed: %s: %s", claim.batch, claim.run_url,
                            exc.__class__.__name__, exc)
                continue
            if result is not None:
                unlisted_now.pop(claim.tag, None)
                done.append(result)
        self._unlisted = unlisted_now  # tags no longer claimed, or listed again, are forgotten
        return done

    def reclaim_dead(self, worker: str, batches: dict[str, list[str]] | None = None,
                     confirm_unlisted_s: float | None = None) -> list[dict]:
        """Put back at once every claim that worker ``worker`` (``<host>-<pid>``), which died, held:
        those its presence lists, and the ``batches`` of each run (``{run address: [batch]}``, from
        its status records); then mark its presence ``stopped``. A claim that another live worker
        lists is left to it. With ``confirm_unlisted_s``, the claims no presence lists now are
        looked at again that many seconds later (this call waits), and those still unlisted are
        put back (:meth:`reclaim_unlisted`: messages delivered to it that it died before listing).
        For ``python -m workers``, which saw the process die. Returns the reclaims made now, as
        :meth:`reclaim_stale` does.

        Raises whatever redis raises when the broker does not answer (the launcher logs it; the
        lease reclaims those batches later)."""
        from hsx.fleet import broker_time, read_presences, write_presence

        client = self.client()
        now = broker_time(client)
        presences = read_presences(client, self.settings.queue)
        dead = next((p for p in presences if p.worker == worker), None)
        others = [p for p in presences if p.worker != worker]
        wanted = {(url, b) for url, bs in (batches or {}).items() for b in bs}
        done = []
        for claim in claims(client):
            listed = (claim.run_url, claim.batch) in wanted or (
                dead is not None and dead.holds(task_id=claim.task_id, run_url=claim.run_url,
                                                batch=claim.batch))
            if not listed or lease_state(claim, others, now, self.settings.lease_s)[0] == HELD:
                continue
            try:
                result = self._reclaim(claim, now, "its worker died")
            except Exception as exc:
                log.warning("reclaim of batch %s of %s (worker %s died) failed: %s: %s", claim.batch,
                            claim.run_url, worker, exc.__class__.__name__, exc)
                continue
            if result is not None:
                done.append(result)
        if dead is not None and dead.state != "stopped":
            # Its tasks stay listed: what this call could not put back, any reclaimer takes at its next look.
            write_presence(client, self.settings.queue, dead.model_copy(update={"state": "stopped"}))
        unlisted = {c.tag for c in claims(client) if lease_state(c, presences, now, self.settings.lease_s)[0] == UNLISTED}
        if unlisted and confirm_unlisted_s is not None:
            time.sleep(confirm_unlisted_s)  # in the caller's thread: a launcher giving up next still does it
            done += self.reclaim_unlisted(unlisted)
        return done

    def reclaim_unlisted(self, tags: set[str]) -> list[dict]:
        """Put back the claims among delivery ``tags`` that no presence lists, live or not.

        A worker lists a message within about a second of its delivery (``workers/heartbeat.py``:
        ``received``, then its presence's next write); one that died inside that second leaves a
        claim nobody lists, which only the lease would take back (``HSX_LEASE_S``, minutes). After a
        death the launcher saw, the claims unlisted then and still unlisted :func:`unlisted_confirm_s`
        later were the dead worker's (a live worker would have listed its own by then); a live
        worker whose presence could not be written for that long only loses a marker race.
        Returns the reclaims made; raises whatever redis raises when the broker does not answer."""
        from hsx.fleet import broker_time, read_presences

        client = self.client()
        now = broker_time(client)
        presences = read_presences(client, self.settings.queue)
        done = []
        for claim in claims(client):
            if claim.tag not in tags or lease_state(claim, presences, now, self.settings.lease_s)[0] != UNLISTED:
                continue
            try:
                result = self._reclaim(claim, now, "its worker died before listing it")
            except Exception as exc:
                log.warning("reclaim of batch %s of %s (unlisted after a death) failed: %s: %s", claim.batch,
                            claim.run_url, exc.__class__.__name__, exc)
                continue
            if result is not None:
                done.append(result)
        return done

    def reclaim_abandoned(self, run_url: str, batches: list[str]) -> list[dict]:
        """Put back the claims of ``batches`` of the run at ``run_url``, which a worker that died was
        running, without waiting for a lease (unless a live worker lists them). Returns the reclaims made.

        Raises whatever redis raises when the broker does not answer."""
        from hsx.fleet import broker_time, read_presences

        client = self.client()
        now = broker_time(client)
        presences = read_presences(client, self.settings.queue)
        wanted = set(batches)
        done = []
        for claim in claims(client):
            if claim.run_url != run_url or claim.batch not in wanted:
                continue
            if lease_state(claim, presences, now, self.settings.lease_s)[0] == HELD:
                continue
            result = self._reclaim(claim, now, "its worker died")
            if result is not None:
                done.append(result)
        return done

    def _reclaim(self, claim: dict, now: float, why: str) -> dict | None:
        from hsx.records import Marker, Reclaim

        run_url, batch, tag = claim.run_url, claim.batch, claim.tag
        if not self._serves(run_url):
            # Outside this worker's roots: opening that store would be what the allow-list forbids.
            # A worker that serves the run, or the lease of one that does, takes it.
            return None
        store = self._store(run_url)
        if Marker.read(store, batch) is not None:
            # Died after its marker, before the ack: nothing to redo, only the stale entry to drop.
            drop_claims(self.client(), [tag])
            return None
        attempt = self._attempt(store, batch, tag, now)
        if attempt is None:
            return None
        body = Reclaim(batch=batch, delivery_tag=tag, task_id=claim.task_id, attempt=attempt,
                       claimed_at=_iso(claim.delivered_at), by=self.me, why=why, host=socket.gethostname(),
                       at_unix=round(now, 3), at=_iso(now))
        if not body.create(store):
            return None  # another worker took it
        restored = self._restore(tag)
        log.warning("batch %s of %s reclaimed, %s: %s", batch, run_url, why,
                    "put back at the head of the queue" if restored else "already gone from the claims")
        return {"batch": batch, "run_url": run_url, "tag": tag, "attempt": attempt, "enqueued": restored, "why": why}

    def _restore(self, tag: str) -> bool:
        """Put the claimed message ``tag`` back where workers take from next (atomic: see the module
        doc). False if it was no longer claimed."""
        return restore_claim(self.broker_url, self.settings.queue, tag)

    def _attempt(self, store, batch: str, tag: str, now: float) -> int | None:
        """The reclaim attempt to try for delivery ``tag`` at broker time ``now``: 1, or the next after
        one older than the lease (broker clock) whose winner did not finish; None: one is under way,
        or :data:`MAX_ATTEMPTS` were made."""
        from hsx.layout import RECLAIMS_PREFIX, reclaim_prefix
        from hsx.records import Reclaim

        prefix = reclaim_prefix(batch, tag)
        attempts = sorted(int(k.rsplit(".", 2)[-2]) for k in store.list(RECLAIMS_PREFIX)
                          if k.startswith(prefix) and k.rsplit(".", 2)[-2].isdigit())
        if not attempts:
            return 1
        last = attempts[-1]
        try:
            found = Reclaim.read(store, batch, tag, last)
            at = found.at_unix if found is not None else 0.0
        except ValueError:  # RecordFormatError: a damaged record counts as an old one
            at = 0.0
        if now - at <= self.settings.lease_s or last >= MAX_ATTEMPTS:
            return None
        return last + 1

    # --- parked messages ----------------------------------------------------------------------

    def unpark(self) -> list[dict]:
        """Send again the parked messages this worker serves (module doc); returns what came back.

        A run that is gone or cancelled has its entries dropped (one line each). An entry whose send
        fails is parked again, so it is never lost. Raises whatever redis raises when the broker
        does not answer."""
        from hsx.fleet import park, read_parked, take_parked
        from hsx.records import Cancelled

        client, queue = self.client(), self.settings.queue
        entries = [e for e in read_parked(client, queue) if self.me not in e.refused_by and self._serves(e.run_url)]
        by_run: dict[str, list] = {}
        for e in entries:
            by_run.setdefault(e.run_url, []).append(e)
        out = []
        for run_url, mine in by_run.items():
            if run_url in self._unfit:
                continue
            try:
                opened = self._open_run(run_url)
            except Exception as exc:
                if _transient(exc):  # the store is down for now: the next look tries again
                    log.debug("parked batches of %s not looked at: %s", run_url, exc)
                    continue
                # This worker cannot read it either: it stays parked, refused by this worker too.
                for e in mine:
                    if take_parked(client, queue, e.run_url, e.batch):
                        park(client, queue, e.model_copy(update={"refused_by": [*e.refused_by, self.me]}))
                log.info("parked batches of %s left parked: this worker cannot read the run either: %s: %s",
                         run_url, exc.__class__.__name__, exc)
                continue
            if opened is None or Cancelled.read(opened[0]) is not None:
                what = "deleted (no run.json)" if opened is None else "cancelled"
                dropped = [e.batch for e in mine if take_parked(client, queue, e.run_url, e.batch)]
                if dropped:
                    log.warning("parked batches %s of %s dropped: the run was %s", ", ".join(dropped), run_url, what)
                continue
            store, config = opened
            if not self._model_fits(config):
                self._unfit.add(run_url)  # another checkpoint than HSX_MODEL: not this process's, ever
                continue
            taken = [e for e in mine if take_parked(client, queue, e.run_url, e.batch)]  # one worker gets each
            if not taken:
                continue
            try:
                planned = self._planned(run_url, store)
                declare_queue(self.broker_url, self.settings.queue)
                self._send(run_url, config.run_id, [planned[e.batch] for e in taken if e.batch in planned])
            except Exception as exc:  # keep them: parked again as they were
                for e in taken:
                    park(client, queue, e)
                log.warning("parked batches of %s not sent again (parked again): %s: %s", run_url,
                            exc.__class__.__name__, exc)
                continue
            for e in taken:
                if e.batch not in planned:  # no worker would run it: the task refuses a batch the plan lacks
                    log.warning("parked batch %s of %s dropped: the run's plan has no such batch", e.batch, run_url)
                    continue
                log.warning("batch %s of %s came back from parked (parked by %s: %s): this worker serves it",
                            e.batch, run_url, ", ".join(e.refused_by) or "?", e.reason[:300])
                out.append({"batch": e.batch, "run_url": run_url, "parked_by": list(e.refused_by), "reason": e.reason})
        return out

    def _model_fits(self, config) -> bool:
        """Whether this worker can run a run planned with ``config`` (with ``HSX_MODEL``: the same checkpoint)."""
        if not self.settings.model:
            return True
        try:
            from workers.target import get_target

            return not get_target(self.settings.model, self.settings).info.differences(config.model)
        except Exception as exc:  # cannot tell: leave it for a worker that can
            log.debug("model of a parked run not compared: %s", exc)
            return False

    def _send(self, run_url: str, run_id: str, batches: list[BatchSummary]) -> None:
        from hsx.queue import send_batches

        send_batches(self.settings, self.broker_url, run_url, run_id, batches)

    def _planned(self, run_url: str, store) -> dict[str, BatchSummary]:
        """The run's planned batches by name, in batch order (:func:`hsx.plan.planned_batches`); kept
        once its plan is complete. Raises what the store raises."""
        from hsx.plan import planned_batches

        planned = self._plans.get(run_url)
        if planned is None:
            batches, complete = planned_batches(store)
            planned = {b.batch: b for b in batches}
            if complete:
                self._plans[run_url] = planned
        return planned

    # --- lost messages ------------------------------------------------------------------------

    def heal_every_s(self) -> float:
        """Seconds between two looks for lost batches, fleet-wide (the election's time to live)."""
        return max(self.settings.reclaim_interval_s, self.settings.lease_s / 4)

    def heal(self) -> tuple[bool, list[dict]]:
        """If elected, look for lost batches and enqueue those lost for ``HSX_LEASE_S`` (module doc).

        Returns ``(elected, healed)``. Raises whatever redis raises when the broker does not answer;
        a run whose store fails is logged and skipped."""
        from hsx.fleet import broker_time, elect, known_runs, prune_presences, read_parked, read_presences, unaccounted_key

        client, queue, lease_s = self.client(), self.settings.queue, self.settings.lease_s
        if not elect(client, queue, self.me, self.heal_every_s()):
            return False, []
        # presences of processes gone for a day: a long-lived broker's hash would grow with every restart
        prune_presences(client, queue, PRESENCE_KEEP_S)
        queued = waiting(client, queue)
        if queued > HEAL_SCAN_MAX:
            log.debug("lost batches not looked for: %d messages queued (more than %d): the fleet is busy",
                      queued, HEAL_SCAN_MAX)
            return True, []
        # Read in the order a batch moves (queue, claim, then marker), so that one moving meanwhile is seen once at least.
        accounted: dict[str, set[str]] = {}
        for url, per in queued_of(client, queue).items():
            accounted.setdefault(url, set()).update(per)
        for c in claims(client):
            accounted.setdefault(c.run_url, set()).add(c.batch)
        now = broker_time(client)
        presences = read_presences(client, queue)
        for p in presences:
            if p.live(now, lease_s):
                for t in p.tasks:
                    accounted.setdefault(t.run_url, set()).add(t.batch)
        for e in read_parked(client, queue):
            accounted.setdefault(e.run_url, set()).add(e.batch)
        unaccounted = {_text(k): float(v) for k, v in (client.hgetall(unaccounted_key(queue)) or {}).items()}
        healed = []
        mono = self.clock()
        for run_url in known_runs(client, queue, presences):
            if run_url in self._finished and mono - self._finished[run_url] < FINISHED_RECHECK_S:
                continue
            if not self._serves(run_url):
                continue  # a worker that serves it heals it when elected
            try:
                healed += self._heal_run(run_url, accounted.get(run_url, set()), unaccounted, now)
            except Exception as exc:
                log.warning("lost batches of %s not looked for: %s: %s", run_url, exc.__class__.__name__, exc)
        return True, healed

    def _heal_run(self, run_url: str, accounted: set[str], unaccounted: dict[str, float], now: float) -> list[dict]:
        from hsx.fleet import batch_field, forget_run, unaccounted_key
        from hsx.records import Cancelled, Reclaim, done_batches, read_failures

        client, queue, lease_s = self.client(), self.settings.queue, self.settings.lease_s
        opened = self._open_run(run_url)
        if opened is None:
            forget_run(client, queue, run_url)
            log.info("run %s is gone (no run.json): no longer looked after", run_url)
            return []
        store, config = opened
        if Cancelled.read(store) is not None:
            return []
        planned = self._planned(run_url, store)
        done = done_batches(store)
        if run_url in self._plans and done.issuperset(planned):
            forget_run(client, queue, run_url)
            self._finished[run_url] = self.clock()
            return []
        failed = read_failures(store, done)
        missing = [b for b in planned if b not in done and b not in failed and b not in accounted]
        key = unaccounted_key(queue)
        prefix = run_url + "\n"
        mine = {f: t for f, t in unaccounted.items() if f.startswith(prefix)}
        due: list[tuple[str, float]] = []
        for b in missing:
            fld = batch_field(run_url, b)
            first = mine.pop(fld, None)
            if first is None:
                client.hsetnx(key, fld, repr(now))
            elif now - first >= lease_s:
                due.append((b, first))
        if mine:  # accounted for again (queued, claimed, done...) since they were noted
            client.hdel(key, *mine)
        if not due:
            return []
        won = []
        for b, first in due:
            tag = f"lost-{int(first * 1000)}"
            attempt = self._attempt(store, b, tag, now)
            if attempt is None:
                continue
            why = f"lost: neither done, queued, claimed nor parked for {now - first:.0f} s"
            body = Reclaim(batch=b, delivery_tag=tag, attempt=attempt, by=self.me, why=why, host=socket.gethostname(),
                           at_unix=round(now, 3), at=_iso(now), claimed_at=_iso(first))
            if body.create(store):
                won.append((b, first, tag, attempt))
        if not won:
            return []
        declare_queue(self.broker_url, self.settings.queue)
        self._send(run_url, config.run_id, [planned[b] for b, *_ in won])
        client.hdel(key, *[batch_field(run_url, b) for b, *_ in won])
        log.warning("batches %s of %s enqueued again: lost (neither done, queued, claimed nor parked for %.0f s or more; "
                    "a broker that lost its data, a message dropped)", ", ".join(b for b, *_ in won), run_url, lease_s)
        return [{"batch": b, "run_url": run_url, "tag": tag, "attempt": attempt, "lost_s": now - first}
                for b, first, tag, attempt in won]

    # --- the thread ---------------------------------------------------------------------------

    def _loop(self) -> None:
        interval = self.settings.reclaim_interval_s
        while not self._stop.wait(interval * random.uniform(0.8, 1.2)):  # jitter: workers do not look in step
            try:
                self.once()
            except Exception as exc:  # the broker may be down: the next look tries again
                log.warning("lease check failed: %s: %s", exc.__class__.__name__, exc)

    def start(self) -> "Reclaimer":
        """Start the thread (daemon); returns self."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="hsx-reclaimer", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _transient(exc: BaseException) -> bool:
    """Whether trying again later may succeed (a store timeout or 5xx, a broker hiccup)."""
    from workers.causes import TRANSIENT, classify

    return classify(exc) == TRANSIENT
