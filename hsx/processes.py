"""Local processes: whether one is alive (for records that name a pid: spool files, planning records,
the process that started the workers), and how a child ended (:func:`describe_exit`)."""

from __future__ import annotations

import os
import signal


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists on this host (someone else's included: ``EPERM`` means it
    exists); False once it is gone. A zombie still counts as alive until its parent reaps it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pid_namespace() -> str | None:
    """This process's PID namespace (``pid:[4026531836]``, from ``/proc/self/ns/pid``), None where
    there is none to read. Two processes with the same host name see each other's pids only when
    this is the same: a container on the host's network shares its host name, not its pids."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def describe_exit(returncode: int) -> str:
    """How a child ended, from ``Popen.returncode``: ``killed by SIGKILL`` or ``exited with code 1``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        why = " (sent by a person, a supervisor or the kernel's OOM killer: see dmesg)" if -returncode == signal.SIGKILL else ""
        return f"killed by {name}{why}"
    return f"exited with code {returncode}"
