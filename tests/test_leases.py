"""Leases and retries by cause, with real processes (the embedded valkey broker, real ``celery -A
workers worker`` processes, the tiny target, real ShareGPT records, the S3 server fixture) and no
command typed to recover: every scenario ends with ``verify`` and each planned sample stored once.

The lease time and the reclaim interval are settings (``HSX_LEASE_S``, ``HSX_RECLAIM_INTERVAL_S``),
so these tests use seconds where production uses minutes; the default target (every stranded batch
back at the head of the queue within ``HSX_LEASE_S`` plus two looks, 2 min 30 s) scales the same way.
A lease is held by the holder's presence on the broker, stamped by the broker's clock
(``workers/lease.py``); the clock-skew, wiped-broker, parked-message and launcher-death cases are in
test_lease_clocks.py, test_healer.py, test_unpark.py and test_launcher_parent_death.py.
"""

from __future__ import annotations

import json
import time
import uuid
from types import SimpleNamespace

import pytest

from jobfixtures import WorkerProcess, wait_until
from clusters import HOLD_S, Cluster, assert_complete, copy_plan, held_batch, wait_done, wait_log

from hsx.broker import redis_client
from hsx.brokerlayout import UNACKED_INDEX_KEY, UNACKED_KEY
from hsx.errors import FidelityError, SpoolFull, StoreError
from hsx.records import done_batches
from hsx.store import MissingKey
from settings import Settings
from workers.causes import DATA, PARK, TRANSIENT, UNKNOWN, classify
from workers.lease import DEAD, HELD, UNLISTED, lease_state

#: lease and reclaim interval of the workers here (seconds).
LEASE = dict(lease_s=6, reclaim_interval_s=1, task_retry_base_s=0.5, task_retry_max_s=2)


def _reclaims(run_store) -> list[dict]:
    return [json.loads(run_store.read(k)) for k in run_store.list("reclaims/")]


@pytest.mark.timeout(150)
def test_a_sigkilled_worker_s_batch_is_reclaimed_by_a_live_worker_with_no_command_typed(template, cluster, tmp_path):
    """SIGKILL a worker holding a batch: after its lease (6 s) a live worker enqueues the batch again, once (one
    reclaim record), the stale claim leaves the broker, and the run completes exactly once; status shows the dead
    worker ``lost``."""
    from producer.status import RunWatch

    run_store = copy_plan(template, str(tmp_path / "out"), cluster.settings)
    doomed = cluster.worker("doomed", wait=False, faults=f"pause_forward={HOLD_S}", **LEASE)
    cluster.worker("rescuer", **LEASE)
    doomed.wait_ready()
    cluster.enqueue_all(run_store)
    victim = held_batch(wait_log(doomed, "fault injection: pausing"))
    time.sleep(1.5)  # a heartbeat with the batch listed
    killed_at = time.monotonic()
    doomed.kill()
    wait_done(run_store, 90)
    took = time.monotonic() - killed_at
    reclaims = _reclaims(run_store)
    assert [r["batch"] for r in reclaims] == [victim], reclaims
    assert reclaims[0]["attempt"] == 1 and reclaims[0]["by"].endswith(str(cluster.workers[1].proc.pid))
    assert took >= LEASE["lease_s"] - 2, f"reclaimed after {took:.1f} s, before the lease expired"
    assert_complete(run_store)
    wait_until(lambda: redis_client(cluster.broker.url).hlen(UNACKED_KEY) == 0, 10, "the stale claim to be removed")
    rows = {r["pid"]: r for r in RunWatch(run_store).poll()["workers"]}
    assert rows[doomed.proc.pid]["state"] == "lost" and rows[doomed.proc.pid]["online"] is False


@pytest.mark.timeout(180)
def test_every_worker_of_a_node_killed_while_another_node_lives_completes_the_run(template, cluster, tmp_path):
    """Two workers of one "node" SIGKILLed together, each holding a batch; the third lives: both batches are
    reclaimed (one record each) and done, with no command typed."""
    run_store = copy_plan(template, str(tmp_path / "out"), cluster.settings)
    node = [cluster.worker(f"node1-{i}", wait=False, faults=f"pause_forward={HOLD_S}", **LEASE) for i in (0, 1)]
    cluster.worker("node2", **LEASE)
    for w in node:
        w.wait_ready()
    cluster.enqueue_all(run_store)
    victims = {held_batch(wait_log(w, "fault injection: pausing")) for w in node}
    time.sleep(1.5)
    for w in node:
        w.kill()
    wait_done(run_store, 120)
    assert sorted(r["batch"] for r in _reclaims(run_store)) == sorted(victims)
    assert_complete(run_store)


@pytest.mark.timeout(150)
def test_a_live_worker_s_long_batch_keeps_its_lease(template, cluster, tmp_path):
    """A batch that runs three times the lease on a live worker is renewed by its presence: nobody reclaims it.
    (The run's other batches, never sent, are the healer's: enqueued again as lost, and done by the other worker.)"""
    run_store = copy_plan(template, str(tmp_path / "out"), cluster.settings)
    slow = cluster.worker("slow", faults="pause_forward=18", **LEASE)
    first = template.batches[0]
    cluster.enqueue(run_store, [first])
    wait_log(slow, f"at forward of batch {first.batch}")
    cluster.worker("other", **LEASE)  # started once slow holds the batch: a live worker that could reclaim it
    wait_until(lambda: first.batch in done_batches(run_store), 60, "the long batch's marker")
    reclaims = _reclaims(run_store)
    assert all(r["batch"] != first.batch and r["why"].startswith("lost:") for r in reclaims), reclaims
    assert f"'batch': '{first.batch}'" not in cluster.workers[1].log(), "the other worker ran the long batch"


@pytest.mark.timeout(180)
def test_a_worker_with_a_wrong_s3_secret_parks_the_run_s_messages_and_a_healthy_one_does_them(template, secured_s3,
                                                                                              tmp_path, tiny_cache):
    """A worker started with a wrong secret takes the run's tasks, finds its credentials refused and parks
    each message (the reason and its name in the entry) instead of refusing every task; it stays up. A healthy
    worker started later brings them back with no command typed and does every batch."""
    import socket

    from hsx.fleet import read_parked

    settings = Settings(_env_file=None, s3_endpoint_url=secured_s3.endpoint_url, s3_region="us-east-1",
                        s3_access_key_id=secured_s3.access_key, s3_secret_access_key=secured_s3.secret_key)
    s3 = SimpleNamespace(settings=settings, url=f"s3://guarded/{uuid.uuid4().hex[:8]}")
    c = Cluster(tmp_path, tiny_cache, s3=s3)
    try:
        run_store = copy_plan(template, s3.url, c.settings)
        env = c.env(**LEASE)
        env["HSX_S3_SECRET_ACCESS_KEY"] = "wrong-secret"
        bad = WorkerProcess(env, "bad", tmp_path / "bad.log")
        c.workers.append(bad)
        bad.wait_ready()
        c.enqueue_all(run_store)
        line = wait_log(bad, "parked (this worker cannot serve it", 60)
        assert "credentials refused" in line, line
        client = redis_client(c.broker.url)
        wait_until(lambda: client.hlen("hsx:gpu:parked") == len(template.batches) and client.llen("gpu") == 0
                   and client.hlen(UNACKED_KEY) == 0, 30, "every message parked")
        assert bad.proc.poll() is None, "a worker that cannot read one run stays up for the others"
        assert not done_batches(run_store)
        name = f"{socket.gethostname()}-{bad.proc.pid}"
        for entry in read_parked(client, "gpu"):
            assert entry.cause == "unreadable" and "credentials refused" in entry.reason and entry.refused_by == [name]

        c.worker("good", **LEASE)
        wait_done(run_store, 120)
        assert "'status': 'done'" not in bad.log()
        assert_complete(run_store)
    finally:
        c.close()


@pytest.mark.timeout(150)
def test_a_full_store_pauses_the_worker_with_the_batch_in_hand_and_the_run_completes(template, cluster, tmp_path):
    """The store's disk full on the first shard write (ENOSPC, HSX_STORE_RETRY_S=0): the worker pauses with the
    batch in hand and writes it once there is room (no retry through the queue, no failure record, no reclaim:
    its presence holds the lease while it waits), and the run completes by itself."""
    run_store = copy_plan(template, str(tmp_path / "out"), cluster.settings)
    worker = cluster.worker("cramped", faults="store_full=1", store_retry_s=0, **LEASE)
    cluster.enqueue_all(run_store)
    wait_done(run_store, 90)
    assert "this worker pauses until there is room" in wait_log(worker, "store full at")
    wait_log(worker, "the store has room again; resumed")
    assert "retrying through the queue" not in worker.log()
    assert not run_store.list("failures/") and not _reclaims(run_store)
    assert_complete(run_store)


def test_errors_are_sorted_by_cause():
    """Store outages and full disks are waited for; refused credentials and a run this worker does not serve
    park the message; a batch's own bad data fails that batch after its tries; a bug is of no known cause."""
    import errno

    import redis.exceptions

    from hsx.errors import StoreFull

    full = StoreFull("write shards/x: the disk is full ([Errno 28] No space left on device)")
    try:
        raise StoreError("write x failed") from OSError(errno.ENOSPC, "No space left on device")
    except StoreError as exc:
        chained = exc
    assert [classify(e) for e in (StoreError("timeout", transient=True), full, chained, SpoolFull("spool full"),
                                  redis.exceptions.ConnectionError("reset"))] == [TRANSIENT] * 5
    assert classify(StoreError("s3://b: credentials refused (HTTP 403)")) == PARK
    assert classify(FidelityError("batch b1 of run r: all 3 samples have NaN/Inf hidden states (first: ...)")) == DATA
    # A key missing mid-batch fails that batch (after its tries); it never makes a worker refuse.
    assert classify(MissingKey("plan/b000001.npz")) == DATA
    # A task whose message is at fault (not a store URL, a bad batch name) is dropped: no worker could run it.
    # A run this worker does not serve (outside its roots, another model) is parked for a worker that does.
    from hsx.access import NotServed, Refused
    from workers.causes import REFUSED

    assert classify(Refused("task batch '../x' refused")) == REFUSED
    assert classify(NotServed("task run address '/elsewhere' refused")) == PARK
    assert classify(KeyError("layer_ids")) == UNKNOWN


def test_a_claim_is_held_by_a_live_presence_that_lists_it_and_dead_with_only_stale_or_stopped_ones():
    """Held: a presence stamped within the lease (broker clock) lists the task id, or the run and batch.
    Dead: only stopped or stale presences list it. Unlisted: none does. No wall clock of a worker is read."""
    from hsx.brokerlayout import Claim
    from hsx.fleet import HeldTask, Presence

    now = 1_000_000.0
    claim = Claim(tag="t", run_url="/r", batch="b1", task_id="id1", delivered_at=None)

    def pres(worker, age, state="working", task_id="id1", batch="b1"):
        return Presence(worker=worker, host="h", pid=1, state=state, stamp=now - age,
                        tasks=[HeldTask(task_id=task_id, run_url="/r", batch=batch)])

    state, who = lease_state(claim, [pres("a", 5), pres("b", 200)], now, 120)
    assert state == HELD and [p.worker for p in who] == ["a"]
    assert lease_state(claim, [pres("a", 5, task_id="other")], now, 120)[0] == HELD, "same run and batch"
    assert lease_state(claim, [pres("a", 121)], now, 120)[0] == DEAD
    assert lease_state(claim, [pres("a", 1, state="stopped")], now, 120)[0] == DEAD
    assert lease_state(claim, [pres("a", 1, task_id="x", batch="b2")], now, 120) == (UNLISTED, [])


TAKE_ONE_AND_DIE = """
import os, signal, sys
from kombu import Connection
with Connection(sys.argv[1]) as conn:
    msg = conn.SimpleQueue(sys.argv[2]).get(timeout=10)
    print(msg.headers["id"], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # dies holding the delivery, unacknowledged
"""


class FakeClock:
    """A monotonic clock the test moves (seconds)."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _die_holding(broker_url: str, count: int) -> list[str]:
    """``count`` consumers that each take one message and die holding it (SIGKILL); their task ids."""
    import subprocess
    import sys

    return [subprocess.run([sys.executable, "-c", TAKE_ONE_AND_DIE, broker_url, "gpu"], capture_output=True, text=True,
                           timeout=30).stdout.strip() for _ in range(count)]


@pytest.mark.timeout(60)
def test_a_reclaimed_batch_runs_next_not_behind_the_queue(tmp_path):
    """A consumer that writes no presence dies holding a delivery while 5 more batches wait. Once this observer
    has seen it unlisted for the lease (its own monotonic clock), the reclaim puts that same message (same task
    id, once) where workers take from next: the queue's first pop returns it, and a second look reclaims
    nothing. (Reclaims that joined the back of the queue kept stranded batches waiting for the whole queue:
    325 s median in the fault soak.)"""
    from hsx.broker import EmbeddedBroker
    from hsx.brokerlayout import decode_message
    from hsx.fleet import broker_time
    from hsx.queue import EXTRACT_TASK, make_celery
    from hsx.store import open_store
    from workers.lease import Reclaimer

    settings = Settings(_env_file=None, lease_s=6, reclaim_interval_s=1, store_url=str(tmp_path))
    run_url = str(tmp_path / "run")
    run_store = open_store(run_url)  # a run directory with no markers
    with EmbeddedBroker(tmp_path / "broker") as broker:
        app = make_celery(settings, broker.url)
        for i in range(6):
            app.send_task(EXTRACT_TASK, args=[run_url, f"b{i:03d}"], task_id=f"t{i}")
        app.close()
        assert _die_holding(broker.url, 1) == ["t0"], "the first one sent is the first one taken"
        client = redis_client(broker.url)
        assert client.hlen(UNACKED_KEY) == 1 and client.llen("gpu") == 5

        clock = FakeClock()
        reclaimer = Reclaimer(settings, broker.url, me="rescuer", clock=clock)
        assert reclaimer.once().reclaimed == [], "reclaimed at first sight"
        clock.t += LEASE["lease_s"] - 1
        assert reclaimer.once().reclaimed == [], "reclaimed before the lease expired"
        clock.t += 2
        [done] = reclaimer.once().reclaimed
        assert done["batch"] == "b000" and done["enqueued"] and done["why"].startswith("lease expired (no worker listed")
        assert client.hlen(UNACKED_KEY) == 0 and client.zcard(UNACKED_INDEX_KEY) == 0
        assert client.llen("gpu") == 6, "the message is back once, not twice"
        clock.t += 100
        assert reclaimer.once().reclaimed == []
        [record] = _reclaims(run_store)
        assert abs(record["at_unix"] - broker_time(client)) < 30, "the record's time is the broker's"

        _, raw = client.brpop("gpu", timeout=5)  # kombu's consumers BRPOP: this is what a worker takes next
        assert decode_message(raw)[1:] == ("t0", [run_url, "b000"])
        assert json.loads(raw)["headers"]["redelivered"] is True


@pytest.mark.timeout(60)
def test_a_stopped_holder_s_claim_comes_back_at_once_a_stale_one_s_on_a_second_look_and_a_live_one_s_never(
        tmp_path):
    """Three consumers die holding t0, t1, t2. A live presence (stamped now by the broker) lists t0: never
    reclaimed, however long. A presence not rewritten for the lease lists t1: reclaimed once a second look,
    two heartbeats later by the observer's clock, finds it still stale. A ``stopped`` presence lists t2:
    reclaimed at the first look."""
    from hsx.broker import EmbeddedBroker
    from hsx.fleet import HeldTask, Presence, broker_time, workers_key, write_presence
    from hsx.store import open_store
    from workers.lease import Reclaimer, stale_confirm_s

    settings = Settings(_env_file=None, lease_s=6, reclaim_interval_s=1, heartbeat_s=1, store_url=str(tmp_path))
    run_url = str(tmp_path / "run")
    open_store(run_url)
    with EmbeddedBroker(tmp_path / "broker") as broker:
        from hsx.queue import EXTRACT_TASK, make_celery

        app = make_celery(settings, broker.url)
        for i in range(3):
            app.send_task(EXTRACT_TASK, args=[run_url, f"b{i:03d}"], task_id=f"t{i}")
        app.close()
        assert _die_holding(broker.url, 3) == ["t0", "t1", "t2"]
        client = redis_client(broker.url)

        def presence(name, task, **kw):
            return Presence(worker=name, host="h", pid=1, tasks=[HeldTask(task_id=task, run_url=run_url,
                                                                          batch="b" + task[1:].zfill(3))], **kw)

        write_presence(client, "gpu", presence("alive", "t0", state="working"))
        client.hset(workers_key("gpu"), "gone", presence("gone", "t1", stamp=broker_time(client) - 7).model_dump_json())
        write_presence(client, "gpu", presence("dead", "t2", state="stopped"))

        clock = FakeClock()
        reclaimer = Reclaimer(settings, broker.url, me="rescuer", clock=clock)
        first = reclaimer.once().reclaimed
        assert [(r["batch"], r["why"]) for r in first] == [("b002", "its worker died")]
        clock.t += stale_confirm_s(settings)
        second = reclaimer.once().reclaimed
        assert [r["batch"] for r in second] == ["b001"] and second[0]["why"].startswith("lease expired (its worker's")
        for _ in range(3):
            write_presence(client, "gpu", presence("alive", "t0", state="working"))  # its heartbeat
            clock.t += 100
            assert reclaimer.once().reclaimed == [], "the live holder's claim was reclaimed"
        assert client.hlen(UNACKED_KEY) == 1


def _launcher(cluster, tmp_path, faults: str, lease: dict):
    """``python -m workers --count 1`` on the cluster's broker (one task thread, no restart within the test),
    logging to ``launcher.log``; returns (its process, the log's path)."""
    import subprocess
    import sys

    from jobfixtures import ROOT

    log_path = tmp_path / "launcher.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "workers", "--count", "1"], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env=cluster.env(faults=faults, worker_restart_delay_s=120, worker_concurrency=1, **lease))
    return proc, log_path


def _kill_tree(proc) -> None:
    import psutil

    for p in psutil.Process(proc.pid).children(recursive=True):
        p.kill()
    proc.kill()
    proc.wait()


@pytest.mark.timeout(150)
def test_a_worker_the_launcher_saw_die_has_its_batch_put_back_at_once_not_after_its_lease(template, cluster, tmp_path):
    """``python -m workers`` reaps its SIGKILLed child holding batches: it marks the child's record ``stopped`` with
    the batches ``abandoned`` and puts their claims back at once (a reclaim record each, by the launcher, ``its
    worker died``), so a live worker does them long before their lease (10 minutes here) would expire."""
    import socket

    import psutil

    from hsx.records import WorkerStatus

    run_store = copy_plan(template, str(tmp_path / "out"), cluster.settings)
    long_lease = dict(lease_s=600, reclaim_interval_s=1)
    launcher, log_path = _launcher(cluster, tmp_path, f"pause_forward={HOLD_S}", long_lease)
    try:
        wait_until(lambda: "ready." in log_path.read_text(errors="replace"), 90, "the launcher's worker ready")
        cluster.worker("rescuer", **long_lease)
        cluster.enqueue_all(run_store)
        line = wait_until(lambda: next((x for x in log_path.read_text(errors="replace").splitlines()
                                        if "fault injection: pausing" in x), None), 60, "the launcher's worker to hold a batch")
        victim = held_batch(line)
        time.sleep(1.5)  # a heartbeat with the batch listed
        (child,) = psutil.Process(launcher.pid).children()
        killed_at = time.monotonic()
        child.kill()
        wait_done(run_store, 60)
        took = time.monotonic() - killed_at
        assert took < 45, f"the batch took {took:.0f} s after the kill: it waited for something"
        dead = WorkerStatus.read(run_store, f"{socket.gethostname()}-{child.pid}")
        assert dead.state == "stopped" and victim in dead.abandoned and dead.batches == [], dead
        reclaims = _reclaims(run_store)  # its task threads held more than the paused batch, maybe one received too
        assert set(dead.abandoned) <= {r["batch"] for r in reclaims}, reclaims
        for r in reclaims:
            assert r["why"] == "its worker died" and r["by"] == f"{socket.gethostname()}-{launcher.pid}", r
        assert_complete(run_store)
        assert "put back at the head of the queue" in log_path.read_text(errors="replace")
        from hsx.fleet import read_presences

        [presence] = [p for p in read_presences(redis_client(cluster.broker.url), "gpu") if p.pid == child.pid]
        assert presence.state == "stopped", "the launcher marked its dead child stopped on the broker"
    finally:
        _kill_tree(launcher)


@pytest.mark.timeout(150)
def test_a_worker_killed_on_delivery_before_listing_the_message_has_it_put_back_in_seconds(template, cluster, tmp_path):
    """A worker SIGKILLed the moment a message is delivered to it (``HSX_FAULTS=die_received=KILL``: before its
    presence lists it) leaves a claim nobody lists. ``python -m workers`` sees the death, looks again a few
    seconds later and puts that claim back (``its worker died before listing it``), so a live worker does the
    batch long before its lease (10 minutes here) would expire."""
    run_store = copy_plan(template, str(tmp_path / "out"), cluster.settings)
    long_lease = dict(lease_s=600, reclaim_interval_s=1)
    launcher, log_path = _launcher(cluster, tmp_path, "die_received=KILL", long_lease)
    try:
        wait_until(lambda: "ready." in log_path.read_text(errors="replace"), 90, "the launcher's worker ready")
        first = template.batches[0]
        cluster.enqueue(run_store, [first])
        wait_until(lambda: "killed by SIGKILL" in log_path.read_text(errors="replace"), 60, "the worker's death on delivery")
        died_at = time.monotonic()
        cluster.worker("rescuer", **long_lease)
        wait_until(lambda: first.batch in done_batches(run_store), 60, "the batch done by the rescuer")
        assert time.monotonic() - died_at < 60
        reclaims = _reclaims(run_store)
        assert [(r["batch"], r["why"]) for r in reclaims] == [(first.batch, "its worker died before listing it")], reclaims
        assert "put back at the head of the queue" in log_path.read_text(errors="replace")
    finally:
        _kill_tree(launcher)
