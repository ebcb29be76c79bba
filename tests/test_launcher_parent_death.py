"""No worker outlives its launcher (issue 19, item 8): ``python -m workers`` starts each child with a
parent-death signal (SIGTERM, Linux ``PR_SET_PDEATHSIG``), so a SIGKILLed launcher's worker shuts
down by itself; and a crash of the launcher's own loop stops its workers before it exits with the error.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

from jobfixtures import ROOT, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")

CRASH_WHEN_TOLD = """
import logging, os, sys
from pathlib import Path
import workers.launcher as launcher
from settings import get_settings

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
trigger = Path(sys.argv[1])
def alive(pid, was_parent):  # the loop's parent check, made to fail once the test says so
    if trigger.exists():
        raise RuntimeError("injected crash of the supervise loop")
    return True
launcher._alive = alive
sys.exit(launcher.launch(get_settings(), count=1, grace_s=30, exit_with_parent=os.getppid()))
"""


def _start(cmd, cluster, log_path):
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=cluster.env())


def _child(launcher: subprocess.Popen, log_path) -> psutil.Process:
    wait_until(lambda: "ready." in log_path.read_text(errors="replace"), 90, "the launcher's worker ready")
    (child,) = psutil.Process(launcher.pid).children()
    return child


def _cleanup(launcher: subprocess.Popen) -> None:
    try:
        for p in psutil.Process(launcher.pid).children(recursive=True):
            p.kill()
    except psutil.NoSuchProcess:
        pass
    launcher.kill()
    launcher.wait()


@pytest.mark.timeout(120)
def test_a_sigkilled_launcher_s_worker_shuts_down_by_itself(cluster, tmp_path):
    """SIGKILL the launcher (nothing of it runs after): its idle worker gets SIGTERM from the kernel,
    shuts down warm, and is gone within seconds, writing its presence ``stopped``."""
    from hsx.broker import redis_client
    from hsx.fleet import read_presences

    log_path = tmp_path / "launcher.log"
    launcher = _start([sys.executable, "-m", "workers", "--count", "1"], cluster, log_path)
    try:
        child = _child(launcher, log_path)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        gone_at = time.monotonic()
        wait_until(lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, 45,
                   "the orphaned worker to exit")
        print(f"the worker exited {time.monotonic() - gone_at:.1f} s after its launcher was killed")
        [me] = [p for p in read_presences(redis_client(cluster.broker.url), "gpu") if p.pid == child.pid]
        assert me.state == "stopped", me
    finally:
        _cleanup(launcher)


@pytest.mark.timeout(120)
def test_a_crash_of_the_launcher_s_loop_stops_its_worker_and_fails_loudly(cluster, tmp_path):
    """An exception in the supervise loop: the launcher logs it, stops its worker (SIGTERM, warm) and
    exits non-zero; no worker is left running unsupervised."""
    log_path = tmp_path / "launcher.log"
    trigger = tmp_path / "crash-now"
    launcher = _start([sys.executable, "-c", CRASH_WHEN_TOLD, str(trigger)], cluster, log_path)
    try:
        child = _child(launcher, log_path)
        trigger.touch()
        assert launcher.wait(60) != 0
        log = log_path.read_text(errors="replace")
        assert "the launcher's loop crashed (RuntimeError: injected crash of the supervise loop)" in log, log[-3000:]
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, "its worker still runs"
    finally:
        _cleanup(launcher)
