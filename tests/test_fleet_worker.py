"""No single message, run or disk stops a worker from serving the others (issue 19), through the real
worker path: the embedded valkey broker, real ``celery -A workers worker`` processes, the tiny
target, real ShareGPT records; a real full filesystem (a tmpfs) for the full store.

Each scenario puts the bad thing at the head of the queue, then a good run behind it: the good run
must finish with no command typed, and what the bad message left is checked (parked with its
reason, acknowledged with one line, failed with its record, or paused and resumed).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load, save

from clusters import assert_complete, copy_plan, wait_done, wait_log
from jobfixtures import wait_until

from hsx.broker import redis_client
from hsx.brokerlayout import UNACKED_KEY, waiting
from hsx.fleet import live_presences, read_parked
from hsx.plan import read_batch_list
from hsx.queue import send_batches
from hsx.records import done_batches
from hsx.runconfig import load_run

FAST = dict(task_retry_base_s=0.3, task_retry_max_s=1, lease_s=30, reclaim_interval_s=1)


def _send_all(cluster, run_store) -> list[str]:
    """Enqueue every batch of the run the way producer enqueue does; returns the batch names."""
    batches = read_batch_list(run_store)
    send_batches(cluster.settings, cluster.broker.url, run_store.url, load_run(run_store).run_id, batches)
    return [b.batch for b in batches]


def _worker_name(cluster, worker) -> str:
    presences = live_presences(redis_client(cluster.broker.url), "gpu", 60)
    return next(p.worker for p in presences if p.pid == worker.proc.pid)


def _queue_drained(cluster) -> bool:
    client = redis_client(cluster.broker.url)
    return waiting(client, "gpu") == 0 and client.hlen(UNACKED_KEY) == 0


@pytest.mark.timeout(150)
def test_messages_for_a_root_no_worker_serves_are_parked_and_the_good_run_behind_them_finishes(template, cluster,
                                                                                            tmp_path):
    """A whole run enqueued into a root the worker does not serve, ahead of a good run: each of its messages is
    parked once (reason naming the roots and the fix, the worker named), nothing is read or written there, and
    the good run completes; the queue and the claims end empty."""
    stray = copy_plan(template, str(tmp_path / "other"), cluster.settings)
    good = copy_plan(template, str(tmp_path / "out"), cluster.settings)
    stray_batches = _send_all(cluster, stray)
    _send_all(cluster, good)
    worker = cluster.worker("w0", **FAST)
    wait_done(good, 120)
    assert_complete(good)
    wait_until(lambda: _queue_drained(cluster), 20, "the queue and the claims to drain")
    parked = read_parked(redis_client(cluster.broker.url), "gpu", stray.url)
    assert sorted(p.batch for p in parked) == sorted(stray_batches)
    me = _worker_name(cluster, worker)
    for p in parked:
        assert p.refused_by == [me] and p.cause == "not_served" and p.times == 1, p
        assert "HSX_ALLOWED_STORES" in p.reason and str(tmp_path / "out") in p.reason, p.reason
    assert not stray.list("workers/") and not stray.list("failures/") and not stray.list("markers/")
    assert "refuses tasks" not in worker.log()


@pytest.mark.timeout(150)
def test_a_deleted_run_s_messages_are_acknowledged_with_one_line_and_the_next_run_finishes(template, cluster, tmp_path):
    """Run A enqueued, its directory deleted, run B enqueued behind it: B completes; A's messages are acknowledged
    with one ERROR line naming A (not one per message), and nothing is created where A was."""
    a = copy_plan(template, str(tmp_path / "out" / "a"), cluster.settings)
    b = copy_plan(template, str(tmp_path / "out" / "b"), cluster.settings)
    _send_all(cluster, a)
    run_dir = Path(a.local_path("run.json")).parent
    shutil.rmtree(run_dir)
    _send_all(cluster, b)
    worker = cluster.worker("w0", **FAST)
    wait_done(b, 120)
    assert_complete(b)
    wait_until(lambda: _queue_drained(cluster), 20, "the queue and the claims to drain")
    lines = [ln for ln in worker.log().splitlines() if str(run_dir) in ln and "ERROR" in ln]
    assert len(lines) == 1 and "does not exist" in lines[0], lines
    assert not run_dir.exists(), "a message of a deleted run created its directory again"


@pytest.mark.timeout(150)
def test_a_batch_with_a_damaged_plan_file_is_tried_three_times_then_failed_and_the_rest_of_the_run_finishes(
        template, cluster, tmp_path):
    """The plan file of one batch damaged after planning (``cu_seqlens`` no longer ends at the token count): three
    attempts, then ``failures/<batch>.json`` with the reason; every other batch gets its marker, and the worker
    goes on serving (it still takes a second run after it)."""
    run_store = copy_plan(template, str(tmp_path / "out" / "a"), cluster.settings)
    victim = "b000001"
    path = run_store.local_path(f"plan/batches/{victim}.safetensors")
    tensors = load(path.read_bytes())
    cu = tensors["cu_seqlens"].copy()
    cu[-1] += 7
    path.write_bytes(save({**tensors, "cu_seqlens": cu.astype(np.int64)}, metadata={"batch": victim}))
    batches = _send_all(cluster, run_store)
    worker = cluster.worker("w0", **FAST)
    wait_until(lambda: run_store.list("failures/"), 90, "the damaged batch's failure record")
    failure = json.loads(run_store.read(f"failures/{victim}.json"))
    assert failure["error"].startswith("BadPlan: plan of batch b000001: cu_seqlens"), failure
    wait_until(lambda: done_batches(run_store) == set(batches) - {victim}, 90, "every other batch's marker")
    attempts = [ln for ln in worker.log().splitlines() if f"batch {victim}: data error, retrying" in ln]
    assert len(attempts) == 2, attempts
    assert f"batch {victim} failed 3 times (data error)" in worker.log()
    second = copy_plan(template, str(tmp_path / "out" / "b"), cluster.settings)
    _send_all(cluster, second)
    wait_done(second, 90)
    assert_complete(second)


@pytest.mark.timeout(150)
def test_hand_sent_messages_that_name_no_planned_batch_are_dropped_without_writing_anything(template, cluster, tmp_path):
    """An unplanned batch of a real run, a batch that is not a string, and a run that does not exist under the
    worker's root: each is dropped with an ERROR line; no ``failures/`` or ``workers/`` record is written for
    them, no directory is created, and a good run behind them finishes."""
    good = copy_plan(template, str(tmp_path / "out"), cluster.settings)
    ghost = tmp_path / "out" / "never-planned"
    app_settings = cluster.settings
    from hsx.queue import EXTRACT_TASK, make_celery

    app = make_celery(app_settings, cluster.broker.url, name="hand")
    try:
        app.send_task(EXTRACT_TASK, args=[good.url, "b999999"], queue="gpu")
        app.send_task(EXTRACT_TASK, args=[good.url, 12], queue="gpu")
        app.send_task(EXTRACT_TASK, args=[str(ghost), "b000000"], queue="gpu")
    finally:
        app.close()
    _send_all(cluster, good)
    worker = cluster.worker("w0", **FAST)
    wait_done(good, 120)
    assert_complete(good)
    wait_until(lambda: _queue_drained(cluster), 20, "the queue and the claims to drain")
    log = worker.log()
    assert "batch 'b999999'" in log and "no such batch" in log, log[-3000:]
    assert "batch '12' refused" in log or "task batch '12'" in log, log[-3000:]
    assert str(ghost) in log
    assert not good.list("failures/")
    assert not ghost.exists()


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        return False
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return proc.returncode == 0


@pytest.mark.timeout(180)
def test_a_full_store_pauses_the_worker_with_its_batch_in_hand_and_it_resumes_when_space_returns(template, cluster,
                                                                                              tmp_path):
    """The run on a real filesystem that is full (a small tmpfs, filled): the worker pauses before its forward,
    says ``paused: store full at <path> (... free)`` in its presence on the broker (the store cannot take a status
    record), burns no retries and records no failure; when the filler is removed the run completes exactly once,
    with one forward per batch."""
    root = tmp_path / "full"
    if not _mount_tmpfs(root, "16m"):
        pytest.skip("cannot mount a tmpfs here (not root, or no mount): no real full filesystem to test on")
    try:
        run_store = copy_plan(template, str(root), cluster.settings)
        filler = root / "filler.bin"
        free = shutil.disk_usage(root).free
        with open(filler, "wb") as f:
            f.write(b"\0" * max(0, free - 48 * 1024))
        batches = _send_all(cluster, run_store)
        worker = cluster.worker("w0", allowed_stores=str(root), **FAST)
        client = redis_client(cluster.broker.url)

        def paused():
            return next((p for p in live_presences(client, "gpu", 60)
                         if p.pid == worker.proc.pid and p.state == "paused"), None)

        presence = wait_until(paused, 60, "the worker's presence to say paused")
        assert presence.paused_reason.startswith(f"store full at {root}") and "MiB free" in presence.paused_reason, \
            presence.paused_reason
        assert presence.tasks and presence.tasks[0].phase == "paused"
        time.sleep(4)  # a while paused: nothing is burned meanwhile
        log = worker.log()
        assert "retrying through the queue" not in log and not run_store.list("failures/")
        assert log.count("this worker pauses until there is room") == 1, log[-3000:]
        filler.unlink()
        wait_done(run_store, 120)
        assert_complete(run_store)
        wait_until(lambda: worker.log().count("batch done") >= len(batches), 10, "the last batch's log line")
        log = worker.log()
        assert log.count("batch done") == len(batches), "a batch ran its forward more than once"
        assert "the store has room again; resumed after" in log
        wait_until(lambda: next(p for p in live_presences(client, "gpu", 60) if p.pid == worker.proc.pid).state == "idle",
                   20, "the presence to say idle again")
        wait_until(lambda: next(p for p in live_presences(client, "gpu", 60) if p.pid == worker.proc.pid).tasks == [],
                   10, "the presence to hold no task once every delivery is acknowledged")
    finally:
        for w in cluster.workers:
            w.kill()
        subprocess.run(["umount", "-l", str(root)], capture_output=True)


@pytest.mark.timeout(150)
def test_a_write_that_meets_a_full_disk_waits_and_is_written_from_the_host_buffer(template, cluster, tmp_path):
    """ENOSPC on the first shard write (``HSX_FAULTS=store_full=1``) while the filesystem itself has room again: the
    shard is written again from the host buffer after the pause, not retried through the queue; no failure."""
    run_store = copy_plan(template, str(tmp_path / "out"), cluster.settings)
    batches = _send_all(cluster, run_store)
    worker = cluster.worker("cramped", faults="store_full=1", **FAST)
    wait_done(run_store, 120)
    line = wait_log(worker, "this worker pauses until there is room")
    assert "store full at" in line and str(tmp_path / "out") in line, line
    # the marker is written before the "batch done" line: the last line may come a moment after wait_done
    wait_until(lambda: worker.log().count("batch done") >= len(batches), 10, "the last batch's log line")
    log = worker.log()
    assert "retrying through the queue" not in log and not run_store.list("failures/")
    assert log.count("batch done") == len(batches)
    assert_complete(run_store)
