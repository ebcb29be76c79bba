"""The tests' fork server (tests/forkserver.py, ``jobfixtures.run_python`` / ``worker_popen``): a process
forked from it runs ``python ARGS`` as the interpreter would (environment, directory, ``sys.argv``,
``sys.path[0]``, exit code, an uncaught exception or KeyboardInterrupt, a kill), and a process whose
environment outside ``HSX_*`` differs from the server's gets a fresh interpreter."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from jobfixtures import ROOT, clean_env, fork_server, python_popen, run_python

PROBE = """
import json, os, sys
print(json.dumps({"probe": os.environ.get("HSX_PROBE"), "cwd": os.getcwd(), "path0": sys.path[0], "argv": sys.argv,
                  "ppid": os.getppid(), "main": __name__}))
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def server():
    s = fork_server()
    if s is None:
        pytest.skip("TEST_FORK_SERVER=0: no fork server")
    return s


def test_a_forked_command_sees_its_own_environment_directory_arguments_and_exit_code(server, tmp_path):
    proc = run_python(["-c", PROBE, "3", "x y"], clean_env(probe="seen"), cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr
    got = json.loads(proc.stdout)
    assert got == {"probe": "seen", "cwd": str(tmp_path), "path0": "", "argv": ["-c", "3", "x y"],
                   "ppid": server.proc.pid, "main": "__main__"}, got
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    got = json.loads(run_python([str(script), "0"], clean_env()).stdout)
    assert got["path0"] == str(tmp_path) and got["argv"] == [str(script), "0"] and got["ppid"] == server.proc.pid
    usage = run_python(["-m", "producer", "--help"], clean_env())
    assert usage.returncode == 0 and "usage:" in usage.stdout, usage.stderr


def test_an_uncaught_exception_or_ctrl_c_ends_a_forked_command_as_it_ends_python(server):
    failed = run_python(["-c", "raise ValueError('boom')"], clean_env())
    assert failed.returncode == 1 and "ValueError: boom" in failed.stderr and "Traceback" in failed.stderr
    interrupted = run_python(["-c", "raise KeyboardInterrupt"], clean_env())
    assert interrupted.returncode == -signal.SIGINT and "KeyboardInterrupt" in interrupted.stderr
    said = run_python(["-c", "import sys; sys.exit('no such run')"], clean_env())
    assert said.returncode == 1 and said.stderr == "no such run\n"


def test_a_killed_forked_process_reports_the_signal(server, tmp_path):
    (tmp_path / "out").touch()
    proc = server.spawn([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"], clean_env(),
                        tmp_path / "out")
    deadline = time.monotonic() + 30
    while "up" not in (tmp_path / "out").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None
    proc.kill()
    assert proc.wait(10) == -signal.SIGKILL
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(["-c", "import time; time.sleep(60)"], clean_env(), timeout_s=0.5)


def test_each_forked_process_draws_other_random_numbers(server):
    code = "import numpy, random; print(numpy.random.rand(), random.random())"
    first, second = (run_python(["-c", code], clean_env()).stdout.split() for _ in range(2))
    assert first[0] != second[0] and first[1] != second[1]


def test_a_process_whose_other_variables_differ_gets_a_fresh_interpreter(server):
    env = {**clean_env(), "PYTHONPATH": f"{ROOT}/nowhere:{ROOT}"}
    got = json.loads(run_python(["-c", PROBE, "0"], env).stdout)
    assert got["ppid"] != server.proc.pid, "forked, though a library could read PYTHONPATH at import"


ROUTED = """
import json, subprocess, sys
with open(sys.argv[1], "w") as out:
    routed = subprocess.Popen([sys.executable, "-m", "producer", "--help"], stdout=out, stderr=subprocess.STDOUT)
    code = routed.wait(60)
piped = subprocess.run([sys.executable, "-m", "producer", "--help"], capture_output=True, text=True)
failed = subprocess.Popen([sys.executable, "-m", "producer", "no-such-command"], stderr=subprocess.DEVNULL)
print(json.dumps({"routed": routed._routed, "code": code, "piped": piped._routed if hasattr(piped, "_routed") else None,
                  "piped_out": "usage:" in piped.stdout, "failed": failed.wait(60), "failed_routed": failed._routed}))
"""


def test_a_forked_command_s_own_python_children_are_forked_here_too(server, tmp_path):
    """``producer run`` -> launcher -> Celery worker: a forked process's ``Popen`` of ``python -m
    producer|workers|celery`` goes to the server (stdio passed, exit code kept); one with a pipe is a real
    ``Popen``."""
    proc = run_python(["-c", ROUTED, str(tmp_path / "help.txt")], clean_env())
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got == {"routed": True, "code": 0, "piped": None, "piped_out": True, "failed": 2, "failed_routed": True}, got
    assert "usage:" in (tmp_path / "help.txt").read_text()


def test_a_routed_child_gets_the_launcher_s_parent_death_signal_from_a_watcher(server):
    """``_signal_when_gone``: the SIGTERM that ``PR_SET_PDEATHSIG`` sends a launcher's worker when the launcher
    dies, for a routed worker whose real parent is the server."""
    sleeper = subprocess.Popen(["sleep", "60"])
    code = f"import sys, signal, time; sys.path.insert(0, {str(ROOT / 'tests')!r}); import forkserver; " \
           f"forkserver._signal_when_gone({sleeper.pid}, signal.SIGTERM); print('watching', flush=True); time.sleep(60)"
    proc = python_popen(["-c", code], clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    time.sleep(1.0)
    assert proc.poll() is None
    sleeper.kill()
    sleeper.wait()
    assert proc.wait(10) == -signal.SIGTERM
