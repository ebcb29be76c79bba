"""``producer run`` says each death of a local worker process as it happens, and records it for ``status``.

``python -m workers --events FILE`` (``workers/launcher.py``) appends one JSON line per worker
death: how it ended, while loading the model or serving, its likely cause (a SIGKILL while loading
is compared with the checkpoint's size and the host's available memory, ``/proc/meminfo``) and
what the launcher does (a restart in N s, or giving up after ``HSX_WORKER_RESTART_LIMIT``
restarts). :class:`WorkerDeaths` reads the new lines, prints each one, and writes the dead
process's status record ``<run>/workers/<host>-<pid>.json`` (state ``stopped``, ``exit`` saying
the same) when the process wrote none: a worker that dies while loading has not served the run
yet, and ``status`` would otherwise not know it existed.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from pathlib import Path

log = logging.getLogger(__name__)


def death_line(event: dict) -> str:
    """One death as ``producer run`` prints it (``event``: a line of the launcher's events file)."""
    who = f"worker {event.get('worker')} (pid {event.get('pid')}) {event.get('exit')}, after {event.get('ran_s')} s"
    action = event.get("action")
    if action == "restart":
        return (f"{who}; restarting it in {event.get('restart_in_s'):g} s (restart {event.get('restarts')} of at most "
                f"{event.get('limit')} within {event.get('window_s'):g} s)")
    if action == "gave_up":
        return (f"{who}; it died {event.get('restarts', 0) + 1} times within {event.get('window_s'):g} s, more than "
                f"HSX_WORKER_RESTART_LIMIT={event.get('limit')} allows: the workers gave up, so this run stops")
    return f"{who} ({action})"


class WorkerDeaths:
    """The new lines of the launcher's events file at ``path``: :meth:`check` says and records them.

    ``run_store``: the run's store (the status records go there); ``say(line)`` prints a line.
    """

    def __init__(self, path: Path, run_store, say):
        self.path, self.run_store, self.say = Path(path), run_store, say
        self._offset = 0
        self.seen: list[dict] = []
        """Every death read so far, in order."""

    @property
    def gave_up(self) -> str | None:
        """The line of the death after which the launcher gave up; None if it did not."""
        last = next((e for e in reversed(self.seen) if e.get("action") == "gave_up"), None)
        return death_line(last) if last else None

    def check(self) -> list[dict]:
        """Read, say and record the deaths written since the last call; returns them. Never raises."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        except OSError as exc:
            log.debug("worker events not read: %s", exc)
            return []
        complete = data[:data.rfind(b"\n") + 1]  # a line still being written waits for the next call
        self._offset += len(complete)
        new = []
        for raw in complete.splitlines():
            try:
                event = json.loads(raw)
            except ValueError:
                continue
            new.append(event)
            self.seen.append(event)
            self.say(death_line(event))
            self._record(event)
        return new

    def _record(self, event: dict) -> None:
        from hsx.records import WorkerStatus

        host, pid = event.get("host"), event.get("pid")
        if not host or not isinstance(pid, int):
            return
        exit_text = event.get("exit") or "died"
        if event.get("action") == "gave_up":
            exit_text += f"; python -m workers gave up after {event.get('restarts')} restart(s) (HSX_WORKER_RESTART_LIMIT)"
        try:
            if WorkerStatus.read(self.run_store, f"{host}-{pid}") is not None:
                return  # it served the run: the launcher marks its own record (mark_dead_worker)
            now = datetime.now(timezone.utc).isoformat(timespec="seconds")
            WorkerStatus(host=host, pid=pid, worker=f"{host}-{pid}", state="stopped", exit=exit_text, exited_at=now,
                         updated_at=event.get("at") or now).write(self.run_store)
        except Exception as exc:  # status is told what it can be; the line was printed
            log.warning("status record of dead worker %s-%s not written: %s: %s", host, pid, exc.__class__.__name__, exc)
