"""Leases: a claimed batch whose worker died is enqueued again by any live worker, with no command typed.

**The lease** of a batch is its entry in a status record of its run (``<run>/workers/<host>-<pid>.json``,
``workers/heartbeat.py``): the task lists the batch there as soon as it starts (phase ``claimed``), the
heartbeat thread rewrites the record every ``HSX_HEARTBEAT_S``, and the entry goes when the task ends.
The lease is held while a record that lists the batch, not ``stopped``, was updated within
``HSX_LEASE_S`` (default 120 s). No separate lease file: the record is already written every few
seconds, and a second file per batch would double the store writes for nothing.

**The claims** come from the broker: a delivered message that is not acknowledged yet sits in kombu's
``unacked`` hash (tag -> ``[message, exchange, routing key]``) with its delivery time in the
``unacked_index`` sorted set (kombu ``transport/redis.py``, ``QoS.append``). A SIGKILLed worker's
messages stay there until the visibility timeout (hours).

**The reclaimer** is a thread in every worker process. Every ``HSX_RECLAIM_INTERVAL_S`` (15 s) it reads
the hash and, for each extraction message delivered (or due, for a retry with a countdown: its
``eta``) more than ``HSX_LEASE_S`` ago whose batch has no marker and no lease, it:

1. creates ``<run>/reclaims/<batch>-<tag>.<n>.json`` with a conditional create (``Store.create``:
   S3 ``IfNoneMatch``, local ``O_EXCL``): of all the live workers, exactly one wins; no leader;
2. puts the message back with kombu's own restore (``QoS.restore_by_tag``, the code its
   visibility-timeout sweep runs): in one Redis transaction (``WATCH unacked``) the entry leaves
   ``unacked`` / ``unacked_index`` and the same message is pushed onto the end of the queue that
   workers take from next (``RPUSH``; producers ``LPUSH`` and consumers ``BRPOP``). A stranded
   batch therefore runs next, not after the thousands of batches queued behind it, and the
   message is never lost or doubled in between: the transaction either happens whole or not.

**A death the launcher saw** needs no lease: when ``python -m workers`` reaps a child that died,
it marks the child's status records ``stopped`` with the batches they listed (``abandoned``) and
reclaims those batches' claims at once the same way (:meth:`Reclaimer.reclaim_abandoned`), so a
crashed or OOM-killed GPU worker's batch runs again within seconds. The lease covers what the
launcher cannot see: a whole node lost, a worker started without the launcher, a batch the dead
process had prefetched but not started (it is listed nowhere).

A winner that dies between 1 and 2 leaves the entry in place: after another ``HSX_LEASE_S``, the
next look takes attempt ``n + 1``. The worst case from a SIGKILL to the batch being next in line is
``HSX_LEASE_S + HSX_RECLAIM_INTERVAL_S`` (2 min 15 s by default), plus the batch a free worker is
finishing; a lease that expires under a live worker (a store outage longer than the lease stops its
heartbeats) only makes a duplicate, which loses the marker race and deletes its own shard.

Clocks: the record's ``updated_at`` and kombu's delivery time are compared with this host's clock,
so hosts must agree to a few seconds (NTP); a skew shortens or lengthens the lease by as much.
"""

from __future__ import annotations

from hsx.times import unix_seconds as _ts

import json
import logging
import random
import socket
import threading
import time
from datetime import datetime, timezone

log = logging.getLogger(__name__)

UNACKED_KEY = "unacked"
UNACKED_INDEX_KEY = "unacked_index"
#: attempts of one stale delivery's reclaim (a winner that died before it finished), at most.
MAX_ATTEMPTS = 5



def stale_claims(client, lease_s: float, now: float) -> list[dict]:
    """Extraction messages of the broker at ``client`` (redis-py) claimed more than ``lease_s`` ago
    (:func:`extraction_claims` older than the lease)."""
    return [c for c in extraction_claims(client) if now - c["claimed_at"] > lease_s]


def extraction_claims(client) -> list[dict]:
    """Every unacknowledged extraction message of the broker at ``client`` (redis-py):
    ``[{"tag", "run_url", "batch", "task_id", "claimed_at"}]``, ``claimed_at`` being the later of the
    delivery and the message's ``eta`` (seconds since the epoch). Bodies are decoded only when JSON."""
    from hsx.queue import EXTRACT_TASK
    from hsx.queue import decode_message as _decode
    from hsx.queue import unacked_message

    entries = client.hgetall(UNACKED_KEY)
    if not entries:
        return []
    delivered = {(k.decode() if isinstance(k, bytes) else k): float(v)
                 for k, v in client.zrange(UNACKED_INDEX_KEY, 0, -1, withscores=True)}
    out = []
    for tag, raw in entries.items():
        tag = tag.decode() if isinstance(tag, bytes) else tag
        message = unacked_message(raw)
        if message is None:
            continue
        task, task_id, args = _decode(json.dumps(message))
        if task != EXTRACT_TASK or len(args) < 2 or tag not in delivered:
            continue
        eta = _ts((message.get("headers") or {}).get("eta"))
        out.append({"tag": tag, "run_url": str(args[0]), "batch": str(args[1]), "task_id": task_id,
                    "claimed_at": max(delivered[tag], eta or 0.0)})
    return out


def lease_holders(records: list[dict], batch: str, lease_s: float, now: float) -> list[str]:
    """Workers (``<host>-<pid>``) whose status record holds the lease of ``batch`` at ``now``: the
    record lists it, is not ``stopped``, and was updated within ``lease_s`` seconds."""
    out = []
    for r in records:
        beat = _ts(r.get("updated_at"))
        if r.get("state") == "stopped" or beat is None or now - beat > lease_s:
            continue
        if any(isinstance(b, dict) and b.get("batch") == batch for b in r.get("batches") or []):
            out.append(str(r.get("worker") or f"{r.get('host')}-{r.get('pid')}"))
    return out


class Reclaimer:
    """Finds the claims whose lease expired and enqueues them again (see the module doc).

    Args:
        settings: ``HSX_LEASE_S``, ``HSX_RECLAIM_INTERVAL_S``, the queue and the store credentials.
        broker_url: the broker the workers consume from.
        me: this process's name in the reclaim records (``<host>-<pid>``).
    """

    def __init__(self, settings, broker_url: str, me: str | None = None):
        from workers.heartbeat import worker_name

        self.settings, self.broker_url = settings, broker_url
        self.me = me or worker_name()
        self._stores: dict[str, object] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def _store(self, run_url: str):
        from hsx.store import open_store

        if run_url not in self._stores:
            self._stores[run_url] = open_store(run_url, self.settings)
        return self._stores[run_url]

    def once(self, now: float | None = None) -> list[dict]:
        """One look; returns the reclaims this process made: ``[{"batch", "run_url", "tag", "attempt", "enqueued"}]``.

        Raises whatever redis raises when the broker does not answer (the thread logs it and goes on).
        """
        from hsx.broker import redis_client

        now = time.time() if now is None else now
        lease_s = self.settings.lease_s
        client = redis_client(self.broker_url)
        done = []
        records_of: dict[str, list[dict]] = {}
        for claim in stale_claims(client, lease_s, now):
            try:
                result = self._reclaim(client, claim, lease_s, now, records_of)
            except Exception as exc:  # one run's store down must not stop the others' reclaims
                log.warning("reclaim of batch %s of %s failed: %s: %s", claim["batch"], claim["run_url"],
                            exc.__class__.__name__, exc)
                continue
            if result is not None:
                done.append(result)
        return done

    def reclaim_abandoned(self, run_url: str, batches: list[str], now: float | None = None) -> list[dict]:
        """Put back the claims of ``batches`` of the run at ``run_url``, which a worker that died was
        running (its status record already says ``stopped``), without waiting for their lease: the
        same checks and records as a lease reclaim (no marker, no live worker lists the batch, one
        conditional create). Returns the reclaims made, as :meth:`once` does.

        Raises whatever redis raises when the broker does not answer (the launcher logs it; the
        lease reclaims those batches later)."""
        from hsx.broker import redis_client

        now = time.time() if now is None else now
        client = redis_client(self.broker_url)
        wanted = set(batches)
        done, records_of = [], {}
        for claim in extraction_claims(client):
            if claim["run_url"] != run_url or claim["batch"] not in wanted:
                continue
            result = self._reclaim(client, claim, self.settings.lease_s, now, records_of, why="its worker died")
            if result is not None:
                done.append(result)
        return done

    def _reclaim(self, client, claim: dict, lease_s: float, now: float, records_of: dict,
                 why: str = "lease expired") -> dict | None:
        from hsx.records import Marker, Reclaim, read_heartbeats

        run_url, batch, tag = claim["run_url"], claim["batch"], claim["tag"]
        store = self._store(run_url)
        if Marker.read(store, batch) is not None:
            # Died after its marker, before the ack: nothing to redo, only the stale entry to drop.
            self._drop(client, tag)
            return None
        if run_url not in records_of:
            records_of[run_url] = [r.model_dump() for r in read_heartbeats(store)]
        if lease_holders(records_of[run_url], batch, lease_s, now):
            return None  # a live worker holds it (a long batch): its lease is renewed
        attempt = self._attempt(store, batch, tag, lease_s, now)
        if attempt is None:
            return None
        body = Reclaim(batch=batch, delivery_tag=tag, task_id=claim["task_id"], attempt=attempt,
                       claimed_at=datetime.fromtimestamp(claim["claimed_at"], timezone.utc).isoformat(timespec="seconds"),
                       by=self.me, why=why, host=socket.gethostname(), at_unix=round(now, 3),
                       at=datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"))
        if not body.create(store):
            return None  # another worker took it
        restored = self._restore(tag)
        log.warning("batch %s of %s reclaimed, %s (claimed %.0f s ago, no live worker lists it): %s",
                    batch, run_url, why, now - claim["claimed_at"],
                    "put back at the head of the queue" if restored else "already gone from the claims")
        return {"batch": batch, "run_url": run_url, "tag": tag, "attempt": attempt, "enqueued": restored}

    def _restore(self, tag: str) -> bool:
        """Put the unacknowledged message ``tag`` back where workers take from next, with kombu's own
        ``QoS.restore_by_tag`` (atomic: see the module doc). False if it was no longer claimed."""
        from kombu import Connection

        with Connection(self.broker_url) as conn:
            channel = conn.default_channel
            client = channel.client
            if not client.hexists(UNACKED_KEY, tag):
                return False
            channel.qos.restore_by_tag(tag, client=client, leftmost=False)
            return True

    def _attempt(self, store, batch: str, tag: str, lease_s: float, now: float) -> int | None:
        """The reclaim attempt to try for delivery ``tag``: 1, or the next after one older than the
        lease whose winner did not finish (the entry is still there); None: one is under way."""
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
        if now - at <= lease_s or last >= MAX_ATTEMPTS:
            return None
        return last + 1

    @staticmethod
    def _drop(client, tag: str) -> None:
        pipe = client.pipeline()
        pipe.hdel(UNACKED_KEY, tag)
        pipe.zrem(UNACKED_INDEX_KEY, tag)
        pipe.execute()

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
