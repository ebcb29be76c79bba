"""kombu's Redis layout: the one module that reads and writes the keys kombu keeps on the broker.

kombu's Redis transport (``kombu/transport/redis.py``) owns these keys, and nothing in this
project but this module spells them, the way ``hsx/store`` alone speaks boto3:

- **the queue's lists**: ``<queue>`` and one list per priority step, ``<queue>\\x06\\x163``,
  ``...6``, ``...9`` (:data:`PRIORITY_STEPS`). A producer ``LPUSH``es a message (JSON, the body
  base64'd), a consumer ``BRPOP``s it;
- **the claims**: the ``unacked`` hash (delivery tag -> ``[message, exchange, routing key]``) of
  messages delivered and not yet acknowledged, and ``unacked_index``, a sorted set of the same
  tags scored by delivery time (the delivering worker's wall clock: shown, never compared across
  machines). An ack is ``HDEL`` + ``ZREM``; kombu's visibility-timeout sweep restores an entry by
  pushing its message back onto its queue;
- **the bindings**: ``_kombu.binding.<queue>``, the set kombu routes a published message through.

Callers get typed answers (:class:`Claim`, :class:`Lengths`, per-run counts) and never the raw
keys. ``tests/test_brokerlayout.py`` holds each function against messages that real Celery sent
and real kombu consumers took, on a real valkey; a kombu upgrade that moves a key fails there.

Only JSON messages are decoded: anything else (pickle would run code) reads as not ours.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Callable, Iterable

#: the extraction task's name, which its messages carry (``headers["task"]``). Defined here, not in
#: :mod:`hsx.queue` (the Celery wiring, which takes it from here): that module needs
#: :func:`restore_options`, and this one needs no Celery.
EXTRACT_TASK = "hsx.extract_batch"
#: the hash of delivered, unacknowledged messages and its index scored by delivery time.
UNACKED_KEY = "unacked"
UNACKED_INDEX_KEY = "unacked_index"
#: separator kombu puts between a queue's name and a priority step, and the steps it keeps
#: (``PRIORITY_STEPS``; step 0 is the queue's own list).
PRIORITY_SEP = "\x06\x16"
PRIORITY_STEPS = (0, 3, 6, 9)


def restore_options(visibility_timeout_s: int) -> dict:
    """kombu's transport options for its sweep of the claims: how often a worker looks for claims
    whose visibility timeout passed. kombu's default (every ~100 s) is right for hours-long
    timeouts; a short timeout (tests) is swept every tenth of it, at least every second."""
    if visibility_timeout_s >= 1000:
        return {}
    return {"unacked_restore_interval": max(1, visibility_timeout_s // 10), "unacked_restore_throttle": 1}


def queue_keys(queue: str) -> list[str]:
    """The Redis lists kombu keeps for ``queue``: the queue itself, then its priority steps 3, 6, 9."""
    return [queue if step == 0 else f"{queue}{PRIORITY_SEP}{step}" for step in PRIORITY_STEPS]


def decode_message(raw: bytes | str) -> tuple[str | None, str | None, list]:
    """(task name, task id, args) of a kombu Redis message; (None, None, []) if it is not JSON."""
    try:
        msg = json.loads(raw)
        if msg.get("content-type") != "application/json":
            return None, None, []  # never decode anything else (pickle would run code)
        headers = msg.get("headers") or {}
        body = msg.get("body") or ""
        if (msg.get("properties") or {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        payload = json.loads(body)
        args = payload[0] if isinstance(payload, list) and payload else []
        return headers.get("task"), headers.get("id"), list(args) if isinstance(args, (list, tuple)) else []
    except (ValueError, TypeError, AttributeError):
        return None, None, []


def _claimed_message(entry: bytes | str) -> dict | None:
    """The message of an ``unacked`` hash value (``[message, exchange, routing key]``); None for anything else."""
    try:
        message = json.loads(entry)[0]
    except (ValueError, TypeError, IndexError, KeyError):
        return None
    return message if isinstance(message, dict) else None


def _extraction_args(raw) -> tuple[str, str] | None:
    """(run address, batch) of an extraction message; None for anything else (JSON only)."""
    task, _task_id, args = decode_message(raw)
    if task != EXTRACT_TASK or len(args) < 2:
        return None
    return str(args[0]), str(args[1])


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# --- lengths -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lengths:
    """How many messages the broker holds for a queue, read without reading a message."""

    waiting: int
    """Messages in the queue's lists, every priority step."""
    claimed: int
    """Messages delivered and not acknowledged, on every queue of the broker (kombu keeps one hash)."""


def lengths(client, queue: str) -> Lengths:
    """:class:`Lengths` of ``queue``: ``LLEN`` of each list and ``HLEN`` of the claims, in one round trip."""
    pipe = client.pipeline(transaction=False)
    keys = queue_keys(queue)
    for key in keys:
        pipe.llen(key)
    pipe.hlen(UNACKED_KEY)
    counts = pipe.execute()
    return Lengths(waiting=int(sum(counts[:len(keys)])), claimed=int(counts[-1]))


def waiting(client, queue: str) -> int:
    """Messages waiting in ``queue`` (every priority step), by ``LLEN``: no message is read."""
    return lengths(client, queue).waiting


# --- queued messages -----------------------------------------------------------------------------


def _walk_queue(client, queue: str, chunk: int, visit: Callable[[str, list], int]) -> None:
    """Read the queue's lists in chunks of ``LRANGE``; ``visit(key, raws)`` returns how many of
    ``raws`` it removed from ``key``, so that the next chunk starts where it should."""
    for key in queue_keys(queue):
        start = 0
        while True:
            raws = client.lrange(key, start, start + chunk - 1)
            if not raws:
                break
            removed = visit(key, raws)
            if len(raws) < chunk:
                break
            start += chunk - removed


def queued_of(client, queue: str, run_url: str | None = None, chunk: int = 2000) -> dict[str, dict[str, int]]:
    """``{run address: {batch: count}}`` of the extraction messages waiting in ``queue`` (of
    ``run_url`` only, if given); read in chunks of ``LRANGE``, JSON messages only."""
    out: dict[str, dict[str, int]] = {}

    def count(_key, raws) -> int:
        for raw in raws:
            found = _extraction_args(raw)
            if found is not None and (run_url is None or found[0] == run_url):
                per = out.setdefault(found[0], {})
                per[found[1]] = per.get(found[1], 0) + 1
        return 0

    _walk_queue(client, queue, chunk, count)
    return out


def remove_queued(client, queue: str, run_url: str, chunk: int = 2000) -> int:
    """Remove every waiting extraction message of ``run_url`` from ``queue`` (``LREM`` of each one
    found); returns how many. A message claimed meanwhile is not in the list any more and is left
    to its worker (which checks ``cancelled.json``)."""
    removed = 0

    def drop(key, raws) -> int:
        nonlocal removed
        mine = [raw for raw in raws if (_extraction_args(raw) or ("",))[0] == run_url]
        gone = sum(int(client.lrem(key, 1, raw)) for raw in mine)
        removed += gone
        return gone

    _walk_queue(client, queue, chunk, drop)
    return removed


def messages_by_run(client, queue: str) -> dict[str, int]:
    """How many messages, waiting in ``queue`` or claimed, name each run (a task's first argument;
    ``"?"`` for a message that is not ours: another task, not JSON). Reads every message: for a
    broker about to be emptied (``producer run``'s own), not for a fleet's."""
    raws = []
    for key in queue_keys(queue):
        raws += client.lrange(key, 0, -1)
    raws += [json.dumps(_claimed_message(entry)) for entry in client.hvals(UNACKED_KEY)]  # null: not ours
    out: dict[str, int] = {}
    for raw in raws:
        _task, _id, args = decode_message(raw)
        run_url = str(args[0]) if args else "?"
        out[run_url] = out.get(run_url, 0) + 1
    return out


# --- claims --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    """A delivered, unacknowledged extraction message (an entry of kombu's claims)."""

    tag: str
    """kombu's delivery tag: the entry's key; what :func:`drop_claims` and :func:`restore_claim` take."""
    run_url: str
    batch: str
    task_id: str | None
    delivered_at: float | None
    """kombu's score: the delivering worker's wall clock (shown, never compared across machines)."""


def claims(client) -> list[Claim]:
    """Every claimed extraction message, on every queue of the broker; other tasks are left out."""
    entries = client.hgetall(UNACKED_KEY)
    if not entries:
        return []
    delivered = {_text(k): float(v) for k, v in client.zrange(UNACKED_INDEX_KEY, 0, -1, withscores=True)}
    out = []
    for tag, raw in entries.items():
        tag = _text(tag)
        message = _claimed_message(raw)
        if message is None:
            continue
        task, task_id, args = decode_message(json.dumps(message))
        if task != EXTRACT_TASK or len(args) < 2:
            continue
        out.append(Claim(tag=tag, run_url=str(args[0]), batch=str(args[1]), task_id=task_id,
                         delivered_at=delivered.get(tag)))
    return out


def is_claimed(client, tag: str) -> bool:
    """Whether delivery ``tag`` is still claimed (not acknowledged, not restored)."""
    return bool(client.hexists(UNACKED_KEY, tag))


def drop_claims(client, tags: Iterable[str]) -> None:
    """Forget deliveries ``tags`` in one transaction, as their ack would (``HDEL`` + ``ZREM``; a
    missing tag is nothing to do). Their messages are not queued again."""
    tags = list(tags)
    if not tags:
        return
    pipe = client.pipeline()
    for tag in tags:
        pipe.hdel(UNACKED_KEY, tag)
        pipe.zrem(UNACKED_INDEX_KEY, tag)
    pipe.execute()


def declare_queue(broker_url: str, queue: str) -> None:
    """Declare ``queue`` and its binding on the broker (kombu's ``_kombu.binding.<queue>`` set).

    kombu's Redis transport routes a published message through that set; a broker that lost its
    data has none, and kombu then drops what is sent into ``ae.undeliver`` (its dead-letter list)
    instead of the queue, while a process that already declared it once does not declare it again
    (kombu caches declarations per connection). Cheap (one ``SADD``): call it before each send
    that may follow a broker's loss.

    Raises whatever kombu raises when the broker does not answer."""
    from kombu import Connection, Exchange, Queue

    with Connection(broker_url) as conn:
        Queue(queue, Exchange(queue, type="direct"), routing_key=queue)(conn.default_channel).declare()


def restore_claim(broker_url: str, queue: str, tag: str) -> bool:
    """Put claimed message ``tag`` back where consumers take from next, with kombu's own
    ``QoS.restore_by_tag`` (the code its visibility-timeout sweep runs): in one transaction
    (``WATCH`` on the claims) the entry leaves the claims and the same message is pushed onto the
    end of its queue that ``BRPOP`` takes first (producers ``LPUSH``), so it is never lost or
    doubled, and it runs next instead of behind the whole queue. Returns False when ``tag`` was
    no longer claimed (acknowledged or restored meanwhile).

    Raises whatever kombu raises when the broker does not answer."""
    from kombu import Connection

    declare_queue(broker_url, queue)  # the restore routes through the binding too
    with Connection(broker_url) as conn:
        channel = conn.default_channel
        client = channel.client
        if not is_claimed(client, tag):
            return False
        channel.qos.restore_by_tag(tag, client=client, leftmost=False)
        return True


__all__ = ["Claim", "Lengths", "lengths", "waiting", "queued_of", "remove_queued", "messages_by_run", "claims",
           "is_claimed", "drop_claims", "declare_queue", "restore_claim", "decode_message", "queue_keys", "restore_options",
           "EXTRACT_TASK",
           "UNACKED_KEY", "UNACKED_INDEX_KEY", "PRIORITY_SEP", "PRIORITY_STEPS"]
