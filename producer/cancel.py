"""``python -m producer cancel RUN_ADDRESS [--now]``: stop a run everywhere, so that the same command resumes it.

In this order:

1. ``cancelled.json`` (:class:`hsx.records.Cancelled`: who, when, ``now``) is written into the
   run. From then on no worker starts a batch of the run: each message of it that a worker takes
   is acknowledged and left undone (``workers/extract.py``); with ``--now`` (``now: true``) the
   workers also stop the batches they are running, before their marker (the shard written so
   far is deleted). Without it, running batches finish and keep their markers.
2. The run's waiting messages are removed from the queue (:func:`hsx.brokerlayout.remove_queued`), its
   parked messages from the parked hash (:func:`hsx.fleet.take_parked`), and the run from the
   queue's set of runs (:func:`hsx.fleet.forget_run`: the healer of lost messages leaves it
   alone). A message claimed between the record and the removal finds the record.
3. Deliveries of the run that no live worker holds (a dead worker's claim) are dropped from
   kombu's claims (:func:`hsx.brokerlayout.drop_claims`): they would only come back to be acknowledged unrun.

``status`` then says ``cancelled``; a ``producer run`` of the run on this machine sees the record
and stops. ``producer run`` / ``producer enqueue`` of the same run (the same command gives the
same run id) removes the record and enqueues every batch without a marker (``producer/enqueue.py``).
The broker is ``HSX_BROKER_URL``, else this machine's embedded broker (the one a ``producer run``
has running, or one started from its AOF for the moment: ``producer/reconcile.py``
``reconcile_broker``).
"""

from __future__ import annotations

import getpass
import socket
from datetime import datetime, timezone

from hsx.broker import redis_client
from hsx.brokerlayout import claims, drop_claims, remove_queued
from hsx.fleet import forget_run, read_parked, take_parked
from hsx.plan import planned_batches
from hsx.records import Cancelled, done_batches
from hsx.runconfig import load_run
from hsx.store import Store
from settings import Settings


def who() -> str:
    """``<user>@<host>`` of this process, for the record."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container with a bare uid)
        user = "uid-unknown"
    return f"{user}@{socket.gethostname()}"


def cancel_run(run_store: Store, settings: Settings, broker_url: str | None, *, now: bool = False) -> dict:
    """Cancel the run at ``run_store`` (see the module doc); ``broker_url`` None: the store only.

    Returns the report: ``run_id``, ``address``, ``cancelled`` (the record as JSON),
    ``already_cancelled`` (the record it replaced, or None), ``batches_total``, ``batches_done``,
    ``removed_queued`` (messages taken off the queue), ``removed_parked`` (parked batches dropped),
    ``dropped_claims`` (deliveries no live worker held), ``running`` (``[{worker, batch, phase}]``:
    batches live workers hold, which finish, or with ``now`` stop before their marker), ``broker``.

    Raises:
        hsx.store.MissingKey: no run.json at ``run_store``.
        redis errors: the broker does not answer (the record is written first: workers already
            start none of the run's batches; run the command again to clear the queue).
    """
    from producer.fleetview import alive_presences

    config = load_run(run_store)
    before = Cancelled.read(run_store)
    record = Cancelled(by=who(), at=datetime.now(timezone.utc).isoformat(timespec="seconds"), now=now)
    record.write(run_store)  # first: whatever is claimed from here on is acknowledged unrun
    batches, _complete = planned_batches(run_store)
    names = {b.batch for b in batches}
    report = {
        "run_id": config.run_id, "address": run_store.url,
        "cancelled": record.model_dump(exclude={"schema_version"}),
        "already_cancelled": before.model_dump(exclude={"schema_version"}) if before is not None else None,
        "batches_total": len(batches), "batches_done": len(done_batches(run_store) & names),
        "removed_queued": 0, "removed_parked": [], "dropped_claims": 0, "running": [], "broker": bool(broker_url),
    }
    if not broker_url:
        return report
    client = redis_client(broker_url)
    queue, url = settings.queue, run_store.url
    forget_run(client, queue, url)
    report["removed_queued"] = remove_queued(client, queue, url)
    report["removed_parked"] = sorted(p.batch for p in read_parked(client, queue, url)
                                      if take_parked(client, queue, url, p.batch))
    _now, live = alive_presences(client, queue, settings.lease_s)
    held = {t.task_id for p in live for t in p.tasks}
    report["running"] = sorted(({"worker": p.node or p.worker, "batch": t.batch, "phase": t.phase}
                                for p in live for t in p.tasks if t.run_url == url),
                               key=lambda r: (r["batch"], r["worker"]))
    stale = [c.tag for c in claims(client) if c.run_url == url and c.task_id not in held]
    drop_claims(client, stale)
    report["dropped_claims"] = len(stale)
    return report


__all__ = ["cancel_run", "who"]
