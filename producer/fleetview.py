"""The producer's view of the fleet on a broker: which workers are alive and what they serve, the
messages they parked and what fixes them. Read from the fleet's keys (``hsx/fleet.py``); every
command that looks at workers (``status``, ``enqueue``, ``reconcile``, ``run``, ``cancel``) goes
through here.

A worker is **alive** while its presence is (``hsx.fleet.Presence.live``: written within
``HSX_LEASE_S`` of the broker's clock, not ``stopped``), except that a presence written on this
host by a process that no longer exists is dead at once (a worker SIGKILLed here: ``reconcile``
need not wait out the lease). A process of another PID namespace on the same host name (a
container on the host's network) can look gone from here: the worst that does is a batch enqueued
again while it runs, which its marker settles.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

from hsx.access import normalise
from hsx.brokerlayout import Claim, claims, lengths, queued_of
from hsx.errors import BadConfig
from hsx.fleet import Parked, Presence, broker_time, known_runs, read_parked, read_presences
from hsx.processes import pid_alive
from hsx.store import mask_url
from producer.words import plural

#: presences not written for this long (seconds of broker time) are left out of the fleet view.
FLEET_FORGET_S = 3600.0

#: Seconds after its delivery (on the clock of the worker that took it: kombu's ``unacked_index``) during
#: which a claim no presence lists is not counted as unheld: a live worker lists a delivery in its
#: presence within a write gap or so (1 s, ``workers/heartbeat.py`` MIN_WRITE_GAP_S), later on a busy
#: host; a healthy run always has a few such claims (seen in 5 of 5 looks on a 2-core host, 2026-12-06).
UNLISTED_GRACE_S = 10.0


def gone_here(p: Presence) -> bool:
    """Whether ``p`` is a process of this host that no longer exists (checked by pid, here only)."""
    return p.host == socket.gethostname() and not pid_alive(p.pid)


def alive_presences(client, queue: str, lease_s: float) -> tuple[float, list[Presence]]:
    """``(broker now, the presences of live worker processes)``: live by the lease
    (:meth:`hsx.fleet.Presence.live`), less those of this host whose process is gone.

    Raises whatever redis raises when the broker does not answer."""
    now = broker_time(client)
    return now, [p for p in read_presences(client, queue) if p.live(now, lease_s) and not gone_here(p)]


def broker_unreachable(broker_url: str, exc: Exception) -> BadConfig:
    """The error ``status`` (and any command that must read the fleet) gives when the broker does
    not answer: the URL with its password masked, the error, and what to check (exit 2, as the CLI's
    other errors)."""
    return BadConfig(f"broker {mask_url(broker_url)} does not answer ({exc.__class__.__name__}: {exc}): check that "
                     "it runs and that HSX_BROKER_URL names its host, port and password (the URL your workers use); "
                     "or give a run address (<output>/<run_id>) to read that run from its store")


def reclaim_grace_s(settings) -> float:
    """Seconds after a stale presence's lease ends by which a live worker has put its claims back:
    the look that first finds it stale and the later one that confirms it (``workers/lease.py``:
    looks ``HSX_RECLAIM_INTERVAL_S`` apart, the second at least two heartbeats after the first)."""
    return settings.reclaim_interval_s + max(settings.reclaim_interval_s, 2 * settings.heartbeat_s)


@dataclass(frozen=True)
class Unheld:
    """A claim (delivered, unacknowledged message) that no live worker holds, sorted the way the
    workers' lease check sorts it (``workers/lease.py``, ``lease_state``)."""

    claim: Claim
    why: str
    """``lost``: listed by workers whose presences went stale (killed, cut off): put back once their
    lease ends; ``stopped``: listed by a worker whose launcher saw it die: put back at a live worker's
    next look; ``unlisted``: no presence lists it (an ack lost when the broker restarted, a worker
    that died in the second between a delivery and listing it): put back, or dropped when its batch
    is done, by a live worker that has seen it unlisted for ``HSX_LEASE_S``."""
    holders: tuple[Presence, ...] = ()


def unheld_claims(found: list[Claim], presences: list[Presence], alive: set[str], *,
                  local_now: float | None = None, grace_s: float = UNLISTED_GRACE_S) -> list[Unheld]:
    """The claims of ``found`` that no presence of ``alive`` (live workers' names) lists, by task id
    or by run and batch; a claim no presence lists at all that was delivered less than ``grace_s``
    seconds before ``local_now`` (default: this machine's clock) is left out: its worker has not
    listed it yet (:data:`UNLISTED_GRACE_S`)."""
    local_now = time.time() if local_now is None else local_now
    out = []
    for c in found:
        listing = tuple(p for p in presences if p.holds(task_id=c.task_id, run_url=c.run_url, batch=c.batch))
        if any(p.worker in alive for p in listing):
            continue
        if not listing and c.delivered_at is not None and local_now - c.delivered_at < grace_s:
            continue
        why = "stopped" if any(p.state == "stopped" for p in listing) else "lost" if listing else "unlisted"
        out.append(Unheld(c, why, listing))
    return out


def not_held(unheld: list[Unheld], now: float, settings) -> dict:
    """What ``status`` says of the claims no live worker holds (:func:`unheld_claims`), as JSON:
    ``count``; ``unlisted`` and ``stopped`` (counts, :attr:`Unheld.why`); ``lost_workers``
    (``[{"worker", "label", "claims", "back_in_s"}]``: seconds until a live worker has put them back,
    the lease plus :func:`reclaim_grace_s`, from the broker's clock; 0 or less: due);
    ``visibility_at`` / ``visibility_last_at`` (UTC, the earliest and latest time the broker's
    visibility timeout returns them by itself, with no live worker: delivery time on the delivering
    worker's clock plus ``HSX_VISIBILITY_TIMEOUT_S``; null when kombu kept no delivery time);
    ``lease_s``, ``visibility_timeout_s``; ``batches`` (``[[run address, batch]]``)."""
    lost: dict[str, dict] = {}
    for u in unheld:
        if u.why != "lost":
            continue
        last = max(u.holders, key=lambda p: p.stamp)  # the lease runs from the latest presence that lists it
        w = lost.setdefault(last.worker, {"worker": last.worker, "label": last.label, "claims": 0,
                                          "back_in_s": round(last.stamp + settings.lease_s + reclaim_grace_s(settings)
                                                             - now, 1)})
        w["claims"] += 1
    returns = sorted(u.claim.delivered_at + settings.visibility_timeout_s for u in unheld
                     if u.claim.delivered_at is not None)
    stamp = lambda t: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))  # noqa: E731
    return {
        "count": len(unheld),
        "unlisted": sum(u.why == "unlisted" for u in unheld),
        "stopped": sum(u.why == "stopped" for u in unheld),
        "lost_workers": sorted(lost.values(), key=lambda w: w["label"]),
        "visibility_at": stamp(returns[0]) if returns else None,
        "visibility_last_at": stamp(returns[-1]) if returns else None,
        "lease_s": settings.lease_s,
        "visibility_timeout_s": settings.visibility_timeout_s,
        "batches": sorted([u.claim.run_url, u.claim.batch] for u in unheld),
    }


def serves(p: Presence, url: str) -> bool:
    """Whether the worker of ``p`` serves the store address ``url`` (under one of its roots)."""
    try:
        target = normalise(url)
    except BadConfig:
        return False
    for root in p.roots:
        try:
            if normalise(root).contains(target):
                return True
        except BadConfig:
            continue
    return False


def same_store(a: str, b: str) -> bool:
    """Whether two store addresses name the same place (``./out/r`` and ``file:///abs/out/r`` do)."""
    if a == b:
        return True
    try:
        return normalise(a) == normalise(b)
    except BadConfig:
        return False


def run_root(run_url: str) -> str:
    """The store root a run lies in (its address without the run id), for messages."""
    try:
        root = normalise(run_url)
    except BadConfig:
        return mask_url(run_url)
    if root.is_s3:
        return "s3://" + "/".join((root.bucket, *root.segments[:-1]))
    return root.path.rsplit("/", 1)[0] or "/"


def parked_fix(cause: str, run_url: str, model: str | None = None) -> str:
    """What brings a run's parked messages back, by the cause the worker gave (``hsx.fleet.Parked.cause``)."""
    again = (f"they come back by themselves when such a worker looks, or with `python -m producer reconcile {run_url}` "
             f"once fixed; or drop the run with `python -m producer cancel {run_url}`")
    if cause == "model":
        wanted = f"HSX_MODEL={model}" if model else "the run's model as HSX_MODEL"
        return (f"start a worker with {wanted} (or no HSX_MODEL) that serves {run_root(run_url)} on this queue "
                f"(another model: give it its own HSX_QUEUE); {again}")
    if cause == "unreadable":
        return ("fix what the reason names on the workers (credentials, bucket, a setting, a newer hsx) and restart "
                f"them; {again}")
    return (f"start a worker that serves {run_root(run_url)} (HSX_STORE_URL, or add it to HSX_ALLOWED_STORES); "
            f"{again}")


def parked_groups(entries: list[Parked], run_url: str, model: str | None = None,
                  presences: list[Presence] = ()) -> list[dict]:
    """A run's parked messages grouped by cause and reason: ``[{"cause", "reason", "batches",
    "refused_by", "times", "fix"}]``, the biggest group first. ``refused_by`` names each worker as
    every view does (:attr:`hsx.fleet.Presence.label`, ``cpu0@host pid 7``) where ``presences`` has
    it, else by the ``<host>-<pid>`` it parked under."""
    labels = {p.worker: p.label for p in presences}
    groups: dict[tuple[str, str], dict] = {}
    for p in entries:
        g = groups.setdefault((p.cause, p.reason), {"cause": p.cause, "reason": p.reason, "batches": [],
                                                    "refused_by": [], "times": 0,
                                                    "fix": parked_fix(p.cause, run_url, model)})
        g["batches"].append(p.batch)
        g["refused_by"] = list(dict.fromkeys([*g["refused_by"], *(labels.get(w, w) for w in p.refused_by)]))
        g["times"] += p.times
    return sorted(groups.values(), key=lambda g: (-len(g["batches"]), g["reason"]))


def parked_line(group: dict) -> str:
    """``parked: 3 batches: <reason>``."""
    return f"parked: {plural(len(group['batches']), 'batch')}: {group['reason']}"


def presence_row(p: Presence, now: float, live: bool, claimed: list[Claim] = ()) -> dict:
    """One worker of the fleet view (``status`` without a run): the presence as JSON, plus
    ``label`` (:func:`hsx.fleet.worker_label`), ``live``, ``age_s`` (seconds of broker time since it
    was written), ``paused_s`` and ``loading_s`` (seconds since its load began: its
    ``loading_since`` is the worker's clock, read against ours).

    A dead worker (not ``live``) holds nothing: its ``tasks`` are empty, and what its presence
    listed last is ``held_at_death``, each task with ``still_claimed`` (a claim of ``claimed``, the
    broker's, has its task id or its run and batch: not put back or finished yet)."""
    row = p.model_dump()
    row["label"] = p.label
    row["live"] = live
    row["held_at_death"] = []
    if not live:  # what it listed when it died: put back or redone since, unless still claimed
        ids = {c.task_id for c in claimed if c.task_id}
        pairs = {(c.run_url, c.batch) for c in claimed}
        row["held_at_death"] = [dict(t, still_claimed=t["task_id"] in ids or (t["run_url"], t["batch"]) in pairs)
                                for t in row["tasks"]]
        row["tasks"] = []
    row["age_s"] = round(max(now - p.stamp, 0.0), 1)
    row["paused_s"] = round(max(now - p.paused_since, 0.0), 1) if p.state == "paused" and p.paused_since else None
    row["loading_s"] = (round(max(time.time() - p.loading_since, 0.0), 1)
                        if p.state == "loading" and p.loading_since else None)
    if not live and p.state != "stopped":
        row["state"] = "lost"
    return row


@dataclass
class BrokerView:
    """What the broker knows about a run's batches (batch -> count or worker names)."""

    queued: dict[str, int] = field(default_factory=dict)
    """Messages waiting in the queue, per batch."""
    running: dict[str, list[str]] = field(default_factory=dict)
    """Live workers whose presence lists the batch (received, waiting for a retry, or in progress)."""
    orphaned: dict[str, int] = field(default_factory=dict)
    """Delivered, unacknowledged messages that no live worker holds (their worker died)."""
    parked: dict[str, Parked] = field(default_factory=dict)
    """Messages a worker parked (``hsx/fleet.py``): it could not serve them."""
    workers: list[str] = field(default_factory=list)
    """Live workers (their Celery node name, else ``<host>-<pid>``)."""
    asked: bool = False
    """Whether the broker's presences were read (False: nothing was left to look for)."""


def broker_view(settings, broker_url: str, run_url: str) -> BrokerView:
    """Read the run's messages in the queue, its unacknowledged deliveries, its parked messages,
    and which batches live workers hold (their presences: :func:`alive_presences`).

    Raises whatever redis raises when the broker does not answer.
    """
    from hsx.broker import redis_client

    client = redis_client(broker_url)
    view = BrokerView(asked=True)
    view.queued = dict(queued_of(client, settings.queue, run_url).get(run_url, {}))
    _now, live = alive_presences(client, settings.queue, settings.lease_s)
    held: set[str] = set()  # task ids live workers hold
    for p in live:
        name = p.node or p.worker
        view.workers.append(name)
        for t in p.tasks:
            held.add(t.task_id)
            if t.run_url == run_url and t.batch:
                view.running.setdefault(t.batch, []).append(name)
    for c in claims(client):
        if c.run_url == run_url and c.task_id not in held:
            view.orphaned[c.batch] = view.orphaned.get(c.batch, 0) + 1
    view.parked = {p.batch: p for p in read_parked(client, settings.queue, run_url)}
    view.workers.sort()
    return view


def fleet_status(client, settings, broker_url: str) -> dict:
    """The fleet on the broker: ``broker`` (``url`` masked, ``queue_name``, ``queue``: ``waiting``,
    ``claimed``: delivered, not acknowledged; ``not_held``: :func:`not_held` of the claims no live
    worker holds), ``workers`` (:func:`presence_row`: the live ones, and those gone within
    :data:`FLEET_FORGET_S`), ``runs`` (``[{"address", "queued", "held", "parked", "not_held"}]``:
    messages waiting, held by live workers, parked, claimed by no live worker), ``parked``
    (``[{"run_url", "batches", "groups"}]``: :func:`parked_groups` per run) and ``at``.

    Reads the queue's lists once (every waiting message, in chunks) to count them per run.

    Raises:
        BadConfig: the broker does not answer (:func:`broker_unreachable`).
    """
    from redis.exceptions import RedisError

    try:
        return _fleet_status(client, settings, broker_url)
    except RedisError as exc:
        raise broker_unreachable(broker_url, exc) from None


def _fleet_status(client, settings, broker_url: str) -> dict:
    queue = settings.queue
    # The claims before the presences: a delivery made between the two reads is then listed by its
    # live worker's presence (rewritten within a second) rather than counted as held by nobody.
    found = claims(client)
    now = broker_time(client)
    everyone = read_presences(client, queue)
    alive_ids = {p.worker for p in everyone if p.live(now, settings.lease_s) and not gone_here(p)}
    workers = [presence_row(p, now, p.worker in alive_ids, found) for p in everyone
               if p.worker in alive_ids or now - p.stamp <= FLEET_FORGET_S]
    workers.sort(key=lambda r: (not r["live"], r["host"], r["pid"]))
    unheld = unheld_claims(found, everyone, alive_ids)
    queued = queued_of(client, queue)
    parked = read_parked(client, queue)
    counts = lengths(client, queue)
    held: dict[str, int] = {}
    for p in everyone:
        if p.worker in alive_ids:
            for t in p.tasks:
                if t.run_url:
                    held[t.run_url] = held.get(t.run_url, 0) + 1
    not_held_by_run: dict[str, int] = {}
    for u in unheld:
        not_held_by_run[u.claim.run_url] = not_held_by_run.get(u.claim.run_url, 0) + 1
    by_run: dict[str, list[Parked]] = {}
    for p in parked:
        by_run.setdefault(p.run_url, []).append(p)
    addresses = sorted(set(known_runs(client, queue, everyone)) | set(queued) | set(by_run) | set(held)
                       | set(not_held_by_run))
    runs = [{"address": a, "queued": sum(queued.get(a, {}).values()), "held": held.get(a, 0),
             "parked": len(by_run.get(a, [])), "not_held": not_held_by_run.get(a, 0)} for a in addresses]
    busy = [r for r in runs if r["queued"] or r["held"] or r["parked"] or r["not_held"]]
    return {
        "broker": {"url": mask_url(broker_url), "queue_name": queue,
                   "queue": {"waiting": counts.waiting, "claimed": counts.claimed},
                   "not_held": not_held(unheld, now, settings)},
        "workers": workers,
        "runs": busy + [r for r in runs if r not in busy],
        "parked": [{"run_url": url, "batches": len(items), "groups": parked_groups(items, url, presences=everyone)}
                   for url, items in sorted(by_run.items())],
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
    }


__all__ = ["BrokerView", "broker_view", "alive_presences", "broker_unreachable", "reclaim_grace_s", "Unheld",
           "unheld_claims", "not_held", "gone_here", "serves", "same_store", "run_root", "parked_fix", "parked_groups", "parked_line",
           "presence_row", "fleet_status", "FLEET_FORGET_S"]
