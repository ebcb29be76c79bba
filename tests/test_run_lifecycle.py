"""What a single-machine ``producer run`` leaves behind when it is killed or hung up on, and what
the next run does with messages an interrupted run left in the embedded broker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import psutil

from jobfixtures import clean_env, fresh_interpreter, python_popen, run_python
from hsx.broker import EmbeddedBroker, redis_client

JOB = ["sharegpt", "--limit", "4", "--model", "tiny-qwen3.5", "--max-length", "128", "--batch-tokens", "128"]


def start_held_run(tmp_path, env) -> subprocess.Popen:
    """``producer run`` whose first batch is held in a fault-injection pause; returns once it is held."""
    err = open(tmp_path / "stderr", "w+")
    # A fresh interpreter: its launcher and workers are then its descendants, as a user's are (the tests read the tree).
    proc = python_popen(["-m", "producer", "run", *JOB, "--output", str(tmp_path / "store")], fresh_interpreter(env),
                        stdout=subprocess.DEVNULL,
                        stderr=err)
    deadline = time.monotonic() + 180
    while "fault injection: pausing" not in "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").glob("*.log")):
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()
        time.sleep(0.2)
    return proc


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[str]:
    """The command lines of ``procs`` still alive after ``timeout_s``."""
    _gone, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return [" ".join(p.cmdline()[:4]) for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def kill_all(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def test_a_killed_run_leaves_no_worker_behind(tmp_path, tiny_cache):
    """SIGKILL of ``producer run`` (no chance to clean up): its workers notice their parent is gone and
    shut down (warm: the held batch finishes); only the broker is left, which the next run stops."""
    env = clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state", spool_dir=tmp_path / "spool", faults="pause_forward=3")
    proc = start_held_run(tmp_path, env)
    children = descendants(proc.pid)
    workers = [p for p in children if "valkey" not in p.name()]
    assert any("workers" in " ".join(p.cmdline()) for p in workers), [p.cmdline() for p in children]
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert wait_gone(workers, 60) == [], "workers still running after their producer was killed"
    finally:
        kill_all(children)


def test_a_hangup_stops_the_run_like_ctrl_c(tmp_path, tiny_cache):
    """SIGHUP (a closed terminal or SSH session): the stopping line, exit code 129 (128 + SIGHUP), and nothing of
    the run is left running, broker included."""
    env = clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state", spool_dir=tmp_path / "spool", faults="pause_forward=2")
    proc = start_held_run(tmp_path, env)
    children = descendants(proc.pid)
    try:
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(120) == 129
        assert "stopping:" in (tmp_path / "stderr").read_text()
        assert wait_gone(children, 30) == []
    finally:
        kill_all(children)


def test_messages_left_by_an_interrupted_run_are_dropped_not_run(tmp_path, tiny_cache):
    """A message still queued in the embedded broker (a run interrupted before its workers took it,
    or a ``reconcile``) is not run by the next, unrelated run: that run says it dropped it, names
    the run it was of and how to redo it, and does its own job."""
    import base64

    state = tmp_path / "state"
    other = str(tmp_path / "elsewhere" / "other-run")
    body = base64.b64encode(json.dumps([[other, "b000001"], {}, {}]).encode()).decode()
    message = {"body": body, "content-type": "application/json", "content-encoding": "utf-8",
               "headers": {"task": "hsx.extract_batch", "id": "t-1"}, "properties": {"body_encoding": "base64"}}
    broker = EmbeddedBroker(state).start()
    try:
        client = redis_client(broker.url)
        client.lpush("gpu", json.dumps(message).encode())
        client.close()
    finally:
        broker.stop()
    env = clean_env(cache_dir=tiny_cache, state_dir=state, spool_dir=tmp_path / "spool")
    proc = run_python(["-m", "producer", "run", *JOB, "--output", str(tmp_path / "store")], env, timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = " ".join((proc.stdout + proc.stderr).split())
    assert f"dropped 1 queued batch message(s) of {other}" in said and "run that job's `producer run` again" in said, said
