"""The fleet's own keys on the broker: which workers are alive and what they serve, and the
messages they parked. One module owns this layout; producer and workers go through it.

A broker serves many runs and many nodes (one queue, ``HSX_QUEUE``). Beside kombu's own keys
(its queue lists and claims, which ``hsx/brokerlayout.py`` alone reads), the fleet keeps, per queue:

- ``hsx:<queue>:workers``: a hash, one field per worker process (``<host>-<pid>``), its
  :class:`Presence` as JSON, rewritten every ``HSX_HEARTBEAT_S``. A presence names the store
  roots and model the worker serves, its state (``idle``, ``working``, ``paused`` with the
  reason, ``stopped``) and the tasks it holds. It is **stamped with the broker's clock** (Redis
  ``TIME``), and read against the broker's clock: a presence is live while
  ``broker now - stamp <= HSX_LEASE_S``. No machine's wall clock is compared with another's
  (``workers/lease.py``). It reaches ``status`` when the store cannot take a status record (a
  full disk), and it is what ``enqueue`` reads to learn the roots the workers serve.
- ``hsx:<queue>:parked``: a hash, one field per ``<run address>\\n<batch>``, its :class:`Parked`
  as JSON: a message that a worker could not serve (outside its store roots, another model than
  its ``HSX_MODEL``, a run it cannot read) and took off the queue instead of refusing every task.
  Keyed by batch, so a message parked twice (a redelivery) is one entry. It goes back to the
  queue when a worker that serves it and has not refused it looks (``workers/lease.py``), with
  ``producer reconcile``, or is removed by ``producer cancel``.
- ``hsx:<queue>:runs``: a set of the run addresses enqueued on this queue (``enqueue`` adds, the
  workers' presences name the runs they served), which the healer of lost messages walks.
- ``hsx:<queue>:unaccounted``: a hash ``<run address>\\n<batch>`` -> broker time at which the
  healer first found the batch neither done, queued, claimed nor parked (``workers/lease.py``).
- ``hsx:<queue>:healer``: a short-lived lock (``SET NX EX``) that elects one healer per look.

Everything here is JSON; nothing is unpickled.
"""

from __future__ import annotations

from typing import Iterable

from pydantic import BaseModel, ConfigDict, Field


def workers_key(queue: str) -> str:
    return f"hsx:{queue}:workers"


def parked_key(queue: str) -> str:
    return f"hsx:{queue}:parked"


def runs_key(queue: str) -> str:
    return f"hsx:{queue}:runs"


def unaccounted_key(queue: str) -> str:
    return f"hsx:{queue}:unaccounted"


def healer_key(queue: str) -> str:
    return f"hsx:{queue}:healer"


def batch_field(run_url: str, batch: str) -> str:
    """The field of a batch in the parked and unaccounted hashes: ``<run address>\\n<batch>``."""
    return f"{run_url}\n{batch}"


def broker_time(client) -> float:
    """The broker's clock (Redis ``TIME``), in seconds since the epoch: the one clock every
    machine of the fleet reads alike."""
    seconds, micros = client.time()
    return float(seconds) + float(micros) / 1e6


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def worker_label(node: str | None, host: str | None, pid: int | None) -> str:
    """How every view names a worker process: its Celery node name and pid (``cpu0@vm pid 7197``), or
    its host and pid when the node name is not known (``vm pid 7197``: a record in the store names no
    node). The pid keeps apart the processes of one node name (two ``python -m workers`` on a host)."""
    who = node or host or "?"
    return f"{who} pid {pid}" if pid is not None else who


class HeldTask(BaseModel):
    """A task a worker process holds: received (prefetched, or waiting for its retry countdown) or running."""

    model_config = ConfigDict(extra="ignore")
    task_id: str
    run_url: str = ""
    batch: str = ""
    phase: str = "received"
    """``received`` until it starts, then the batch's phase (``claimed``, ``forward``, ``writing``, ``paused``...)."""


class Presence(BaseModel):
    """One worker process as the broker knows it (``hsx:<queue>:workers``)."""

    model_config = ConfigDict(extra="ignore")
    worker: str
    """``<host>-<pid>``, as in its status records."""
    host: str
    pid: int
    node: str | None = None
    """Celery's node name (``cpu0@host``), for ``celery inspect`` and Flower."""
    roots: list[str] = Field(default_factory=list)
    """The store roots it serves (``HSX_STORE_URL`` plus ``HSX_ALLOWED_STORES``, normalised)."""
    model: str | None = None
    """Its ``HSX_MODEL`` (None: it loads each run's own model)."""
    device: str | None = None
    state: str = "idle"
    """``idle``, ``loading`` (its ``HSX_MODEL`` target is being loaded and warmed up, since
    ``loading_since``), ``working``, ``paused`` (``paused_reason`` says why) or ``stopped`` (exited)."""
    loading_since: float | None = None
    """Unix time (the worker's clock) at which its load began, while ``state`` is ``loading``."""
    paused_reason: str | None = None
    paused_since: float | None = None
    """Broker time at which the pause began."""
    tasks: list[HeldTask] = Field(default_factory=list)
    runs: list[str] = Field(default_factory=list)
    """Run addresses this process served (the healer's list; bounded)."""
    batches_done: int = 0
    stamp: float = 0.0
    """Broker time of this write (Redis ``TIME``)."""
    started: float = 0.0
    """Broker time at which the process first wrote its presence."""

    def live(self, now: float, lease_s: float) -> bool:
        """Whether the process counts as alive at broker time ``now``: not stopped, written within ``lease_s``."""
        return self.state != "stopped" and now - self.stamp <= lease_s

    @property
    def label(self) -> str:
        """:func:`worker_label` of this process."""
        return worker_label(self.node, self.host, self.pid)

    def holds(self, task_id: str | None = None, run_url: str | None = None, batch: str | None = None) -> bool:
        """Whether it lists the task ``task_id``, or a task of batch ``batch`` of ``run_url``."""
        return any((task_id is not None and t.task_id == task_id)
                   or (run_url is not None and t.run_url == run_url and t.batch == batch) for t in self.tasks)


def write_presence(client, queue: str, presence: Presence) -> Presence:
    """Stamp ``presence`` with the broker's time and store it; returns the stamped record."""
    now = broker_time(client)
    stamped = presence.model_copy(update={"stamp": now, "started": presence.started or now})
    client.hset(workers_key(queue), presence.worker, stamped.model_dump_json())
    return stamped


def remove_presence(client, queue: str, worker: str) -> None:
    client.hdel(workers_key(queue), worker)


def read_presences(client, queue: str) -> list[Presence]:
    """Every presence on the broker (live or not); an entry that is not a presence is skipped."""
    out = []
    for _field, raw in (client.hgetall(workers_key(queue)) or {}).items():
        try:
            out.append(Presence.model_validate_json(raw))
        except ValueError:
            continue
    return out


def live_presences(client, queue: str, lease_s: float, now: float | None = None) -> list[Presence]:
    """The presences of processes alive at broker time ``now`` (default: the broker's now)."""
    now = broker_time(client) if now is None else now
    return [p for p in read_presences(client, queue) if p.live(now, lease_s)]


def prune_presences(client, queue: str, older_than_s: float = 86400.0) -> int:
    """Remove presences not written for ``older_than_s`` seconds of broker time (exited long ago)."""
    now = broker_time(client)
    old = [p.worker for p in read_presences(client, queue) if now - p.stamp > older_than_s]
    if old:
        client.hdel(workers_key(queue), *old)
    return len(old)


class Parked(BaseModel):
    """A message taken off the queue because the worker that got it could not serve it (``hsx:<queue>:parked``)."""

    model_config = ConfigDict(extra="ignore")
    run_url: str
    batch: str
    task_id: str | None = None
    reason: str
    """Why, with the fix (the error the worker met)."""
    cause: str = "not_served"
    """``not_served`` (outside the worker's roots), ``model`` (another model than the worker's),
    ``unreadable`` (the run could not be read: credentials, a newer format, a bad setting)."""
    refused_by: list[str] = Field(default_factory=list)
    """Workers (``<host>-<pid>``) that got it and could not serve it: none of them takes it back."""
    parked_at: float = 0.0
    """Broker time it was (last) parked."""
    times: int = 1
    """How many times it was parked."""


def park(client, queue: str, entry: Parked) -> Parked:
    """Add ``entry`` (or merge it into the entry of the same batch: its refusers and count); returns what is stored."""
    key, fld = parked_key(queue), batch_field(entry.run_url, entry.batch)
    now = broker_time(client)
    old_raw = client.hget(key, fld)
    refused = list(entry.refused_by)
    times = 1
    if old_raw:
        try:
            old = Parked.model_validate_json(old_raw)
            refused = list(dict.fromkeys([*old.refused_by, *refused]))
            times = old.times + 1
        except ValueError:
            pass
    stored = entry.model_copy(update={"refused_by": refused[-32:], "parked_at": now, "times": times})
    client.hset(key, fld, stored.model_dump_json())
    return stored


def read_parked(client, queue: str, run_url: str | None = None) -> list[Parked]:
    """The parked messages (of ``run_url`` only, if given), sorted by run and batch."""
    out = []
    for _field, raw in (client.hgetall(parked_key(queue)) or {}).items():
        try:
            p = Parked.model_validate_json(raw)
        except ValueError:
            continue
        if run_url is None or p.run_url == run_url:
            out.append(p)
    return sorted(out, key=lambda p: (p.run_url, p.batch))


def take_parked(client, queue: str, run_url: str, batch: str) -> bool:
    """Remove the parked entry of ``batch`` of ``run_url``; True if this call removed it (of
    several callers, exactly one gets True: ``HDEL`` is atomic), so only that one sends it again."""
    return bool(client.hdel(parked_key(queue), batch_field(run_url, batch)))


def register_runs(client, queue: str, run_urls: Iterable[str]) -> None:
    """Add run addresses to the queue's set of runs (the healer walks it)."""
    urls = [u for u in run_urls if u]
    if urls:
        client.sadd(runs_key(queue), *urls)


def known_runs(client, queue: str, presences: Iterable[Presence] = ()) -> list[str]:
    """The runs enqueued on the queue: its set of runs plus the runs the presences served."""
    runs = {_text(u) for u in (client.smembers(runs_key(queue)) or set())}
    for p in presences:
        runs.update(p.runs)
    return sorted(runs)


def forget_run(client, queue: str, run_url: str) -> None:
    """Drop a run from the set of runs (finished, cancelled or deleted) and its unaccounted entries."""
    client.srem(runs_key(queue), run_url)
    key = unaccounted_key(queue)
    prefix = run_url + "\n"
    stale = [f for f in (client.hkeys(key) or []) if _text(f).startswith(prefix)]
    if stale:
        client.hdel(key, *stale)


def elect(client, queue: str, me: str, ttl_s: float) -> bool:
    """True if ``me`` is the healer for the next ``ttl_s`` seconds (``SET NX EX``: one per look)."""
    return bool(client.set(healer_key(queue), me, nx=True, ex=max(1, int(ttl_s))))


__all__ = ["Presence", "HeldTask", "Parked", "broker_time", "write_presence", "remove_presence", "read_presences",
           "live_presences", "prune_presences", "park", "read_parked", "take_parked", "register_runs", "known_runs",
           "forget_run", "elect", "workers_key", "parked_key", "runs_key", "unaccounted_key", "healer_key",
           "batch_field", "worker_label"]
