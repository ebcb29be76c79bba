"""The fleet's keys on a real broker (the embedded valkey): presences read by the broker's clock,
parked messages merged by batch and taken back by exactly one caller, a run's waiting messages
removed without touching another run's (``hsx/fleet.py``)."""

from __future__ import annotations

import threading
import time

import pytest

from hsx.brokerlayout import queued_of, remove_queued, waiting
from hsx.fleet import (HeldTask, Parked, Presence, broker_time, elect, known_runs, live_presences, park, read_parked,
                       register_runs, take_parked, write_presence)
from hsx.queue import send_batches
from hsx.records import BatchSummary
from settings import Settings


def test_a_presence_is_stamped_and_judged_by_the_broker_s_clock_not_the_writer_s(client):
    """The stamp is the broker's TIME whatever the writer's clock says; it is live while the broker's now is within
    the lease of it, stale after, and never live once stopped."""
    stamped = write_presence(client, "gpu", Presence(worker="h-1", host="h", pid=1, stamp=-1e9, roots=["/r"]))
    now = broker_time(client)
    assert abs(stamped.stamp - now) < 5 and stamped.started == stamped.stamp
    assert [p.worker for p in live_presences(client, "gpu", lease_s=30)] == ["h-1"]
    assert live_presences(client, "gpu", lease_s=30, now=now + 31) == []
    write_presence(client, "gpu", stamped.model_copy(update={"state": "stopped"}))
    assert live_presences(client, "gpu", lease_s=30) == []


def test_a_presence_holds_its_tasks_by_id_or_by_batch(client):
    p = Presence(worker="h-1", host="h", pid=1, tasks=[HeldTask(task_id="t1", run_url="/r/run", batch="b000001")])
    assert p.holds(task_id="t1") and p.holds(run_url="/r/run", batch="b000001")
    assert not p.holds(task_id="t2") and not p.holds(run_url="/r/run", batch="b000002")


def test_a_message_parked_twice_is_one_entry_with_both_refusers_and_exactly_one_taker_wins(client):
    entry = Parked(run_url="/x/run", batch="b000003", reason="NotServed: outside", refused_by=["a-1"])
    park(client, "gpu", entry)
    stored = park(client, "gpu", entry.model_copy(update={"refused_by": ["b-2"]}))
    assert stored.times == 2 and stored.refused_by == ["a-1", "b-2"]
    assert [p.batch for p in read_parked(client, "gpu", "/x/run")] == ["b000003"]
    assert read_parked(client, "gpu", "/other") == []
    wins = []
    threads = [threading.Thread(target=lambda: wins.append(take_parked(client, "gpu", "/x/run", "b000003")))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(wins) == [False] * 7 + [True]
    assert read_parked(client, "gpu") == []


def test_remove_queued_takes_only_the_run_s_waiting_messages(broker, client):
    settings = Settings(_env_file=None)
    summaries = [BatchSummary(batch=f"b{i:06d}", num_samples=1, num_tokens=8) for i in range(5)]
    send_batches(settings, broker.url, "/r/a", "a", summaries)
    send_batches(settings, broker.url, "/r/b", "b", summaries[:3])
    assert waiting(client, "gpu") == 8
    assert sorted(queued_of(client, "gpu", "/r/a")["/r/a"]) == [f"b{i:06d}" for i in range(5)]
    assert remove_queued(client, "gpu", "/r/a", chunk=2) == 5
    assert queued_of(client, "gpu") == {"/r/b": {f"b{i:06d}": 1 for i in range(3)}}


def test_the_runs_of_a_queue_are_the_set_plus_what_live_workers_served(client):
    register_runs(client, "gpu", ["/r/a"])
    p = Presence(worker="h-1", host="h", pid=1, runs=["/r/b"])
    assert known_runs(client, "gpu", [p]) == ["/r/a", "/r/b"]
    client.flushdb()  # a wiped broker: the workers still know what they served
    assert known_runs(client, "gpu", [p]) == ["/r/b"]


def test_one_healer_is_elected_per_look(client):
    assert elect(client, "gpu", "a-1", 5) and not elect(client, "gpu", "b-2", 5)


def test_the_elected_healer_removes_presences_gone_for_a_day_and_keeps_the_others(broker, client):
    """A broker shared for months sees a new presence at every worker restart: the healer's look drops those
    not written for a day of broker time (``PRESENCE_KEEP_S``), and keeps a stopped one of an hour ago."""
    from workers.lease import PRESENCE_KEEP_S, Reclaimer

    now = broker_time(client)
    for name, age, state in (("gone-1", PRESENCE_KEEP_S + 60, "stopped"), ("gone-2", PRESENCE_KEEP_S + 60, "working"),
                             ("recent-3", 3600, "stopped")):
        body = Presence(worker=name, host="h", pid=1, state=state, stamp=now - age)
        client.hset("hsx:gpu:workers", name, body.model_dump_json())
    elected, _ = Reclaimer(Settings(_env_file=None, queue="gpu"), broker.url, me="healer-9").heal()
    assert elected
    assert sorted(_k.decode() if isinstance(_k, bytes) else _k for _k in client.hkeys("hsx:gpu:workers")) == ["recent-3"]


# --- the presence a worker process writes (workers/heartbeat.py) ---

def test_a_retried_task_stays_listed_while_its_new_delivery_waits():
    """Celery's retry sends the same task id again; the new message may be received before the attempt
    that sent it ends. Ending that attempt must not unlist the waiting delivery (its claim would look
    unlisted, and be reclaimed under a live worker)."""
    from workers.heartbeat import Heartbeat

    beat = Heartbeat(interval_s=3600)
    beat.received("t1", "file:///r", "b000001")
    beat.received("t1", "file:///r", "b000001")  # the retry's message, received while the attempt runs
    beat.released("t1")  # the attempt ends
    assert [(t.task_id, t.phase) for t in beat.presence().tasks] == [("t1", "received")]
    beat.released("t1")  # the retry ran and ended
    assert beat.presence().tasks == []


class _HangingStore:
    """A store whose writes hang for ``hang_s`` (what a worker meets when an S3 request hangs under
    boto's retries): the one test double here, since no real store can be made to hang on demand."""

    def __init__(self, hang_s: float):
        self.hang_s, self.writes = hang_s, 0

    def write(self, key, data, **_kw):
        self.writes += 1
        time.sleep(self.hang_s)


def test_the_presence_is_rewritten_while_a_store_write_hangs(broker, client):
    """The presence holds the leases of the batches a worker runs: its rewrites go on, every heartbeat,
    while the status record's write to the store hangs."""
    from hsx.fleet import read_presences
    from workers.heartbeat import Heartbeat

    beat = Heartbeat(interval_s=0.5)
    beat.attach_broker(broker.url, "gpu", ["/runs"], None)
    store = _HangingStore(hang_s=8)
    beat.phase("file:///runs/r", store, "b000001", "forward", task_id="t1")
    stamps = set()
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        stamps |= {p.stamp for p in read_presences(client, "gpu") if p.holds(task_id="t1")}
        time.sleep(0.2)
    assert store.writes >= 1, "the status record's write never started"
    assert len(stamps) >= 4, f"the presence was rewritten {len(stamps)} times in 6 s while the store hung"
