"""``producer cancel`` (issue 19, item 5) with real processes: the embedded valkey broker, real
``celery -A workers worker`` processes and a real ``producer run``; the tiny target on real
ShareGPT records.

A cancelled run loses its queued and parked messages (another run's stay), ``status`` says
``cancelled`` with the command that resumes it, and the same ``enqueue`` / ``run`` command resumes
it to a complete, exactly-once run. ``--now`` stops the batches running, before their marker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from clusters import assert_complete, copy_plan, held_batch, shards_of, wait_done
from jobfixtures import clean_env, python_popen, run_here, wait_until

from hsx.broker import redis_client, running_embedded_broker
from hsx.brokerlayout import queued_of
from hsx.fleet import Parked, park, read_parked, read_presences, runs_key
from hsx.plan import read_batch_list
from hsx.queue import send_batches
from hsx.records import Cancelled, done_batches
from hsx.runconfig import load_run
from hsx.store import open_store

#: the ``template`` fixture's plan as a command line: the same run id, so the plan is reused
JOB = ["sharegpt", "--model", "tiny-qwen3.5", "--limit", "12", "--max-length", "192", "--batch-tokens", "512"]


def _said(proc) -> str:
    return " ".join((proc.stdout + proc.stderr).split())


@pytest.mark.timeout(180)
def test_cancel_removes_the_runs_queued_and_parked_messages_and_the_same_enqueue_resumes_it(template, cluster,
                                                                                           tmp_path):
    """Enqueued with no worker up (``enqueue`` says none is live yet), one batch parked: ``cancel`` removes every
    queued message of the run and its parked entry, leaves another run's message, writes ``cancelled.json``
    (by user@host); ``status`` says cancelled and how to resume; the same ``enqueue`` removes the record,
    enqueues every batch and a worker completes the run exactly once."""
    out = tmp_path / "out"
    run_store = copy_plan(template, str(out), cluster.settings)
    other = copy_plan(template, str(tmp_path / "other"), cluster.settings)
    batches = read_batch_list(run_store)
    names = sorted(b.batch for b in batches)
    client = redis_client(cluster.broker.url)
    send_batches(cluster.settings, cluster.broker.url, other.url, load_run(other).run_id, batches[:1])
    env = clean_env(broker_url=cluster.broker.url, cache_dir=cluster.cache, state_dir=tmp_path / "state")

    first = run_here(["enqueue", *JOB, "--output", str(out), "--json"], env)
    assert first.returncode == 0, _said(first)
    assert json.loads(first.stdout)["run_id"] == load_run(run_store).run_id
    assert json.loads(first.stdout)["batches_enqueued"] == len(names), first.stdout
    assert "no live worker on this broker yet" in _said(first), _said(first)
    park(client, "gpu", Parked(run_url=run_store.url, batch=names[0], reason="NotServed: a test's parked entry",
                               refused_by=["elsewhere-1"]))

    text = run_here(["cancel", str(out / load_run(run_store).run_id)], env)
    said = _said(text)
    assert text.returncode == 0, said
    assert f"{len(names)} queued messages removed" in said and "1 parked message removed" in said, said
    assert "To resume: run the same `python -m producer run` / `enqueue` command again" in said, said
    assert run_store.url not in queued_of(client, "gpu") and queued_of(client, "gpu") == {other.url: {names[0]: 1}}
    assert read_parked(client, "gpu", run_store.url) == []
    assert run_store.url.encode() not in client.smembers(runs_key("gpu")), "the healer must leave a cancelled run alone"
    record = Cancelled.read(run_store)
    assert record is not None and "@" in record.by and record.at and record.now is False
    again = json.loads(run_here(["cancel", run_store.url, "--json"], env).stdout)
    assert again["removed_queued"] == 0 and again["already_cancelled"]["by"] == record.by, again

    status = json.loads(run_here(["status", run_store.url, "--json"], env).stdout)
    assert status["state"] == "cancelled" and status["cancelled"]["by"] == record.by, status["state"]
    assert "same `python -m producer run` / `enqueue` command" in status["resume"] and status["eta_s"] is None
    view = _said(run_here(["status", run_store.url], env))
    assert "cancelled" in view and "to resume" in view, view
    rec = json.loads(run_here(["reconcile", run_store.url, "--json"], env).stdout)
    assert rec["enqueued"] == [] and rec["cancelled"]["by"] == record.by, "reconcile never enqueues a cancelled run"

    cluster.worker("w0")
    resumed = run_here(["enqueue", *JOB, "--output", str(out), "--json"], env)
    assert resumed.returncode == 0, _said(resumed)
    report = json.loads(resumed.stdout)
    assert report["resumed"]["by"] == record.by and report["batches_enqueued"] == len(names), report
    assert Cancelled.read(run_store) is None
    wait_done(run_store, 120)
    assert_complete(run_store)
    assert json.loads(run_here(["status", run_store.url, "--json"], env).stdout)["state"] == "done"


def _start_run(tmp_path: Path, env: dict, out: Path) -> tuple[subprocess.Popen, Path]:
    err = tmp_path / "run.stderr"
    proc = python_popen(["-m", "producer", "run", *JOB, "--output", str(out), "--json"], env, stdout=subprocess.PIPE,
                        stderr=open(err, "w"))
    return proc, err


def _worker_logs(tmp_path: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").glob("*.log"))


@pytest.mark.timeout(300)
def test_cancel_now_stops_a_producer_run_on_the_embedded_broker_and_the_same_run_resumes_it(tmp_path, tiny_cache):
    """``producer run`` (its own embedded broker and workers) holds a batch just before its marker; ``cancel
    --now`` from another terminal (no HSX_BROKER_URL: the running embedded broker) names it as running; the
    worker stops it before its marker (its shard deleted), ``run`` exits 1 saying it was cancelled and how to
    resume; the same ``run`` again resumes and completes the run exactly once."""
    out = tmp_path / "out"
    env = clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state", spool_dir=tmp_path / "spool",
                    heartbeat_s=1, faults="pause_marker=8")
    proc, err = _start_run(tmp_path, env, out)
    try:
        line = wait_until(lambda: next((x for x in _worker_logs(tmp_path).splitlines() if "fault injection: pausing" in x),
                                       None) or (proc.poll() is not None and pytest.fail(err.read_text()[-3000:])),
                          180, "a batch held before its marker")
        held = held_batch(line)
        (run_dir,) = [p for p in out.iterdir() if (p / "run.json").exists()]
        cancel_env = clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state")
        # the worker's presence lists the batch a moment after it starts it (its heartbeat thread writes it)
        client = redis_client(running_embedded_broker(tmp_path / "state"))
        wait_until(lambda: any(t.batch == held for p in read_presences(client, "gpu") for t in p.tasks), 30,
                   "the worker's presence to list the held batch")
        cancel = run_here(["cancel", str(run_dir), "--now", "--json"], cancel_env)
        assert cancel.returncode == 0, _said(cancel)
        report = json.loads(cancel.stdout)
        assert report["broker"] and report["cancelled"]["now"] is True
        assert held in [r["batch"] for r in report["running"]], report
        stdout, _ = proc.communicate(timeout=120)
        assert proc.returncode == 1, stdout[-2000:] + err.read_text()[-3000:]
        first = json.loads(stdout)
        assert first["cancelled"]["now"] is True and first["batches_done"] < first["batches_total"], first
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    run_store = open_store(str(run_dir))
    assert held not in done_batches(run_store), "--now stops a running batch before its marker"
    assert shards_of(run_store, held) == [], "the stopped batch's shard is deleted"
    assert "stopped before its marker" in _worker_logs(tmp_path) or "cancelled with --now" in _worker_logs(tmp_path)
    status = json.loads(run_here(["status", str(run_dir), "--json", "--no-broker"], cancel_env).stdout)
    assert status["state"] == "cancelled" and status["cancelled"]["now"] is True
    # the command that planned it, to resume with (a new user re-ran with other options: another run id)
    assert f"; it was: `python -m producer run {' '.join(JOB)} --output {out} --json`" in status["resume"], status["resume"]

    env.pop("HSX_FAULTS")
    again, err = _start_run(tmp_path, env, out)
    try:
        stdout, _ = again.communicate(timeout=200)
    finally:
        if again.poll() is None:
            os.killpg(again.pid, signal.SIGKILL)
    assert again.returncode == 0, err.read_text()[-3000:]
    report = json.loads(stdout)
    assert report["resumed"]["now"] is True and report["batches_done"] == report["batches_total"], report
    assert Cancelled.read(run_store) is None
    assert_complete(run_store)
