"""Monitoring, with real parts: Flower on the embedded broker reading a whole ``producer run``,
``producer status --json`` on a finished and on a running job, the workers' ``gpu_stats`` inspect
command on a CPU worker, and the one-line-per-batch worker log.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from jobfixtures import WorkerProcess, clean_env, cli_json, free_port, python_popen, run_cli, wait_until

from hsx.broker import EmbeddedBroker, running_embedded_broker
from hsx.plan import read_batch_list
from hsx.records import done_batches
from hsx.store import open_store

# 24 real ShareGPT records in small batches: enough batches that a running job can be watched.
JOB = ["sharegpt", "--model", "tiny-qwen3.5", "--limit", "24", "--max-length", "256", "--batch-tokens", "768",
       "--store-dtype", "float32"]
FLOWER_AUTH = ("hsx", "test-flower-pw")


def flower_get(port: int, path: str, auth: tuple[str, str] | None = FLOWER_AUTH, timeout_s: float = 10):
    """GET ``path`` from Flower on loopback; returns the decoded JSON body."""
    headers = {}
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers)
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


class FlowerProcess:
    """``python -m producer flower`` on a free loopback port, logging to a file."""

    def __init__(self, env: dict[str, str], log_path: Path):
        self.port = free_port()
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = python_popen(["-m", "producer", "flower", "--port", str(self.port)], env, stdout=self._log,
                                 stderr=subprocess.STDOUT)

        def healthy():
            assert self.proc.poll() is None, f"flower exited:\n{log_path.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthcheck", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_until(healthy, 60, "Flower's /healthcheck")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def flower_job(tmp_path_factory, tiny_cache):
    """The whole single-machine job (``producer run``) on the embedded broker, with Flower up.

    Returns the run's report, Flower's worker list seen while the job ran, its task list after, the
    environment and the paths.
    """
    tmp = tmp_path_factory.mktemp("flower-job")
    broker = EmbeddedBroker(tmp / "broker").start()
    env = clean_env(cache_dir=tiny_cache, state_dir=tmp / "state", spool_dir=tmp / "spool", broker_url=broker.url,
                    flower_basic_auth=":".join(FLOWER_AUTH))
    flower = FlowerProcess(env, tmp / "flower.log")
    try:
        # Each batch waits 1 s before its marker, so the job's worker lives long enough (a few seconds
        # at least) for Flower's inspect broadcast to reach it: the tiny job alone can finish first.
        job = python_popen(["-m", "producer", "run", *JOB, "--output", str(tmp / "out"), "--json"],
                           {**env, "HSX_FAULTS": "pause_marker=1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        workers_seen: dict = {}
        while job.poll() is None and not workers_seen:
            workers_seen = flower_get(flower.port, "/api/workers?refresh=1")
            time.sleep(0.5)
        stdout, stderr = job.communicate(timeout=300)
        report = cli_json(subprocess.CompletedProcess(job.args, job.returncode, stdout, stderr))
        wanted = report["batches_total"]

        def all_tasks_succeeded():
            tasks = flower_get(flower.port, "/api/tasks")
            ours = {k: t for k, t in tasks.items() if t.get("name") == "hsx.extract_batch"}
            return ours if len(ours) == wanted and all(t["state"] == "SUCCESS" for t in ours.values()) else None

        tasks = wait_until(all_tasks_succeeded, 30, "Flower to list every task as SUCCESS")
        queues = flower_get(flower.port, "/api/queues/length")

        def all_offline():  # from the workers' events (online, heartbeats, offline): the job's worker has stopped
            alive = flower_get(flower.port, "/api/workers?status=1")
            return alive if alive and not any(alive.values()) else None

        alive = wait_until(all_offline, 30, "Flower to see the worker go offline")
        unauthenticated = None
        try:
            flower_get(flower.port, "/api/workers", auth=None)
        except urllib.error.HTTPError as exc:
            unauthenticated = exc.code
        yield {"tmp": tmp, "env": env, "report": report, "workers": workers_seen, "alive": alive, "tasks": tasks, "queues": queues,
               "unauthenticated": unauthenticated, "broker": broker}
    finally:
        flower.stop()
        broker.stop()


def test_flower_lists_the_worker_of_a_running_job(flower_job):
    """While ``producer run`` works, Flower's /api/workers lists its worker, serving the gpu queue with the extract task;
    after the job Flower knows from the worker's events that it went offline."""
    assert [(name.split("@")[0], alive) for name, alive in flower_job["alive"].items()] == [("cpu0", False)]
    workers = flower_job["workers"]
    assert workers, "Flower saw no worker while the job ran"
    name, info = next(iter(workers.items()))
    assert name.startswith("cpu0@")
    assert "hsx.extract_batch" in info["registered"]
    assert [q["name"] for q in info["active_queues"]] == ["gpu"]


def test_flower_shows_every_batch_task_with_readable_arguments(flower_job):
    """Every planned batch is one SUCCESS task in Flower whose arguments read run=, batch=, samples=, tokens= as planned."""
    report = flower_job["report"]
    run_store = open_store(report["address"])
    planned = {b.batch: b for b in read_batch_list(run_store)}
    seen = {}
    for task in flower_job["tasks"].values():
        fields = dict(part.split("=", 1) for part in task["args"].split())
        assert fields["run"] == report["run_id"], task["args"]
        seen[fields["batch"]] = fields
        assert task["worker"].startswith("cpu0@")
        assert "'status': 'done'" in task["result"] or '"status": "done"' in task["result"]
    assert seen.keys() == planned.keys()
    for batch, fields in seen.items():
        assert int(fields["samples"]) == planned[batch].num_samples
        assert int(fields["tokens"]) == planned[batch].num_tokens


def test_flower_api_needs_the_basic_auth_and_the_queue_is_empty_after_the_job(flower_job):
    """Flower's API answers 401 without the credentials; with them, the gpu queue is empty once the job is done."""
    assert flower_job["unauthenticated"] == 401
    assert {q["name"]: q["messages"] for q in flower_job["queues"]["active_queues"]}.get("gpu", 0) == 0


def test_status_json_of_a_finished_job_counts_everything_done(flower_job):
    """``status --json`` on the finished run: every batch, sample and token done, state done, ETA 0, per-worker totals add up."""
    report = flower_job["report"]
    run_store = open_store(report["address"])
    batches = read_batch_list(run_store)
    status = cli_json(run_cli("producer", ["status", report["address"], "--json"], flower_job["env"]))
    assert status["state"] == "done" and status["eta_s"] == 0
    assert status["batches_done"] == status["batches_total"] == len(batches) == report["batches_total"]
    assert status["samples_done"] == status["samples_total"] == sum(b.num_samples for b in batches) == report["plan"]["samples"]
    assert status["tokens_done"] == status["tokens_total"] == sum(b.num_tokens for b in batches) == report["plan"]["tokens"]
    assert status["samples_stored"] == status["samples_done"] and status["samples_quarantined"] == 0
    assert status["skipped"] == report["plan"]["skipped"]["counts"]
    assert status["failures"] == {} and status["batches_failed"] == 0
    assert status["overall_tokens_per_s"] > 0
    assert status["broker"]["queue"] == {"waiting": 0, "claimed": 0}
    assert sum(w["batches_done"] for w in status["workers"]) == len(batches)
    assert sum(w["tokens_done"] for w in status["workers"]) == status["tokens_total"]


def test_the_worker_logs_one_structured_line_per_batch(flower_job):
    """The worker log has exactly one ``batch done {json}`` line per batch, with run, batch, samples, tokens, seconds, tok/s, bytes."""
    report = flower_job["report"]
    log = (flower_job["tmp"] / "logs" / f"workers-{report['run_id']}.log").read_text()
    lines = [json.loads(line.split("batch done ", 1)[1]) for line in log.splitlines() if "batch done {" in line]
    assert sorted(x["batch"] for x in lines) == sorted(done_batches(open_store(report["address"])))
    for x in lines:
        assert {"run", "batch", "samples", "tokens", "seconds", "tok_s", "bytes"} <= x.keys(), x
        assert x["run"] == report["run_id"] and x["tokens"] > 0 and x["bytes"] > 0


def test_status_json_of_a_running_job_counts_what_is_done_and_the_live_worker(flower_job, tmp_path):
    """Enqueued with no worker: queued, 0 of N done, N waiting. Frozen mid-run: done counts equal the markers and the plan's
    samples and tokens of those batches, with a rate and an ETA. Done: the live worker's row comes from gpu_stats (no GPU here)."""
    broker = flower_job["broker"]
    env = clean_env(cache_dir=flower_job["env"]["HSX_CACHE_DIR"], broker_url=broker.url, spool_dir=tmp_path / "spool", store_url=tmp_path / "out",
                    worker_concurrency=1)
    job = [a if a != "768" else "512" for a in JOB]  # other batches: another run
    enq = cli_json(run_cli("producer", ["enqueue", *job, "--output", str(tmp_path / "out"), "--json"], env))
    run_store = open_store(enq["address"])
    batches = {b.batch: b for b in read_batch_list(run_store)}
    assert len(batches) >= 6, "the job must have enough batches to be seen running"

    status = cli_json(run_cli("producer", ["status", enq["address"], "--json"], env))
    assert status["state"] == "queued" and status["batches_done"] == 0 and status["batches_total"] == len(batches)
    assert status["samples_total"] == enq["plan"]["samples"] and status["tokens_total"] == enq["plan"]["tokens"]
    assert status["broker"]["queue"]["waiting"] == len(batches)
    assert status["eta_s"] is None and status["workers"] == []

    worker = WorkerProcess(env, "cpu9", tmp_path / "worker.log")
    try:
        worker.wait_ready()
        wait_until(lambda: len(done_batches(run_store)) >= 2, 120, "the first markers")
        os.kill(worker.proc.pid, signal.SIGSTOP)  # freeze the job mid-run: the markers cannot change under us
        try:
            observed = done_batches(run_store)
            assert 0 < len(observed) < len(batches), "the job must be caught between its first and last batch"
            status = cli_json(run_cli("producer", ["status", enq["address"], "--json"], env))
        finally:
            os.kill(worker.proc.pid, signal.SIGCONT)
        assert status["state"] == "running"
        assert status["batches_done"] == len(observed) and status["batches_total"] == len(batches)
        assert status["samples_done"] == sum(batches[b].num_samples for b in observed)
        assert status["tokens_done"] == sum(batches[b].num_tokens for b in observed)
        assert status["tokens_per_s"] > 0 and status["eta_s"] > 0
        assert [(w["pid"], w["batches_done"]) for w in status["workers"] if "markers" in w["sources"]] == [(worker.proc.pid, len(observed))]

        wait_until(lambda: len(done_batches(run_store)) == len(batches), 120, "every marker")
        status = cli_json(run_cli("producer", ["status", enq["address"], "--json"], env))
    finally:
        worker.stop()
    assert status["state"] == "done" and status["batches_done"] == len(batches)
    live = [w for w in status["workers"] if w["name"] and w["name"].startswith("cpu9@")]
    assert len(live) == 1, status["workers"]
    row = live[0]
    assert row["online"] is True and {"inspect", "markers"} <= set(row["sources"]) and row["pid"] == worker.proc.pid
    assert row["gpu"] is None and row["no_gpu"].startswith("no GPU") and row["device"] == "cpu"
    assert row["batches_done"] == len(batches) and row["tokens_per_s"] > 0 and row["running"] == []


def test_gpu_stats_inspect_command_on_a_cpu_worker_says_there_is_no_gpu(flower_job, tmp_path):
    """``celery -A workers inspect gpu_stats`` answers per worker: host, pid, no GPU and why, its batches and tokens/s fields."""
    env = clean_env(cache_dir=flower_job["env"]["HSX_CACHE_DIR"], broker_url=flower_job["broker"].url,
                    spool_dir=tmp_path / "spool")
    worker = WorkerProcess(env, "cpu7", tmp_path / "worker.log")
    try:
        worker.wait_ready()
        proc = run_cli("celery", ["-A", "workers", "inspect", "gpu_stats", "--json", "-d", f"cpu7@{socket.gethostname()}",
                                  "--timeout", "5"], env, timeout_s=60)
    finally:
        worker.stop()
    assert proc.returncode == 0, proc.stderr[-2000:]
    replies = json.loads(proc.stdout.strip().splitlines()[-1])
    (name, reply), = replies.items()
    assert name.startswith("cpu7@")
    assert reply["pid"] == worker.proc.pid and reply["host"] == socket.gethostname()
    assert reply["gpus"] == [] and reply["no_gpu"].startswith("no GPU")
    assert reply["running"] == [] and reply["batches_done"] == 0 and reply["tokens_per_s"] is None
    assert {"host", "device", "torch_memory", "tokens_done", "last_batch_at", "at"} <= reply.keys()


def test_flower_refuses_a_public_address_without_basic_auth(tmp_path):
    """``producer flower --address 0.0.0.0`` without HSX_FLOWER_BASIC_AUTH is refused before anything starts."""
    from hsx.errors import BadConfig
    from producer.flower import run_flower
    from settings import Settings

    settings = Settings(broker_url="redis://127.0.0.1:1/0", state_dir=tmp_path)
    with pytest.raises(BadConfig, match="HSX_FLOWER_BASIC_AUTH"):
        run_flower(settings, address="0.0.0.0")
    with pytest.raises(BadConfig, match="not shown"):
        run_flower(Settings(broker_url="redis://127.0.0.1:1/0", flower_basic_auth="no-colon-secret"), address="0.0.0.0")
    with pytest.raises(BadConfig, match="loopback only"):
        run_flower(Settings(broker_url="redis://127.0.0.1:1/0", flower_basic_auth="u:p"), address="10.0.0.5",
                   unauthenticated_api=True)


def test_flower_and_status_find_the_embedded_broker_of_a_running_job(tmp_path):
    """With no broker URL set, the embedded broker a ``producer run`` started here is found while it runs, and not after."""
    broker = EmbeddedBroker(tmp_path / "state").start()
    try:
        assert running_embedded_broker(tmp_path / "state") == broker.url
    finally:
        broker.stop()
    assert running_embedded_broker(tmp_path / "state") is None
    broker = EmbeddedBroker(tmp_path / "state").start()
    broker.kill()  # a killed run leaves its URL file: the dead server is not reported
    assert running_embedded_broker(tmp_path / "state") is None
