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
import json, os, subprocess, sys
with open(sys.argv[1], "w") as out:
    routed = subprocess.Popen([sys.executable, "-m", "producer", "--help"], stdout=out, stderr=subprocess.STDOUT)
    code = routed.wait(60)
piped = subprocess.Popen([sys.executable, "-m", "producer", "--help"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
piped_out, piped_err = piped.communicate(timeout=60)
ran = subprocess.run([sys.executable, "-m", "producer", "--help"], capture_output=True, text=True)
script = subprocess.run([sys.executable, sys.argv[2], "a b"], capture_output=True, timeout=60)
failed = subprocess.Popen([sys.executable, "-m", "producer", "no-such-command"], stderr=subprocess.DEVNULL)
fresh = subprocess.Popen([sys.executable, sys.argv[2], "x"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                         env={**os.environ, "SOME_LIBRARY_SETTING": "1"})
print(json.dumps({"routed": routed._routed, "code": code, "piped": piped._routed, "piped_code": piped.returncode,
                  "piped_out": "usage:" in piped_out and piped_err == "", "ran": "usage:" in ran.stdout,
                  "script": [script.returncode, script.stdout.decode(), script.stderr.decode()],
                  "failed": failed.wait(60), "failed_routed": failed._routed, "fresh": fresh._routed,
                  "fresh_code": fresh.wait(60)}))
"""

SCRIPT = """
import os, sys
print(sys.argv[1:], os.path.basename(sys.path[0]))
sys.stderr.write("to stderr")
sys.exit(3)
"""


def test_a_forked_command_s_own_python_children_are_forked_here_too(server, tmp_path):
    """``producer run`` -> launcher -> Celery worker: a forked process's ``Popen`` of ``python -m
    producer|workers|celery`` or of a ``.py`` script (the benches' helpers) goes
    to the server (stdio passed, pipes too, exit code kept); one whose environment differs is a real
    ``Popen``."""
    script = tmp_path / "child.py"
    script.write_text(SCRIPT)
    proc = run_python(["-c", ROUTED, str(tmp_path / "help.txt"), str(script)], clean_env())
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got == {"routed": True, "code": 0, "piped": True, "piped_code": 0, "piped_out": True, "ran": True,
                   "script": [3, f"['a b'] {tmp_path.name}\n", "to stderr"], "failed": 2, "failed_routed": True,
                   "fresh": False, "fresh_code": 3}, got
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
