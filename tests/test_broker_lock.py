"""One embedded broker per state dir: a second `producer run` is refused while the first holds it,
and a server orphaned by a killed run is shut down (AOF kept) before a new one starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from hsx.broker import URL_FILE, EmbeddedBroker, redis_client
from hsx.errors import BadConfig


def test_a_second_embedded_broker_on_the_same_state_dir_is_refused_with_the_holders_pid(tmp_path):
    import os

    first = EmbeddedBroker(tmp_path / "state").start()
    try:
        with pytest.raises(BadConfig, match=f"pid {os.getpid()}"):
            EmbeddedBroker(tmp_path / "state").start()
    finally:
        first.stop()
    again = EmbeddedBroker(tmp_path / "state").start()  # the lock went with the first one
    again.stop()


def test_a_server_orphaned_by_a_killed_run_is_shut_down_and_its_queue_kept(tmp_path):
    """The orphan keeps serving after its owner is gone; the next start stops it and reloads its AOF."""
    orphan = EmbeddedBroker(tmp_path / "state").start()
    redis_client(orphan.url).rpush("gpu", b"task-1")
    orphan._unlock()  # what the owner's death does to its lock; the server keeps running
    fresh = EmbeddedBroker(tmp_path / "state").start()
    try:
        assert orphan.proc.wait(10) is not None
        assert redis_client(fresh.url).lrange("gpu", 0, -1) == [b"task-1"]
    finally:
        fresh.stop()


def test_a_second_run_is_refused_before_it_tokenises_its_dataset(tmp_path, tiny_cache):
    """While another process holds this machine's embedded broker, ``producer run`` exits 2 naming its pid, and
    nothing is planned or written: the refusal comes before the dataset is read, not after."""
    import os

    from jobfixtures import clean_env, run_here

    holder = EmbeddedBroker(tmp_path / "state").claim()  # a state dir that exists: the machine ran jobs before
    try:
        proc = run_here(["run", "sharegpt", "--limit", "5", "--model", "tiny-qwen3.5", "--output", str(tmp_path / "out")],
                        clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state"))
    finally:
        holder.release()
    said = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2 and f"another 'producer run' (pid {os.getpid()})" in said, said
    assert "tokenis" not in said.lower() and not (tmp_path / "out").exists(), "planning started before the refusal"


def test_a_wrong_option_is_said_as_such_even_while_another_run_holds_the_broker(tmp_path, tiny_cache):
    """The request's own errors come first: ``--layers 3,1`` names the rule and the fix, not the busy
    broker (a new user's wrong options all read "another 'producer run' is using the embedded broker")."""
    from jobfixtures import clean_env, run_here

    holder = EmbeddedBroker(tmp_path / "state").claim()
    try:
        proc = run_here(["run", "sharegpt", "--limit", "5", "--model", "tiny-qwen3.5", "--layers", "3,1",
                         "--output", str(tmp_path / "out")], clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state"))
    finally:
        holder.release()
    said = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2 and "ascending" in said and "another 'producer run'" not in said, said
    assert not (tmp_path / "out").exists()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_run_with_nothing_to_do_stops_the_broker_a_killed_run_left(small_run, tmp_path):
    """Issue 22 item 8: ``producer run`` killed with SIGKILL leaves its embedded valkey-server running
    (its own session); the next ``run`` of a finished run finds nothing to do, and still stops that
    server and removes its URL file, as the README says the next ``run`` does."""
    from jobfixtures import ROOT, run_here, wait_until
    from smallrun import SMALL_JOB

    state = tmp_path / "state"
    owner = subprocess.Popen([sys.executable, "-c",
                              "import sys, time; from hsx.broker import EmbeddedBroker; "
                              "b = EmbeddedBroker(sys.argv[1]).start(); print(b.proc.pid, flush=True); time.sleep(600)",
                              str(state)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    server_pid = int(owner.stdout.readline())
    os.kill(owner.pid, signal.SIGKILL)  # as `kill -9` of `producer run`: no cleanup runs
    owner.wait(30)
    assert _alive(server_pid) and (state / URL_FILE).exists()
    try:
        env = {**small_run["env"], "HSX_STATE_DIR": str(state)}
        proc = run_here(["run", *SMALL_JOB, "--output", str(small_run["dir"].parent), "--json"], env)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["batches_enqueued"] == 0
        wait_until(lambda: not _alive(server_pid), 30, "the orphaned broker to exit")
        assert not (state / URL_FILE).exists()
    finally:
        if _alive(server_pid):
            os.kill(server_pid, signal.SIGKILL)
