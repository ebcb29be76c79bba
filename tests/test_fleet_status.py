"""What the producer shows and does about the fleet (issue 19, items 1, 2, 4, 8), with real
processes: the embedded valkey broker, real ``celery -A workers worker`` processes and a real
``producer run``; a real full filesystem (a tmpfs) for the full store.

- ``enqueue`` refuses an ``--output`` no live worker serves, naming it, the roots and the fix;
  ``--force`` sends anyway and the messages park; ``status RUN`` shows them as ``parked: N
  batches: <reason>`` with the fix; ``status`` without a run shows the workers and the parked
  messages; ``reconcile`` puts them back; a worker that serves the root completes the run.
- ``producer run`` on a full store says the pause (path and free space) and its end; while it
  lasts ``status`` shows the worker ``paused: store full at ...`` from its presence on the broker
  (the store takes no status record), and so does the fleet view.
- :class:`producer.run.PauseWatch` says a pause once, then once a minute, then its end.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from deadclaims import age_claims, take_and_die
from clusters import assert_complete, copy_plan, wait_done
from jobfixtures import clean_env, python_popen, run_here, wait_until

from hsx.broker import redis_client
from hsx.fleet import HeldTask, Presence, read_parked, write_presence
from hsx.records import done_batches
from hsx.store import open_store
from settings import Settings

#: the ``template`` fixture's plan as a command line: the same run id, so the plan is reused
JOB = ["sharegpt", "--model", "tiny-qwen3.5", "--limit", "12", "--max-length", "192", "--batch-tokens", "512"]
FAST = dict(task_retry_base_s=0.3, task_retry_max_s=1, lease_s=30, reclaim_interval_s=1)


def _said(proc) -> str:
    return " ".join((proc.stdout + proc.stderr).split())


@pytest.mark.timeout(240)
def test_enqueue_outside_the_served_roots_is_refused_forced_messages_park_status_shows_them_and_reconcile_puts_them_back(
        template, cluster, tmp_path):
    """A worker serves ``out``. ``enqueue --output other``: refused (exit 2) before anything is planned, naming the
    output, the served root and the fixes. With ``--force``: sent, and every message parked by the worker.
    ``status RUN`` says ``parked: N batches: NotServed...`` with the fix and calls the run stalled; ``status``
    with no run lists the worker (roots, model, state) and the run's parked batches; ``reconcile`` puts them back
    (the worker parks them again); a worker that serves ``other`` completes the run exactly once."""
    cluster.worker("w0", **FAST)
    other = tmp_path / "other"
    env = clean_env(broker_url=cluster.broker.url, cache_dir=cluster.cache, state_dir=tmp_path / "state", heartbeat_s=1)
    client = redis_client(cluster.broker.url)

    refused = run_here(["enqueue", *JOB, "--output", str(other)], env)
    said = _said(refused)
    assert refused.returncode == 2, said
    for needed in (f"--output {other}", "outside every store root served by the 1 live worker on this broker",
                   str(tmp_path / "out"), "HSX_ALLOWED_STORES", "--force", "Nothing was planned or sent"):
        assert needed in said, f"{needed!r} not in: {said}"
    assert not other.exists(), "a refused enqueue plans nothing"

    forced = run_here(["enqueue", *JOB, "--output", str(other), "--force", "--json"], env)
    assert forced.returncode == 0, _said(forced)
    assert "warning: --force" in forced.stderr
    report = json.loads(forced.stdout)
    run_store = open_store(report["address"])
    names = sorted(b["batch"] for b in json.loads(run_store.read("plan/batches.json")))
    assert report["batches_enqueued"] == len(names)
    wait_until(lambda: len(read_parked(client, "gpu", run_store.url)) == len(names), 60, "every message parked")

    def status_json() -> dict:
        return json.loads(run_here(["status", report["address"], "--json"], env).stdout)

    # right after the last message is parked, status may still see the worker busy with it (seen once in a
    # whole-suite run: "running" there): the run is called stalled once the worker's record has caught up
    status = wait_until(lambda: (lambda s: s if s["state"] == "stalled" else None)(status_json()), 30,
                        "status to call the run stalled")
    assert status["batches_parked"] == len(names), status["parked"]
    (group,) = status["parked"]
    assert group["reason"].startswith("NotServed: ") and sorted(group["batches"]) == names, group
    (refuser,) = group["refused_by"]  # named as every view names a worker
    assert refuser.startswith("w0@") and " pid " in refuser, group["refused_by"]
    for needed in (f"start a worker that serves {other}", f"python -m producer reconcile {run_store.url}",
                   f"python -m producer cancel {run_store.url}"):
        assert needed in group["fix"], group["fix"]
    assert status["state"] == "stalled" and f"parked: {len(names)} batches: NotServed" in status["stalled_reason"]
    view = _said(run_here(["status", report["address"]], env))
    assert f"parked {len(names)} batches: NotServed" in view and f"start a worker that serves {other}" in view, view

    fleet = json.loads(run_here(["status", "--json"], env).stdout)
    (worker,) = [w for w in fleet["workers"] if w["live"]]
    assert worker["roots"] == [str(tmp_path / "out")] and worker["model"] == "tiny-qwen3.5", worker
    assert worker["state"] == "idle" and worker["node"].startswith("w0@"), worker
    (parked,) = fleet["parked"]
    assert parked["run_url"] == run_store.url and parked["batches"] == len(names)
    assert parked["groups"][0]["refused_by"] == [worker["label"]], parked
    assert any(r["address"] == run_store.url and r["parked"] == len(names) for r in fleet["runs"]), fleet["runs"]
    fleet_view = _said(run_here(["status"], env))
    assert "w0@" in fleet_view and f"parked: {run_store.url}" in fleet_view and "NotServed" in fleet_view, fleet_view

    rec = run_here(["reconcile", report["address"], "--json"], env)
    back = json.loads(rec.stdout)
    assert sorted(back["unparked"]) == names and back["enqueued"] == [] and back["lost"] == [], back
    wait_until(lambda: sorted(p.batch for p in read_parked(client, "gpu", run_store.url)) == names, 60,
               "the worker that does not serve them to park them again")

    cluster.worker("w1", allowed_stores=str(other), **FAST)
    run_here(["reconcile", report["address"]], env)  # or the new worker takes them back by itself
    wait_done(run_store, 150)
    assert_complete(run_store)
    assert read_parked(client, "gpu", run_store.url) == [] or all(
        p.batch in done_batches(run_store) for p in read_parked(client, "gpu", run_store.url))


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


@pytest.mark.timeout(300)
def test_producer_run_says_a_full_store_pause_and_status_shows_it_from_the_broker(template, tmp_path, tiny_cache):
    """``producer run`` into a full filesystem (a filled tmpfs; the plan copied in first): its worker pauses with
    the batch in hand; ``run`` prints ``paused: store full at <path> (<free> MiB free)``; ``status RUN`` and the
    fleet view show the worker ``paused: store full at ...`` from its presence (the store takes no record); once
    space returns ``run`` prints ``resumed`` and the run completes exactly once."""
    root = tmp_path / "full"
    if not _mount_tmpfs(root, "16m"):
        pytest.skip("cannot mount a tmpfs here (not root, or no mount): no real full filesystem to test on")
    proc = None
    try:
        run_store = copy_plan(template, str(root), Settings(_env_file=None, cache_dir=tiny_cache))
        filler = root / "filler.bin"
        with open(filler, "wb") as f:
            f.write(b"\0" * max(0, shutil.disk_usage(root).free - 48 * 1024))
        env = clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state", spool_dir=tmp_path / "spool", heartbeat_s=1)
        err = tmp_path / "run.stderr"
        with open(err, "w") as stderr:  # forked from the fork server (its launcher and worker too)
            proc = python_popen(["-m", "producer", "run", *JOB, "--output", str(root), "--json"],
                                {**env, "COLUMNS": "400"}, stdout=subprocess.PIPE, stderr=stderr)

        def said() -> str:
            assert proc.poll() is None, err.read_text()[-3000:]
            return " ".join(err.read_text(errors="replace").split())

        wait_until(lambda: f"paused: store full at {root}" in said(), 180, "run to say the pause")
        line = said()
        assert "MiB free" in line and "hold their batches and go on by themselves when there is room" in line, line

        status = json.loads(run_here(["status", run_store.url, "--json"], env).stdout)
        paused = [r for r in status["workers"] if r["state"] == "paused"]
        assert paused and paused[0]["paused"].startswith(f"store full at {root}") and paused[0]["online"], status["workers"]
        assert "presence" in paused[0]["sources"], paused[0]
        view = _said(run_here(["status", run_store.url], env))
        assert f"paused: store full at {root}" in view, view
        fleet = json.loads(run_here(["status", "--json"], env).stdout)
        assert any(w["state"] == "paused" and w["paused_reason"].startswith("store full at") for w in fleet["workers"])

        filler.unlink()
        stdout, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, err.read_text()[-3000:]
        assert "resumed: the store has room again" in err.read_text(), err.read_text()[-3000:]
        report = json.loads(stdout)
        assert report["batches_done"] == report["batches_total"] and not report["failed"]
        assert_complete(run_store)
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        subprocess.run(["umount", "-l", str(root)], capture_output=True)


def test_the_pause_is_said_once_then_once_a_minute_then_its_end(cluster, tmp_path):
    """Presences on a real broker, stamped by its clock; :class:`PauseWatch` on a clock of the test's: the first
    look says the pause, a look 30 s on says nothing, 61 s on says it still lasts, and a look after the presence
    says ``working`` again says it ended. A pause of a worker that serves another root is not this run's."""
    from producer.run import PauseWatch

    client = redis_client(cluster.broker.url)
    run_url = open_store(str(tmp_path / "out")).child("r1").url
    reason = f"store full at {tmp_path / 'out'} (0 MiB free)"
    mine = Presence(worker="nodeA-1", host="nodeA", pid=1, node="gpu0@nodeA", roots=[str(tmp_path / "out")],
                    state="paused", paused_reason=reason, tasks=[HeldTask(task_id="t1", run_url=run_url, batch="b000001",
                                                                         phase="paused")])
    theirs = Presence(worker="nodeB-2", host="nodeB", pid=2, roots=[str(tmp_path / "elsewhere")], state="paused",
                      paused_reason=f"store full at {tmp_path / 'elsewhere'} (1 MiB free)")
    write_presence(client, "gpu", theirs)
    lines: list[str] = []
    clock = [1000.0]
    watch = PauseWatch(cluster.settings, cluster.broker.url, run_url, lines.append, clock=lambda: clock[0])
    watch.check()
    assert lines == [], "another root's pause is not this run's"
    write_presence(client, "gpu", mine)
    for at in (1006.0, 1036.0, 1067.0, 1080.0):
        clock[0] = at
        watch.check()
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"paused: {reason}: 1 worker (gpu0@nodeA)"), lines[0]
    assert lines[1].startswith("still paused after 1m01s: ") and reason in lines[1], lines[1]
    write_presence(client, "gpu", mine.model_copy(update={"state": "working", "paused_reason": None}))
    clock[0] = 1090.0
    watch.check()
    assert lines[2] == "resumed: the store has room again, after 1m24s paused", lines
    assert watch.pauses == 1


def test_a_worker_loading_its_target_is_shown_loading_and_the_run_is_not_called_stalled(cluster, template, tmp_path):
    """A first GPU worker compiles its kernels for minutes before it takes a batch (134 s from start to
    ready for a 27B on an H100, BENCHMARKS.md). Its presence says ``loading`` from when; ``status`` of a
    run it serves shows its row ``loading the target (...)`` and the run ``running``, not ``stalled``
    with an idle worker and reconcile advice; once loaded it says ``idle`` and takes the batches. A real
    worker, held in its load by ``HSX_FAULTS=pause_load``. A load past ``LOADING_STALL_S`` is a stall."""
    from hsx.fleet import read_presences
    from producer.status import LOADING_STALL_S

    from clusters import wait_log

    run_store = copy_plan(template, str(tmp_path / "out"), cluster.settings)
    worker = cluster.worker("cpu0", wait=False, faults="pause_load=6")
    wait_log(worker, "fault injection: pausing 6 s while it loads its model", 90)
    client = redis_client(cluster.broker.url)
    (presence,) = wait_until(lambda: [p for p in read_presences(client, cluster.settings.queue)
                                      if p.pid == worker.proc.pid and p.state == "loading"] or None, 10, "a loading presence")
    assert presence.loading_since is not None
    env = cluster.env() | {"COLUMNS": "200"}
    status = json.loads(run_here(["status", run_store.url, "--json"], env).stdout)
    assert status["state"] == "running" and status["stalled_reason"] is None, status
    (row,) = status["workers"]
    assert row["state"] == "loading" and 0 <= row["loading_s"] < 60, row
    assert "loading the target (" in run_here(["status", run_store.url], env).stdout
    assert "loading the target (for " in run_here(["status"], env).stdout  # the fleet view

    worker.wait_ready()
    wait_until(lambda: [p for p in read_presences(client, cluster.settings.queue)
                        if p.pid == worker.proc.pid and p.state == "idle" and p.loading_since is None] or None, 30,
               "the presence idle once loaded")
    # another node's worker that has said `loading` for over LOADING_STALL_S (its presence, as it would write it)
    stuck_worker = presence.model_copy(update={"worker": "nodeB-9", "host": "nodeB", "pid": 9, "node": "gpu0@nodeB",
                                               "loading_since": presence.loading_since - LOADING_STALL_S - 60})
    write_presence(client, cluster.settings.queue, stuck_worker)
    stuck = json.loads(run_here(["status", run_store.url, "--json"], env).stdout)
    assert stuck["state"] == "stalled" and "1 still loading the target after 31 min (stuck? see the worker's log)" in \
        stuck["stalled_reason"], stuck["stalled_reason"]
    cluster.enqueue_all(run_store)
    wait_done(run_store)


# --- what a new user's multi-node run with faults showed in the fleet view ---------------------------

def test_the_fleet_view_of_a_broker_that_does_not_answer_says_so_and_exits_2():
    """A new user's ``status`` (no run) with the broker down ended in a redis traceback, exit 1. It says the broker
    does not answer, with the URL (password masked), the error and what to check, and exits 2 as the CLI's other
    errors do; ``--json`` the same."""
    from jobfixtures import free_port

    url = f"redis://:fleet-secret@127.0.0.1:{free_port()}/0"
    for args in (["status"], ["status", "--json"]):
        proc = run_here(args, clean_env(broker_url=url))
        said = _said(proc)
        assert proc.returncode == 2, said
        for needed in (f"broker redis://:***@{url.split('@')[1]} does not answer (ConnectionError:",
                       "HSX_BROKER_URL names its host, port and password"):
            assert needed in said, f"{needed!r} not in: {said}"
        assert "fleet-secret" not in said and "Traceback" not in said, said


def test_the_fleet_view_says_which_claims_no_live_worker_holds_and_lists_no_dead_workers_tasks_as_current(
        client, broker, tmp_path):
    """Claims whose acks were lost (a consumer died holding them: listed by no presence), one of them listed by a
    lost worker (its presence stamped 30 s ago, its lease running); a stopped worker that listed a batch; a live
    idle worker. The fleet (JSON and view) says how many claims no live worker holds, per run and in all, what
    returns each kind (the lost worker's lease, in about how long; a live worker's lease check; the visibility
    timeout, at what time) instead of a bare count; the stopped worker holds no tasks (``held_at_death``, shown
    as when it died and no longer claimed); every worker is named by its Celery node and pid."""
    from hsx.fleet import broker_time, workers_key
    from hsx.queue import send_batches
    from hsx.records import BatchSummary

    settings = Settings(_env_file=None, broker_url=broker.url, queue="gpu")
    run_url = "file:///data/out/sharegpt-0123456789ab"
    send_batches(settings, broker.url, run_url, "sharegpt-0123456789ab",
                 [BatchSummary(batch=b, num_samples=1, num_tokens=8) for b in ("b000001", "b000002")])
    take_and_die(broker.url, "gpu", 2)
    age_claims(broker.url, 60)  # acks lost a minute ago, not a fresh delivery its worker lists in a second
    now = broker_time(client)

    def put(p: Presence, age_s: float) -> None:
        client.hset(workers_key("gpu"), p.worker, p.model_copy(update={"stamp": now - age_s, "started": now - 900})
                    .model_dump_json())

    put(Presence(worker="nodeA-1", host="nodeA", pid=1, node="cpu0@nodeA", roots=["/data/out"]), 1)
    put(Presence(worker="nodeL-6", host="nodeL", pid=6, node="cpu0@nodeL", roots=["/data/out"], state="working",
                 tasks=[HeldTask(task_id="", run_url=run_url, batch="b000002", phase="forward")]), 150)
    put(Presence(worker="nodeS-5", host="nodeS", pid=5, node="cpu0@nodeS", roots=["/data/out"], state="stopped",
                 tasks=[HeldTask(task_id="gone-task", run_url=run_url, batch="b000052", phase="forward")]), 600)
    env = clean_env(broker_url=broker.url) | {"COLUMNS": "200"}

    fleet = json.loads(run_here(["status", "--json"], env).stdout)
    nh = fleet["broker"]["not_held"]
    assert fleet["broker"]["queue"]["claimed"] == nh["count"] == 2 and nh["unlisted"] == 1, nh
    (lost,) = nh["lost_workers"]
    assert lost["label"] == "cpu0@nodeL pid 6" and lost["claims"] == 1 and -35 < lost["back_in_s"] < 5, lost
    assert nh["visibility_at"].endswith("Z"), nh
    (run,) = [r for r in fleet["runs"] if r["address"] == run_url]
    assert run["not_held"] == 2 and run["held"] == 0, run
    rows = {w["worker"]: w for w in fleet["workers"]}
    assert rows["nodeS-5"]["tasks"] == [] and rows["nodeS-5"]["held_at_death"][0]["batch"] == "b000052", rows["nodeS-5"]
    assert rows["nodeS-5"]["held_at_death"][0]["still_claimed"] is False
    assert rows["nodeA-1"]["label"] == "cpu0@nodeA pid 1" and rows["nodeA-1"]["live"], rows["nodeA-1"]

    view = _said(run_here(["status"], env))
    for said in ("'gpu': 0 waiting, 2 claimed", "2 claimed by no live worker: 1 of lost worker cpu0@nodeL pid 6: a "
                 "live worker puts them back when its lease (HSX_LEASE_S) ends", "1 listed by no worker",
                 f"returns them to the queue at {nh['visibility_at'][:13]}", "cpu0@nodeA pid 1", "cpu0@nodeS pid 5",
                 "when it died:", "b000052 (forward, put back or done since)", "b000002 (forward, still claimed)"):
        assert said in view, f"{said!r} not in the view: {view}"
    assert "b000052 (forward) " not in view + " ", "a dead worker's batch is not shown as one it holds"


@pytest.mark.timeout(180)
def test_a_run_enqueued_on_a_queue_no_worker_serves_is_queued_with_the_start_command_not_served(template, cluster,
                                                                                                tmp_path):
    """A live worker on the broker serves queue ``gpu`` and ``out``; a run enqueued on queue ``idleq`` into
    ``other``: every worker answers inspect, but this one neither serves the run nor runs a batch of it, so
    status says ``queued`` with the command that starts a worker for it, never "live workers serve the run"."""
    cluster.worker("w0", **FAST)
    other = tmp_path / "other"
    env = clean_env(broker_url=cluster.broker.url, cache_dir=cluster.cache, state_dir=tmp_path / "state",
                    heartbeat_s=1, queue="idleq", store_url=str(other))
    report = json.loads(run_here(["enqueue", *JOB, "--output", str(other), "--json"], env).stdout)
    wait_until(lambda: any(w["live"] for w in json.loads(run_here(["status", "--json"], clean_env(
        broker_url=cluster.broker.url, cache_dir=cluster.cache)).stdout)["workers"]), 60, "the worker's presence")
    status = json.loads(run_here(["status", report["address"], "--json"], env).stdout)
    assert status["state"] == "queued", (status["state"], status["stalled_reason"], status["workers"])
    assert status["workers"] == [], status["workers"]
    assert "start no other" not in (status["restart"] or "") and "python -m workers" in status["restart"], \
        status["restart"]
