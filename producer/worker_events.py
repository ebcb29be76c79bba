"""``producer run`` says each death of a local worker process as it happens, and records it for
``status``; and says each worker that is ready, and, until one is, that they are still loading.

``python -m workers --events FILE`` (``workers/launcher.py``) appends one JSON line per worker
death: how it ended, while loading the model or serving, its likely cause (a SIGKILL while loading
is compared with the checkpoint's size and the host's available memory, ``/proc/meminfo``) and
what the launcher does (a restart in N s, or giving up after ``HSX_WORKER_RESTART_LIMIT``
restarts); and one line (``action: ready``) when a worker's target is loaded and warmed up, with
what that took. :class:`WorkerEvents` reads the new lines and prints each one; for a death it
writes the dead process's status record ``<run>/workers/<host>-<pid>.json`` (state ``stopped``,
``exit`` saying the same) when the process wrote none: a worker that dies while loading has not
served the run yet, and ``status`` would otherwise not know it existed. A first worker on a fleet
compiles its GPU kernels for minutes before it is ready (BENCHMARKS.md, the cold starts): until a
worker is ready, a line every minute says that they are still loading, not a bar that stays at 0.
"""

from __future__ import annotations

import json
import logging
import time
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


def ready_line(event: dict) -> str:
    """A worker that is ready, as ``producer run`` prints it (``event``: an ``action: ready`` line)."""
    took = ""
    if event.get("load_s") is not None:
        kernels = {"from the store": ", kernels from the store's compile cache",
                   "compiled, stored": ", kernels compiled and stored for the next workers"}.get(event.get("kernels"), "")
        took = f": target loaded in {event['load_s']:g} s, warm-up {event.get('warmup_s', 0):g} s{kernels}"
    return f"worker {event.get('worker')} (pid {event.get('pid')}) ready after {event.get('ran_s')} s{took}"


class WorkerEvents:
    """The new lines of the launcher's events file at ``path``: :meth:`check` says and records them.

    ``run_store``: the run's store (the status records go there); ``say(line)`` prints a death;
    ``say_info(line)`` a worker ready and the lines of a wait (default: ``say``). ``log_path``: the
    workers' log, named in those lines. ``wait_s``: seconds since :attr:`started` (``clock``,
    monotonic: when the workers were launched) before the first "still loading" line, then between
    two of them.
    """

    def __init__(self, path: Path, run_store, say, say_info=None, log_path: Path | None = None,
                 wait_s: float = 60.0, clock=time.monotonic):
        self.path, self.run_store, self.say = Path(path), run_store, say
        self.say_info = say_info or say
        self.log_path, self.wait_s, self.clock = log_path, wait_s, clock
        self.started = clock()
        self._next_wait = self.started + wait_s
        self._offset = 0
        self.seen: list[dict] = []
        """Every death read so far, in order."""
        self.ready: list[dict] = []
        """Every ready event read so far, in order."""
        self._ready_now: set = set()  # workers (slot names) ready and not dead since

    @property
    def gave_up(self) -> str | None:
        """The line of the death after which the launcher gave up; None if it did not."""
        last = next((e for e in reversed(self.seen) if e.get("action") == "gave_up"), None)
        return death_line(last) if last else None

    def check(self) -> list[dict]:
        """Read, say and record the deaths and ready workers written since the last call, and say a wait
        that goes on (:meth:`_say_waiting`); returns the deaths. Never raises."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            data = b""
        except OSError as exc:
            log.debug("worker events not read: %s", exc)
            data = b""
        complete = data[:data.rfind(b"\n") + 1]  # a line still being written waits for the next call
        self._offset += len(complete)
        new = []
        for raw in complete.splitlines():
            try:
                event = json.loads(raw)
            except ValueError:
                continue
            if event.get("action") == "ready":
                self.ready.append(event)
                self._ready_now.add(event.get("worker"))
                self.say_info(ready_line(event))
                continue
            self._ready_now.discard(event.get("worker"))
            self._next_wait = max(self._next_wait, self.clock() + self.wait_s)  # a restart loads again: said after it
            new.append(event)
            self.seen.append(event)
            self.say(death_line(event))
            self._record(event)
        self._say_waiting()
        return new

    def _say_waiting(self) -> None:
        """Until a worker is ready, every :attr:`wait_s` seconds: how long they have been loading, and why."""
        now = self.clock()
        if self._ready_now or now < self._next_wait:
            return
        self._next_wait = now + self.wait_s
        log_hint = f"; its log: {self.log_path}" if self.log_path else ""
        self.say_info(f"workers: still loading the target, {now - self.started:.0f} s since they started (a first worker "
                      "on a GPU fleet compiles its kernels for minutes, once: later ones take them from the store"
                      f"{log_hint})")

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
