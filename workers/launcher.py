"""``python -m workers``: one Celery worker process per visible GPU, each pinned with CUDA_VISIBLE_DEVICES.

With no GPU it starts one CPU worker (or ``HSX_WORKERS_PER_NODE`` of them). Ctrl-C or SIGTERM
is passed on as SIGTERM (Celery's warm shutdown: the running batch finishes, its marker is
written, unstarted tasks stay in the queue); a second signal, or a grace period running out,
kills what is left. Child processes are started with fork+exec, never by forking after CUDA is
initialised.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

from core.processes import pid_alive
from settings import Settings, get_settings


def visible_gpus(env: dict[str, str]) -> list[str]:
    """GPU ids this node offers: CUDA_VISIBLE_DEVICES if set, else every device NVML / torch sees."""
    given = env.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [g for g in given.split(",") if g.strip() not in ("", "-1")]
    try:
        import pynvml

        pynvml.nvmlInit()
        return [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:
        pass
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:
        return []


def worker_command(settings: Settings, name: str, loglevel: str) -> list[str]:
    return [
        sys.executable, "-m", "celery", "-A", "workers", "worker",
        "-Q", settings.queue,
        "-P", "threads", "-c", str(settings.task_threads),
        "-n", f"{name}@{socket.gethostname()}",
        "-l", loglevel,
        "-E",
        "--without-gossip", "--without-mingle",
    ]


def launch(settings: Settings, *, count: int | None = None, loglevel: str = "INFO", grace_s: float = 600.0,
           exit_with_parent: int | None = None) -> int:
    """Start the workers, wait until they all exit or a signal arrives; returns an exit code.

    ``exit_with_parent``: a pid (``producer run``'s); when that process is gone, the workers are
    stopped as on SIGTERM (warm shutdown), so that a killed ``run`` leaves no worker behind.
    """
    env = dict(os.environ)
    gpus = visible_gpus(env)
    if settings.device == "cpu":
        gpus = []
    n = count or settings.workers_per_node or max(1, len(gpus))
    procs: list[subprocess.Popen] = []
    for i in range(n):
        child_env = dict(env)
        if gpus:
            child_env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
            name = f"gpu{gpus[i % len(gpus)]}" + (f"-{i // len(gpus)}" if n > len(gpus) else "")
        else:
            name = f"cpu{i}"
        procs.append(subprocess.Popen(worker_command(settings, name, loglevel), env=child_env))
    print(f"workers: started {n} worker process(es) on {'GPUs ' + ','.join(gpus) if gpus else 'CPU'}", file=sys.stderr, flush=True)

    stopping = {"at": None}
    was_parent = exit_with_parent == os.getppid()

    def on_signal(signum, _frame):
        if stopping["at"] is None:
            stopping["at"] = time.monotonic()
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
        else:  # second signal: do not wait any longer
            for p in procs:
                if p.poll() is None:
                    p.kill()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    while any(p.poll() is None for p in procs):
        if exit_with_parent and stopping["at"] is None and not _alive(exit_with_parent, was_parent):
            print(f"workers: the process that started us (pid {exit_with_parent}) is gone; stopping", file=sys.stderr, flush=True)
            on_signal(signal.SIGTERM, None)
        if stopping["at"] is not None and time.monotonic() - stopping["at"] > grace_s:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.2)
    codes = [p.returncode for p in procs]
    return 0 if stopping["at"] is not None or all(c == 0 for c in codes) else 1


def _alive(pid: int, was_parent: bool) -> bool:
    # A parent that dies leaves us reparented (to init or a subreaper): no race with pid reuse.
    if was_parent:
        return os.getppid() == pid
    return pid_alive(pid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=None, help="worker processes (default: one per visible GPU, one on CPU)")
    parser.add_argument("--loglevel", default="INFO")
    parser.add_argument("--grace", type=float, default=600.0, help="seconds to let running batches finish after Ctrl-C / SIGTERM")
    parser.add_argument("--exit-with-parent", type=int, default=None, metavar="PID",
                        help="stop the workers (warm shutdown) when process PID is gone (producer run passes its own)")
    parser.add_argument("--allow-slow-kernels", action="store_true",
                        help="run a Gated DeltaNet model on CUDA without the fla kernels (slow; refused otherwise)")
    args = parser.parse_args(argv)
    if args.allow_slow_kernels:
        os.environ["HSX_ALLOW_SLOW_KERNELS"] = "true"  # the children read it through Settings
        get_settings.cache_clear()
    settings = get_settings()
    import workers  # noqa: F401  (refuses to start without a broker URL, before spawning anything)

    return launch(settings, count=args.count, loglevel=args.loglevel, grace_s=args.grace, exit_with_parent=args.exit_with_parent)
