"""``python -m workers`` as a supervisor, with real processes: the real launcher, real ``celery
worker`` children and a real valkey broker on a TCP port with a password (``TcpBroker``).

A worker that dies is logged with how it died and restarted after a doubling wait; one that keeps
dying ends the launcher with exit 1; a worker that exits 0 by itself is not restarted; a stop
(SIGTERM) ends everything without restarts; and a bad setting, a missing broker URL or a broker
that does not answer is refused before any worker starts. Two launchers on one host and broker give
their workers different node names, and the second warns about a GPU the first pins. The restart waits are set to a tenth
of a second so that the tests take seconds.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from jobfixtures import ROOT, TcpBroker, clean_env, free_port, wait_until
from hsx.store import exists, open_store
from settings import Settings
from workers.heartbeat import Heartbeat, worker_name
from workers.launcher import RestartPolicy, describe_exit, mark_dead_worker

#: seconds a test gives the launcher's children to start (two Celery workers on a busy 2-core machine).
START_S = 90


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    b = TcpBroker(tmp_path_factory.mktemp("launcher-broker"))
    yield b
    b.stop()


@pytest.fixture
def clean_broker(broker):
    """The module's broker, flushed: no queue, no message of an earlier test."""
    import redis

    redis.Redis.from_url(broker.url).flushall()
    return broker


class Launcher:
    """A real ``python -m workers`` process, its combined output in a file."""

    def __init__(self, tmp_path: Path, env: dict[str, str], *args: str):
        self.log_path = tmp_path / "launcher.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "workers", *args], cwd=ROOT, env=env,
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self.ps = psutil.Process(self.proc.pid)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def children(self) -> dict[str, psutil.Process]:
        """Live ``celery worker`` children by node name (``cpu0``...), zombies left out."""
        out = {}
        for child in self.ps.children():
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    continue
                cmd = child.cmdline()
            except psutil.NoSuchProcess:
                continue
            if "-n" in cmd:
                out[cmd[cmd.index("-n") + 1].split("@")[0]] = child
        return out

    def ready_count(self, name: str) -> int:
        return len(re.findall(rf"{name}@\S+ ready\.", self.log()))

    def close(self) -> None:
        if self.proc.poll() is None:
            for child in self.ps.children(recursive=True):
                child.kill()
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture
def launcher_env(tmp_path, clean_broker):
    def make(**hsx):
        base = dict(broker_url=clean_broker.url, device="cpu", cache_dir=tmp_path / "cache", spool_dir=tmp_path / "spool",
                    worker_restart_delay_s=0.1, worker_restart_max_delay_s=0.4, worker_concurrency=1)
        base.update(hsx)
        return clean_env(**base)
    return make


@pytest.fixture
def launchers():
    started: list[Launcher] = []
    yield started
    for launcher in started:
        launcher.close()


def test_restart_wait_doubles_from_the_first_delay_up_to_the_cap():
    """1 s, 2 s, 4 s ... 60 s: the wait before a restart doubles with each restart counted in the window."""
    policy = RestartPolicy(delay_s=1.0, max_delay_s=60.0, limit=10, window_s=600.0)
    assert [policy.delay(n) for n in range(8)] == [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    assert policy.delay(10_000) == 60.0  # no overflow for a large limit


def test_an_exit_is_described_by_its_signal_or_its_code():
    assert describe_exit(-signal.SIGKILL).startswith("killed by SIGKILL")
    assert describe_exit(-signal.SIGSEGV) == "killed by SIGSEGV"
    assert describe_exit(1) == "exited with code 1"


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_killed_worker_is_logged_with_its_signal_and_restarted(tmp_path, launcher_env, launchers, tiny_cache):
    """SIGKILL of one of two workers: the launcher reaps it (no zombie), logs SIGKILL, starts a new one
    under the same node name that becomes ready, leaves the other alone; SIGTERM then stops both
    and exits 0 without restarting anything. With ``HSX_MODEL`` each worker loads its target as it
    starts, and ``--events`` gets a ``ready`` line for each start (the restarted one's too) with what
    its load and warm-up took, beside the death's line."""
    events = tmp_path / "events.jsonl"
    launcher = Launcher(tmp_path, launcher_env(model="tiny-qwen3.5", cache_dir=tiny_cache), "--count", "2",
                        "--events", str(events))
    launchers.append(launcher)
    wait_until(lambda: launcher.ready_count("cpu0") and launcher.ready_count("cpu1"), START_S, "both workers ready")
    wait_until(lambda: len(_events(events)) == 2, START_S, "both workers' ready lines")
    first = {e["worker"]: e for e in _events(events)}
    assert sorted(first) == ["cpu0", "cpu1"] and {e["action"] for e in first.values()} == {"ready"}, first
    for e in first.values():
        assert e["device"] == "cpu" and e["kernels"] is None and e["ran_s"] >= e["load_s"] + e["warmup_s"] > 0, e
    before = launcher.children()
    assert sorted(before) == ["cpu0", "cpu1"], before
    victim = before["cpu1"]  # the second: the old loop never looked past a live first child
    victim.kill()
    wait_until(lambda: launcher.children().get("cpu1", victim).pid != victim.pid, 10, "cpu1 restarted")
    assert not psutil.pid_exists(victim.pid) or psutil.Process(victim.pid).status() != psutil.STATUS_ZOMBIE
    log = launcher.log()
    assert re.search(rf"worker cpu1 \(pid {victim.pid}\) killed by SIGKILL .*after [\d.]+ s; restarting it in 0\.1 s "
                     r"\(restart 1 of at most 5 within 600 s\)", log), log[-3000:]
    assert launcher.children()["cpu0"].pid == before["cpu0"].pid
    wait_until(lambda: launcher.ready_count("cpu1") == 2, START_S, "the restarted cpu1 ready")
    wait_until(lambda: len(_events(events)) == 4, START_S, "the death's line and the restarted worker's ready line")
    death, again = _events(events)[2:]
    assert (death["worker"], death["pid"], death["action"]) == ("cpu1", victim.pid, "restart"), death
    assert (again["worker"], again["action"]) == ("cpu1", "ready") and again["pid"] == launcher.children()["cpu1"].pid

    survivors = list(launcher.children().values())
    logged = len(launcher.log())
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.proc.wait(60) == 0, launcher.log()[-3000:]
    assert psutil.wait_procs(survivors, timeout=10)[1] == []
    after_stop = launcher.log()[logged:]
    assert "restart" not in after_stop and after_stop.count("while stopping") == 2, after_stop[-2000:]


def test_a_worker_that_keeps_dying_hits_the_restart_limit_and_the_launcher_exits_1(tmp_path, launcher_env, launchers):
    """cpu0 SIGKILLed each time it starts, with HSX_WORKER_RESTART_LIMIT=2: two restarts after 0.1 s
    and 0.2 s (doubling), then the launcher gives up, stops cpu1 too, and exits 1."""
    launcher = Launcher(tmp_path, launcher_env(worker_restart_limit=2, worker_restart_window_s=60), "--count", "2")
    launchers.append(launcher)
    killed: list[int] = []
    seen: set[psutil.Process] = set()
    deadline = time.monotonic() + START_S
    while launcher.proc.poll() is None and time.monotonic() < deadline:
        children = launcher.children()
        seen.update(children.values())
        child = children.get("cpu0")
        if child is not None and child.pid not in killed:
            child.kill()
            killed.append(child.pid)
        time.sleep(0.02)
    assert launcher.proc.returncode == 1, launcher.log()[-3000:]
    assert len(killed) == 3, killed
    log = launcher.log()
    waits = re.findall(r"worker cpu0 \(pid \d+\) killed by SIGKILL .*?; restarting it in ([\d.]+) s", log)
    assert waits == ["0.1", "0.2"], log[-3000:]
    assert re.search(rf"worker cpu0 \(pid {killed[-1]}\) killed by SIGKILL .*giving up: 2 restart\(s\) of it within 60 s "
                     r"already \(HSX_WORKER_RESTART_LIMIT=2", log), log[-3000:]
    assert "stopping the other workers" in log and re.search(r"worker cpu1 \(pid \d+\) .* while stopping", log), log[-3000:]
    assert any(p.pid not in killed for p in seen), "cpu1 was never seen"
    assert [p.pid for p in seen if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []


def test_a_worker_that_exits_0_by_itself_is_not_restarted(tmp_path, launcher_env, launchers):
    """SIGTERM sent to the worker itself (not to the launcher): Celery's warm shutdown exits 0, the
    launcher says so and does not restart it; with no worker left it exits 0."""
    launcher = Launcher(tmp_path, launcher_env(), "--count", "1")
    launchers.append(launcher)
    wait_until(lambda: launcher.ready_count("cpu0"), START_S, "cpu0 ready")
    child = launcher.children()["cpu0"]
    child.send_signal(signal.SIGTERM)
    assert launcher.proc.wait(60) == 0, launcher.log()[-3000:]
    log = launcher.log()
    assert re.search(rf"worker cpu0 \(pid {child.pid}\) exited with code 0 .*: not restarted", log), log[-3000:]
    assert "restarting it in" not in log and "restarted (pid" not in log


def _refused_before_start(proc: subprocess.CompletedProcess) -> str:
    """The one error line of a launcher that started nothing (exit 2, no traceback, no worker banner)."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out and "workers: started" not in out and "celery@" not in out and "ready." not in out, out
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def run_launcher(env: dict[str, str], timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workers", "--count", "1"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout_s)


def _two_launchers(tmp_path, env, launchers) -> tuple[Launcher, Launcher]:
    """A launcher of one worker, then a second once the first's worker is started (its name taken)."""
    started = []
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
        launcher = Launcher(tmp_path / name, env, "--count", "1")
        launchers.append(launcher)
        wait_until(launcher.children, 30, f"the {name} launcher's worker to start")
        started.append(launcher)
    return started[0], started[1]


def test_two_launchers_on_one_host_and_broker_give_their_workers_different_node_names(tmp_path, launcher_env, launchers):
    """The first launcher's worker is cpu0@host, the second's cpu0-1@host, which the second says, naming the
    first's pid; CPU workers share the host without a warning. Once the first and its worker are gone,
    a third launcher's worker is cpu0 again. (Both were cpu0@host: `celery inspect` heard one of them.)"""
    (tmp_path / "tmp").mkdir()
    env = {**launcher_env(), "TMPDIR": str(tmp_path / "tmp")}  # lock files of this test's own
    first, second = _two_launchers(tmp_path, env, launchers)
    assert list(first.children()) == ["cpu0"] and list(second.children()) == ["cpu0-1"], (first.log(), second.log())
    host = socket.gethostname()
    assert (f"worker name cpu0@{host} is taken on this host by launcher pid {first.proc.pid} (same broker): "
            f"this one is cpu0-1@{host}") in second.log(), second.log()
    assert "GPU" not in second.log()
    first.close()
    (tmp_path / "third").mkdir()
    third = Launcher(tmp_path / "third", env, "--count", "1")
    launchers.append(third)
    assert list(wait_until(third.children, 30, "the third launcher's worker to start")) == ["cpu0"], third.log()


def test_a_gpu_another_launcher_of_the_host_pins_is_warned_about_naming_that_launcher(tmp_path, launcher_env, launchers):
    """Two launchers given CUDA_VISIBLE_DEVICES=0: the second's worker is gpu0-1, and the second warns
    that GPU 0 is used by the first (its pid and worker), with the fix."""
    (tmp_path / "tmp").mkdir()
    env = {**launcher_env(device=None), "TMPDIR": str(tmp_path / "tmp"), "CUDA_VISIBLE_DEVICES": "0"}
    first, second = _two_launchers(tmp_path, env, launchers)
    assert list(first.children()) == ["gpu0"] and list(second.children()) == ["gpu0-1"], (first.log(), second.log())
    said = " ".join(second.log().split())
    assert (f"GPU 0 is already used by another launcher on this host: launcher pid {first.proc.pid} (its worker gpu0); "
            "worker gpu0-1 loads a model on it too") in said, said
    assert "give each its own GPUs (CUDA_VISIBLE_DEVICES)" in said and "GPU 0 is already" not in first.log()


def test_a_bad_setting_is_refused_with_variable_value_and_rule_before_any_worker(launcher_env):
    line = _refused_before_start(run_launcher(launcher_env(worker_concurrency=0)))
    assert "HSX_WORKER_CONCURRENCY='0'" in line and "should be greater than or equal to 1" in line, line
    assert "unset HSX_WORKER_CONCURRENCY for the default 4" in line, line


def test_no_broker_url_is_refused_naming_the_variable_and_the_fix(tmp_path):
    env = clean_env(device="cpu", cache_dir=tmp_path / "cache")
    line = _refused_before_start(run_launcher(env))
    assert "HSX_BROKER_URL is not set" in line and "export HSX_BROKER_URL=redis://" in line, line


def test_a_broker_that_does_not_answer_is_refused_within_the_check_timeout(launcher_env):
    """Nothing listens on the port: refused after HSX_BROKER_CHECK_TIMEOUT_S (1 s), the password masked."""
    url = f"redis://:hunter2-secret@127.0.0.1:{free_port()}/0"
    started = time.monotonic()
    proc = run_launcher(launcher_env(broker_url=url, broker_check_timeout_s=1))
    elapsed = time.monotonic() - started
    line = _refused_before_start(proc)
    assert "hunter2-secret" not in proc.stdout + proc.stderr
    assert f"broker redis://:***@127.0.0.1:{url.rsplit(':', 1)[1]} (HSX_BROKER_URL) does not answer within 1 s" in line, line
    assert "Connection refused" in line and elapsed < 30, (line, elapsed)


def test_a_broker_that_refuses_the_password_is_refused_at_once(clean_broker, launcher_env):
    url = clean_broker.url.replace(clean_broker.password, "wrong-password")
    proc = run_launcher(launcher_env(broker_url=url, broker_check_timeout_s=30))
    line = _refused_before_start(proc)
    assert "wrong-password" not in proc.stdout + proc.stderr
    assert "(HSX_BROKER_URL) refused us" in line and "redis://:***@127.0.0.1" in line, line


def test_the_status_record_of_a_dead_worker_is_marked_stopped_with_how_it_ended(tmp_path, monkeypatch):
    """A record written by the real Heartbeat says ``working``, and the Heartbeat lists its run in
    ``<HSX_WORKER_RUNS_DIR>/<pid>.runs`` (once); marked for a worker killed by SIGKILL it says
    ``stopped``, with no batch, the exit and the time of its last heartbeat kept."""
    from settings import get_settings

    monkeypatch.setenv("HSX_WORKER_RUNS_DIR", str(tmp_path))
    get_settings.cache_clear()
    settings = Settings(_env_file=None)
    run_url = str(tmp_path / "run")
    store = open_store(run_url, settings)
    beat = Heartbeat(interval_s=3600)  # one write for the change, then quiet for the test's length
    beat.phase(run_url, store, "b000003", "forward")
    beat.phase(run_url, store, "b000004", "forward")
    get_settings.cache_clear()
    key = f"workers/{worker_name()}.json"
    wait_until(lambda: exists(store, key), 10, "the record")
    time.sleep(1.0)
    before = json.loads(store.read(key))
    assert before["state"] == "working" and before["batches"][0]["batch"] == "b000003", before
    runs = tmp_path / f"{os.getpid()}.runs"
    assert runs.read_text() == f"{run_url}\n", "the heartbeat lists the run once, when it first writes there"
    assert mark_dead_worker(runs, socket.gethostname(), os.getpid(), describe_exit(-signal.SIGKILL), settings) == [run_url]
    after = json.loads(store.read(key))
    assert after["state"] == "stopped" and after["batches"] == [] and after["exit"].startswith("killed by SIGKILL"), after
    assert after["abandoned"] == ["b000003", "b000004"], "the batches it listed, for the launcher to put back"
    assert after["updated_at"] == before["updated_at"] and after["exited_at"] >= before["updated_at"]
    assert not runs.exists()
    assert mark_dead_worker(runs, socket.gethostname(), os.getpid(), "killed by SIGKILL", settings) == []


def test_a_hung_worker_is_killed_when_its_lease_ends_and_restarted(tmp_path, launcher_env, launchers):
    """A worker that is alive but writes no heartbeat (SIGSTOP: every thread stopped) holds its batches
    for ever where no other worker reclaims them. The launcher watches each child's beat file and, once
    it is older than the lease (HSX_LEASE_S), kills the child, says why, and restarts it like any death."""
    launcher = Launcher(tmp_path, launcher_env(lease_s=4), "--count", "1")
    launchers.append(launcher)
    wait_until(lambda: launcher.ready_count("cpu0"), START_S, "cpu0 ready")
    victim = launcher.children()["cpu0"]
    time.sleep(2)  # its beats are written: a worker stopped before its first one is not judged
    victim.suspend()
    wait_until(lambda: launcher.children().get("cpu0", victim).pid != victim.pid, 20, "cpu0 killed and restarted")
    log = launcher.log()
    assert re.search(rf"worker cpu0 \(pid {victim.pid}\) wrote no heartbeat for \d+ s \(HSX_LEASE_S 4\): hung; "
                     "killing it", log), log[-3000:]
    assert re.search(rf"worker cpu0 \(pid {victim.pid}\) killed by this launcher: no heartbeat for \d+ s .*hung.* "
                     r"restarting it in 0\.1 s", log), log[-3000:]
    wait_until(lambda: launcher.ready_count("cpu0") == 2, START_S, "the restarted cpu0 ready")
    time.sleep(6)  # a working worker beats: it is not killed again
    assert launcher.log().count("wrote no heartbeat") == 1
