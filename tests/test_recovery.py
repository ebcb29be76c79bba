"""Failure and recovery with real processes: the embedded valkey broker (AOF on), the real S3 server
of conftest.py, real ``celery -A workers worker`` processes, the tiny target and real ShareGPT
records. Each test injects one fault, recovers the way the README says, and ends with ``verify``
passing and every planned sample stored exactly once.

The worker's ``HSX_FAULTS`` setting (workers/faults.py) holds a batch at a chosen point long
enough to kill the process there; the test waits for the worker's log line that says so.
"""

from __future__ import annotations

import json
import time

import pytest

from clusters import HOLD_S, assert_complete, copy_plan, held_batch, shards_of, wait_done, wait_log
from jobfixtures import clean_env, run_cli, wait_until

from hsx.brokerlayout import UNACKED_KEY
from hsx.records import Marker, done_batches
from hsx.store import open_store


@pytest.mark.timeout(150)
def test_a_worker_killed_during_the_forward_loses_nothing_after_reconcile(template, cluster, tmp_path):
    """SIGKILL while a batch is in its forward: the others finish elsewhere; reconcile re-enqueues the orphaned one; verify passes."""
    run_store = copy_plan(template, str(tmp_path / "out"), cluster.settings)
    doomed = cluster.worker("doomed", wait=False, faults=f"pause_forward={HOLD_S}")
    cluster.worker("rescuer").wait_ready()
    doomed.wait_ready()
    cluster.enqueue_all(run_store)
    victim = held_batch(wait_log(doomed, "fault injection: pausing"))
    doomed.kill()
    total = len(template.batches)
    wait_until(lambda: len(done_batches(run_store)) == total - 1, 90, "every other batch to finish")
    time.sleep(1.0)
    assert victim not in done_batches(run_store)

    proc = run_cli("producer", ["reconcile", run_store.url, "--json"],
                   clean_env(broker_url=cluster.broker.url, cache_dir=cluster.cache), timeout_s=60)
    report = json.loads(proc.stdout) if proc.returncode == 0 else pytest.fail(proc.stderr[-2000:])
    assert report["orphaned_deliveries"] == [victim]
    assert report["enqueued"] == [victim] and "worker died" in report["lost"][0]["why"]
    wait_done(run_store)
    assert_complete(run_store)
    assert len(shards_of(run_store, victim)) == 1


@pytest.mark.timeout(150)
def test_a_worker_killed_in_the_middle_of_its_store_write_loses_nothing_and_leaves_nothing_visible(template, s3_cluster):
    """SIGKILL with the shard half sent to S3 (straight from host memory; no spool file on this path):
    no object of the batch is visible, reconcile redoes it, and every sample is stored once."""
    run_store = copy_plan(template, s3_cluster.s3.url, s3_cluster.settings)
    doomed = s3_cluster.worker("doomed", wait=False, faults=f"pause_store={HOLD_S}")
    doomed.wait_ready()
    s3_cluster.enqueue_all(run_store)
    victim = held_batch(wait_log(doomed, "fault injection: pausing"))
    assert "at store of batch" in doomed.log()
    spool = s3_cluster.tmp / "spool"
    assert not list(spool.glob("hsx-*")), "a shard the store takes at once never touches the spool"
    doomed.kill()
    assert not shards_of(run_store, victim), "a write cut short leaves no visible object"
    s3_cluster.worker("rescuer")
    total = len(template.batches)
    wait_until(lambda: len(done_batches(run_store)) == total - 1, 90, "every other batch to finish")
    report = s3_cluster.reconcile(run_store)
    assert report["enqueued"] == [victim], report
    wait_done(run_store)
    assert_complete(run_store)


@pytest.mark.timeout(150)
def test_the_broker_killed_and_restarted_mid_run_keeps_the_queue(template, cluster, tmp_path):
    """SIGKILL the embedded broker after a few batches, restart it from its AOF: the worker reconnects and the run completes."""
    run_store = copy_plan(template, str(tmp_path / "out"), cluster.settings)
    worker = cluster.worker("steady", faults="pause_forward=0.5")
    cluster.enqueue_all(run_store)
    wait_until(lambda: len(done_batches(run_store)) >= 2, 60, "two batches done")
    time.sleep(1.1)  # appendfsync everysec: the enqueue is on disk
    cluster.broker.kill()
    time.sleep(1.0)
    cluster.broker.start()
    assert worker.proc.poll() is None
    from hsx.broker import redis_client

    client = redis_client(cluster.broker.url)
    kept = client.llen("gpu") + client.hlen(UNACKED_KEY) + len(done_batches(run_store))
    assert kept >= len(template.batches), "the AOF kept every message not yet acknowledged"
    # Whatever the kill lost in flight (at most the batch being acknowledged) is found by reconcile.
    deadline = time.monotonic() + 90
    total = len(template.batches)
    while len(done_batches(run_store)) < total and time.monotonic() < deadline:
        time.sleep(2.0)
        if len(done_batches(run_store)) < total:
            cluster.reconcile(run_store)
    wait_done(run_store, 5)
    assert_complete(run_store)


@pytest.mark.timeout(240)
def test_a_stopped_s3_server_fills_the_overflow_then_pauses_extraction_and_the_run_completes_after_it_returns(
        template, s3_cluster, s3_server):
    """S3 stops: shards go to the spool (the overflow, at most HSX_MAX_PENDING_UPLOADS = 2), the next ones wait in
    their host buffers (2), and the next forward pauses, its status record saying why; S3 back: every batch done."""
    run_store = copy_plan(template, s3_cluster.s3.url, s3_cluster.settings)
    # Each batch waits 3 s before its store write, so the first two are past their forward (and every
    # thread has read its plan) when S3 stops.
    worker = s3_cluster.worker("patient", concurrency=5, worker_concurrency=2, spool_max_fraction=1, faults="pause_upload=3")
    s3_cluster.enqueue_all(run_store)
    wait_until(lambda: worker.log().count("fault injection: pausing") >= 2, 60, "two batches past their forward")
    s3_server.stop()
    try:
        spool = s3_cluster.tmp / "spool"
        wait_log(worker, "it goes to the overflow", 60)
        wait_until(lambda: len(list(spool.glob("hsx-*.safetensors"))) == 2, 60, "two shards in the spool")
        line = wait_log(worker, "paused before the forward", 90)
        assert "every host buffer (2, HSX_WORKER_CONCURRENCY)" in line and "2 shards waiting in the spool" in line, line
        time.sleep(1.0)
        assert len(list(spool.glob("hsx-*.safetensors"))) == 2, "the overflow never holds more than its limit"
    finally:
        s3_server.start()
    wait_done(run_store, 150)
    assert "resumed after" in worker.log()
    assert not list((s3_cluster.tmp / "spool").glob("hsx-*")), "every spool file is removed once stored"
    assert_complete(run_store)
    paths = {json.loads(run_store.read(k))["write_path"] for k in run_store.list("markers/")}
    assert "spool" in paths and paths <= {"spool", "memory", "direct"}, paths


@pytest.mark.timeout(150)
def test_the_same_task_delivered_twice_at_once_to_two_workers_leaves_one_marker(template, cluster, tmp_path):
    """Two messages for one batch, two worker processes holding it at once: one marker, one valid shard, the loser's shard removed."""
    run_store = copy_plan(template, str(tmp_path / "out"), cluster.settings)
    a = cluster.worker("twin-a", wait=False, faults="pause_forward=1.5")
    b = cluster.worker("twin-b", faults="pause_forward=1.5")
    a.wait_ready()
    twin = template.batches[0]
    cluster.enqueue(run_store, [twin, twin])
    wait_log(a, f"at forward of batch {twin.batch}")
    wait_log(b, f"at forward of batch {twin.batch}")
    wait_until(lambda: twin.batch in done_batches(run_store), 60, "the twin batch's marker")
    wait_until(lambda: "another worker wrote the marker first" in a.log() + b.log(), 30, "the loser to remove its shard")
    assert len(shards_of(run_store, twin.batch)) == 1
    cluster.reconcile(run_store)  # the rest of the run
    wait_done(run_store)
    assert_complete(run_store)


@pytest.mark.timeout(150)
def test_a_task_redelivered_after_its_visibility_timeout_leaves_one_marker(template, cluster, tmp_path):
    """Visibility timeout 3 s, a batch held 8 s before its upload: Redis redelivers it while the first delivery still
    runs (to the second worker, or to a free task thread of the first: each process has several); one marker, one
    valid shard."""
    run_store = copy_plan(template, str(tmp_path / "out"), cluster.settings)
    slow = cluster.worker("slow", faults="pause_upload=8", visibility_timeout_s=3)
    first = template.batches[0]
    cluster.enqueue(run_store, [first])
    wait_log(slow, f"at upload of batch {first.batch}")
    fast = cluster.worker("fast", visibility_timeout_s=3)
    wait_until(lambda: first.batch in done_batches(run_store), 40, "the redelivered batch's marker")
    received = [line for line in (slow.log() + fast.log()).splitlines()
                if "Task hsx.extract_batch[" in line and line.rstrip().endswith("received")]
    assert len(received) >= 2, f"the batch was delivered again while its first delivery ran: {received}"
    # A later delivery loses the marker race (its shard removed), starts after the marker exists, or is
    # skipped by Celery as already succeeded (worker_deduplicate_successful_tasks): none leaves a second shard.
    time.sleep(10)  # the first delivery's 8 s pause, so that every delivery has ended
    assert len(shards_of(run_store, first.batch)) == 1
    slow.kill()  # it would hold every later batch 8 s
    cluster.reconcile(run_store)
    wait_done(run_store)
    assert_complete(run_store)


@pytest.mark.timeout(150)
def test_a_shard_corrupted_after_its_marker_is_named_by_verify_and_redone_by_reconcile_repair(template, cluster, tmp_path):
    """Flip bytes of a certified shard: verify exits 1 naming the batch; reconcile --repair redoes it; verify passes."""
    run_store = copy_plan(template, str(tmp_path / "out"), cluster.settings)
    cluster.worker("repairer")
    cluster.enqueue_all(run_store)
    wait_done(run_store)
    victim = sorted(done_batches(run_store))[1]
    key = Marker.read(run_store, victim).shard.key
    path = run_store.local_path(key)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))

    env = clean_env(broker_url=cluster.broker.url, cache_dir=cluster.cache)
    proc = run_cli("producer", ["verify", run_store.url], env, timeout_s=60)
    assert proc.returncode == 1 and victim in proc.stdout and "shard_altered" in proc.stdout, proc.stdout[-2000:]
    proc = run_cli("producer", ["reconcile", run_store.url, "--repair"], env, timeout_s=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"repaired {victim}: shard_altered" in proc.stdout and f"enqueued {victim}" in proc.stdout, proc.stdout
    wait_done(run_store)
    assert Marker.read(run_store, victim).shard.key != key
    assert_complete(run_store)


@pytest.mark.timeout(120)
def test_run_redoes_a_batch_that_failed_by_itself_before_it_finishes(tiny_cache, tmp_path):
    """producer run with the first shard write failing (ENOSPC): the worker pauses with the shard in hand and writes
    it again once the disk has room (tests/test_fleet_worker.py), exit 0, verify passes, nothing to reconcile."""
    env = clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state", spool_dir=tmp_path / "spool", faults="store_full=1")
    proc = run_cli("producer", ["run", "sharegpt", "--model", "tiny-qwen3.5", "--limit", "8", "--max-length", "192",
                                "--batch-tokens", "512", "--output", str(tmp_path / "out"), "--json"], env, timeout_s=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["batches_done"] == report["batches_total"] and not report["failed"]
    assert report["reconciled"] == {}, "the write waited for room: nothing to reconcile"
    assert_complete(open_store(report["address"]))
