"""Idempotent enqueue on the embedded valkey broker: a batch queued already is not sent again, a
batch whose delivery a dead consumer left unacknowledged is (it is lost), and once that batch has
its marker, reconcile clears the stale delivery from kombu's claims (``UNACKED_KEY`` and its index).
A batch that moves while enqueue looks (finishes, or is delivered and not yet listed by its worker)
is not sent again, and every batch is counted once: done, queued, running, parked or sent.

The run is a copy of the shared small run (tests/smallrun.py) with its markers and shards removed:
a planned run with nothing done. The dead consumer is a real kombu consumer in a child process that
takes one message and is SIGKILLed before acknowledging it, as a worker killed mid-batch.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from conftest import embedded_broker
from smallrun import copy_run

import hsx.brokerlayout
import producer.enqueue
from hsx.broker import redis_client
from hsx.fleet import HeldTask, Presence, write_presence
from hsx.records import BatchSummary
from hsx.runconfig import load_run
from hsx.store import open_store
from producer.enqueue import enqueue_batches
from hsx.brokerlayout import UNACKED_INDEX_KEY, UNACKED_KEY
from producer.reconcile import reconcile_run
from settings import Settings

pytestmark = pytest.mark.timeout(120)

TAKE_ONE_AND_DIE = """
import os, signal, sys
from kombu import Connection
with Connection(sys.argv[1]) as conn:
    q = conn.SimpleQueue(sys.argv[2])
    msg = q.get(timeout=10)
    print(msg.headers["id"], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # dies holding the delivery, unacknowledged
"""


@pytest.fixture
def broker():
    """A broker of this test's own (not the module's, tests/conftest.py)."""
    yield from embedded_broker()


def _fresh_run(small_run, tmp_path):
    run_dir = copy_run(small_run, tmp_path)
    for sub in ("markers", "shards", "workers", "failures"):
        shutil.rmtree(run_dir / sub, ignore_errors=True)
    store = open_store(str(run_dir))
    batches = BatchSummary.read_list(store)
    planned = SimpleNamespace(run_store=store, batches=batches, config=load_run(store), run_url=store.url)
    return run_dir, store, planned


def test_a_second_enqueue_sends_only_what_is_lost_and_reconcile_clears_stale_deliveries(small_run, tmp_path, broker,
                                                                                        monkeypatch):
    """enqueue twice: one message per batch. A consumer killed holding one: the next enqueue sends that batch alone.
    With its marker written, reconcile removes the dead delivery from ``UNACKED_KEY`` and ``UNACKED_INDEX_KEY``."""
    run_dir, store, planned = _fresh_run(small_run, tmp_path)
    settings = Settings(_env_file=None, broker_url=broker.url)
    names = sorted(b.batch for b in planned.batches)
    client = redis_client(broker.url)

    first = enqueue_batches(planned, settings, broker.url)
    assert sorted(first.enqueued) == names and first.in_flight == {}
    second = enqueue_batches(planned, settings, broker.url)
    assert second.enqueued == [] and second.in_flight == {b: "queued" for b in names}
    assert client.llen("gpu") == len(names), "the second enqueue sent batches that were still queued"

    dead = subprocess.run([sys.executable, "-c", TAKE_ONE_AND_DIE, broker.url, "gpu"], capture_output=True, text=True, timeout=60)
    assert dead.returncode == -9, dead.stderr
    task_id = dead.stdout.strip()
    held = task_id.split(".")[1]
    assert client.hlen(UNACKED_KEY) == 1 and client.zcard(UNACKED_INDEX_KEY) == 1

    monkeypatch.setattr(producer.enqueue, "UNLISTED_CONFIRM_S", 0.3)  # the second look at its unlisted claim
    third = enqueue_batches(planned, settings, broker.url)
    assert third.enqueued == [held], "the dead consumer's batch is lost: it must be sent again, and only it"
    assert third.in_flight == {b: "queued" for b in names if b != held}

    _write_marker(small_run, run_dir, held)  # the batch gets done; the dead delivery is now stale

    dry = reconcile_run(store, settings, broker.url, grace_s=None, dry_run=True)
    assert dry["cleared_claims"] == [held] and client.hlen(UNACKED_KEY) == 1, "a dry run changes nothing"
    report = reconcile_run(store, settings, broker.url, grace_s=None)
    assert report["cleared_claims"] == [held]
    assert client.hlen(UNACKED_KEY) == 0 and client.zcard(UNACKED_INDEX_KEY) == 0
    assert report["enqueued"] == [], "every other batch is still queued"


def _write_marker(small_run, run_dir, batch: str) -> None:
    """Batch ``batch`` done: its real marker and shard, copied from the original run."""
    marker = json.loads((small_run["dir"] / "markers" / f"{batch}.json").read_text())
    (run_dir / "shards").mkdir(exist_ok=True)
    shutil.copy(small_run["dir"] / marker["shard"]["key"], run_dir / marker["shard"]["key"])
    (run_dir / "markers").mkdir(exist_ok=True)
    shutil.copy(small_run["dir"] / "markers" / f"{batch}.json", run_dir / "markers" / f"{batch}.json")


class FakeWorker:
    """A live worker as the broker sees it: a real kombu consumer holding one delivery (claimed, not
    acknowledged) and a presence (``hsx/fleet.py``) that lists it or not."""

    def __init__(self, broker_url: str, queue: str, run_url: str):
        from kombu import Connection

        self.client, self.queue, self.run_url = redis_client(broker_url), queue, run_url
        self.conn = Connection(broker_url)
        self.message = self.conn.SimpleQueue(queue).get(timeout=10)
        self.task_id = self.message.headers["id"]
        self.batch = self.task_id.split(".")[1]
        self.presence = Presence(worker=f"{socket.gethostname()}-{os.getpid()}", host=socket.gethostname(),
                                 pid=os.getpid(), state="working")

    def list_it(self) -> None:
        write_presence(self.client, self.queue, self.presence.model_copy(
            update={"tasks": [HeldTask(task_id=self.task_id, run_url=self.run_url, batch=self.batch, phase="forward")]}))

    def finish(self, small_run, run_dir) -> None:
        """As a worker ends a batch: the marker, then the presence drops it, then the ack."""
        _write_marker(small_run, run_dir, self.batch)
        write_presence(self.client, self.queue, self.presence)
        self.message.ack()

    def close(self) -> None:
        self.conn.close()


def _counted_once(result, names) -> None:
    """Every planned batch is in exactly one of done, in flight (queued, running, parked) and sent."""
    counted = result.already_done + list(result.in_flight) + result.enqueued
    assert sorted(counted) == sorted(names), (result.already_done, result.in_flight, result.enqueued)


#: the reads of one enqueue's look, as the names it calls them by; each test finishes the batch right after one.
LOOK_READS = [(producer.enqueue, "done_batches"), (hsx.brokerlayout, "queued_of"),
              (producer.enqueue, "read_presences"), (hsx.brokerlayout, "claims")]


@pytest.mark.parametrize("module,read", LOOK_READS, ids=[r for _m, r in LOOK_READS])
def test_a_batch_that_finishes_while_enqueue_looks_is_not_sent_again(small_run, tmp_path, broker, monkeypatch, module, read):
    """A second enqueue while a worker runs a batch, which finishes (marker, presence, ack) right after
    one of the look's reads: the batch is counted running or done, nothing is sent, and
    done + queued + running + sent = planned. Reading the markers before the broker sent it again."""
    _run_dir, store, planned = _fresh_run(small_run, tmp_path)
    settings = Settings(_env_file=None, broker_url=broker.url)
    names = sorted(b.batch for b in planned.batches)
    client = redis_client(broker.url)
    assert sorted(enqueue_batches(planned, settings, broker.url).enqueued) == names
    worker = FakeWorker(broker.url, settings.queue, planned.run_url)
    worker.list_it()
    real, finished = getattr(module, read), []

    def read_then_finish(*args, **kwargs):
        out = real(*args, **kwargs)
        if not finished:
            worker.finish(small_run, _run_dir)
            finished.append(read)
        return out

    monkeypatch.setattr(module, read, read_then_finish)
    try:
        again = enqueue_batches(planned, settings, broker.url)
    finally:
        worker.close()
    assert finished == [read], f"the batch never finished during the look (after {read})"
    assert again.enqueued == [], f"{worker.batch} finished after the look read {read} and was sent again"
    assert again.in_flight.get(worker.batch, "done" if worker.batch in again.already_done else None) in ("running", "done")
    _counted_once(again, names)
    assert client.llen(settings.queue) == len(names) - 1 and client.hlen(UNACKED_KEY) == 0


def test_a_delivery_its_worker_has_not_listed_yet_is_not_sent_again(small_run, tmp_path, broker, monkeypatch):
    """A batch delivered to a live worker (claimed) that lists it in its presence only a moment later
    (its write gap): a second enqueue then counts it running and sends nothing. Without the second
    look at an unlisted claim it was sent again, and ran twice."""
    _run_dir, _store, planned = _fresh_run(small_run, tmp_path)
    settings = Settings(_env_file=None, broker_url=broker.url)
    names = sorted(b.batch for b in planned.batches)
    client = redis_client(broker.url)
    enqueue_batches(planned, settings, broker.url)
    worker = FakeWorker(broker.url, settings.queue, planned.run_url)
    monkeypatch.setattr(producer.enqueue, "UNLISTED_CONFIRM_S", 1.0)
    lister = threading.Timer(0.3, worker.list_it)  # the worker's presence lists it within its write gap
    lister.start()
    try:
        started = time.monotonic()
        again = enqueue_batches(planned, settings, broker.url)
        waited_s = time.monotonic() - started
        in_broker = client.llen(settings.queue), client.hlen(UNACKED_KEY)  # before the close puts the claim back
    finally:
        lister.join()
        worker.close()
    assert again.enqueued == [], f"{worker.batch}, claimed by a live worker not yet listing it, was sent again"
    assert again.in_flight == {b: ("running" if b == worker.batch else "queued") for b in names}
    assert waited_s < 5, f"enqueue waited {waited_s:.1f} s for the second look"
    assert in_broker == (len(names) - 1, 1)


def test_reconcile_on_an_idle_embedded_broker_says_no_worker_takes_the_batches_and_how_to_redo_them(small_run, tmp_path):
    """No HSX_BROKER_URL and no ``producer run`` holding this machine's embedded broker: reconcile still
    enqueues a lost batch there, and says that no worker takes it now and which command redoes it."""
    from jobfixtures import clean_env, run_here
    from hsx.layout import marker_key

    run_dir = copy_run(small_run, tmp_path)
    store = open_store(str(run_dir))
    env = clean_env(cache_dir=small_run["cache"], state_dir=tmp_path / "state")
    done = " ".join(run_here(["reconcile", str(run_dir)], env).stdout.split())  # every batch done: nobody is asked
    assert "(workers not looked at: no batch is left to run)" in done and "nothing to do" in done, done
    victim = json.loads(store.read("plan/batches.json"))[0]["batch"]
    store.delete(marker_key(victim))
    proc = run_here(["reconcile", str(run_dir)], env)
    said = " ".join(proc.stdout.split())
    assert proc.returncode == 0 and f"enqueued on this machine's embedded broker (no worker runs on it now, see below) {victim}" in said, said
    assert "no worker takes these now" in said and "`producer run` command again" in said, said
