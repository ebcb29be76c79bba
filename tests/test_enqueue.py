"""Idempotent enqueue on the embedded valkey broker: a batch queued already is not sent again, a
batch whose delivery a dead consumer left unacknowledged is (it is lost), and once that batch has
its marker, reconcile clears the stale delivery from kombu's claims (``UNACKED_KEY`` and its index).

The run is a copy of the shared small run (tests/smallrun.py) with its markers and shards removed:
a planned run with nothing done. The dead consumer is a real kombu consumer in a child process that
takes one message and is SIGKILLed before acknowledging it, as a worker killed mid-batch.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import embedded_broker
from smallrun import copy_run

from hsx.broker import redis_client
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


def test_a_second_enqueue_sends_only_what_is_lost_and_reconcile_clears_stale_deliveries(small_run, tmp_path, broker):
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

    third = enqueue_batches(planned, settings, broker.url)
    assert third.enqueued == [held], "the dead consumer's batch is lost: it must be sent again, and only it"
    assert third.in_flight == {b: "queued" for b in names if b != held}

    # the batch gets done (its real marker and shard from the original run), the dead delivery is now stale
    marker = json.loads((small_run["dir"] / "markers" / f"{held}.json").read_text())
    (run_dir / "shards").mkdir(exist_ok=True)
    shutil.copy(small_run["dir"] / marker["shard"]["key"], run_dir / marker["shard"]["key"])
    (run_dir / "markers").mkdir(exist_ok=True)
    shutil.copy(small_run["dir"] / "markers" / f"{held}.json", run_dir / "markers" / f"{held}.json")

    dry = reconcile_run(store, settings, broker.url, grace_s=None, dry_run=True)
    assert dry["cleared_claims"] == [held] and client.hlen(UNACKED_KEY) == 1, "a dry run changes nothing"
    report = reconcile_run(store, settings, broker.url, grace_s=None)
    assert report["cleared_claims"] == [held]
    assert client.hlen(UNACKED_KEY) == 0 and client.zcard(UNACKED_INDEX_KEY) == 0
    assert report["enqueued"] == [], "every other batch is still queued"


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
