"""Fault injection for the recovery tests (``HSX_FAULTS``); inert unless that setting is given.

The tests kill a worker during its forward or its upload, fill its spool, and race two deliveries
of a batch. Doing that at the right moment with real processes needs the worker to stop there for
a while: ``pause_<point>=S`` sleeps S seconds at ``point`` of every batch and logs
``fault injection: pausing S s at <point> of batch B`` first, which is what the test waits for.

| entry | effect |
|---|---|
| ``pause_forward=S`` | after the forward, its states on the host (the GPU lock already released) |
| ``pause_upload=S`` | before the shard is written to the store (its states in a host buffer) |
| ``pause_store=S`` | in the middle of the store write: after its first piece (the header) went out |
| ``pause_marker=S`` | after the shard is stored, before the marker |
| ``pause_follow=S`` | in a follower rank of a worker's group (``workers/follower.py``), after rank 0's batch arrived, before its forward: rank 0 waits inside the forward's first collective; the line names the follower's pid |
| ``store_down=N`` | the first N direct store writes of this process fail as if the store did not answer (a transient ``StoreError``): the shard takes the overflow path through the spool |
| ``store_full=N`` | the first N direct store writes of this process fail with ENOSPC (a permanent ``StoreError`` on a local store) |
| ``spool_full=N`` | the first N spool writes of this process fail with ENOSPC |
| ``die_received=SIG`` | the worker process kills itself with signal SIG when a message is delivered to it, before its presence lists it (the second in which only the message's claim says where it went) |
| ``die_load=SIG`` | the worker process kills itself with signal SIG (a number, or a name such as ``KILL``) while it loads its model, after the weights are read: what the kernel's OOM killer does to a worker short of host memory |

Never set it in production: it only slows batches down or fails them.
"""

from __future__ import annotations

import errno
import logging
import threading
import time

from hsx.errors import BadConfig

log = logging.getLogger(__name__)

POINTS = ("forward", "upload", "store", "marker", "follow")
COUNTED = ("spool_full", "store_down", "store_full")
SIGNALLED = ("die_load", "die_received")

_lock = threading.Lock()
_state: dict[str, dict] = {}


def parse_faults(spec: str | None) -> dict:
    """``"pause_forward=5,spool_full=1"`` -> ``{"pause_forward": 5.0, "spool_full": 1}``.

    Raises:
        BadConfig: an unknown entry or a value that is not a number.
    """
    out: dict = {}
    for item in (spec or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, _, value = item.partition("=")
        name = name.strip()
        try:
            if name in tuple(f"pause_{p}" for p in POINTS):
                out[name] = float(value)
            elif name in COUNTED:
                out[name] = int(value)
            elif name in SIGNALLED:
                import signal

                value = value.strip().upper()
                out[name] = int(value) if value.isdigit() else int(signal.Signals["SIG" + value.removeprefix("SIG")])
            else:
                raise ValueError(f"unknown entry {name!r}")
        except ValueError as exc:
            raise BadConfig(f"HSX_FAULTS={spec!r}: {exc}; use pause_<point>=S (points: {', '.join(POINTS)}), "
                            f"{'=N, '.join(COUNTED)}=N, die_load=SIGNAL or die_received=SIGNAL") from None
    return out


def _faults(spec: str | None) -> dict:
    with _lock:
        if spec not in _state:
            faults = parse_faults(spec)
            _state[spec] = {"faults": faults, **{f"{name}_left": faults.get(name, 0) for name in COUNTED}}
        return _state[spec]


def pause(spec: str | None, point: str, batch: str) -> None:
    """Sleep at ``point`` of ``batch`` if ``HSX_FAULTS`` asks for it (no-op otherwise)."""
    if not spec:
        return
    seconds = _faults(spec)["faults"].get(f"pause_{point}")
    if seconds:
        log.warning("fault injection: pausing %g s at %s of batch %s", seconds, point, batch)
        time.sleep(seconds)


def _take(spec: str | None, name: str) -> bool:
    # True (and one fewer left) while the counted fault ``name`` has injections left.
    if not spec:
        return False
    state = _faults(spec)
    with _lock:
        if state[f"{name}_left"] <= 0:
            return False
        state[f"{name}_left"] -= 1
    return True


def _die(spec: str | None, name: str, when: str) -> None:
    # Kill this process with the signal of the entry ``name``, if HSX_FAULTS has it.
    if not spec:
        return
    sig = _faults(spec)["faults"].get(name)
    if sig:
        import os

        log.warning("fault injection: killing this worker with signal %d %s", sig, when)
        os.kill(os.getpid(), sig)


def at_load(spec: str | None) -> None:
    """Kill this process with ``die_load``'s signal, if ``HSX_FAULTS`` asks for it (no-op otherwise)."""
    _die(spec, "die_load", "while it loads its model")


def at_received(spec: str | None) -> None:
    """Kill this process with ``die_received``'s signal, if ``HSX_FAULTS`` asks for it (no-op otherwise)."""
    _die(spec, "die_received", "on a delivery, before listing it")


def check_spool_write(spec: str | None, path) -> None:
    """Raise ``OSError(ENOSPC)`` for the first N spool writes when ``spool_full=N`` is set."""
    if _take(spec, "spool_full"):
        log.warning("fault injection: spool full while writing %s", path)
        raise OSError(errno.ENOSPC, "No space left on device (fault injection)", str(path))


def store_write(spec: str | None, pieces, key: str, batch: str):
    """The pieces of a direct store write, with ``store_down`` / ``store_full`` / ``pause_store``
    applied (the pieces themselves when ``HSX_FAULTS`` is unset).

    ``store_down``: raises a transient :class:`hsx.errors.StoreError` before any byte;
    ``store_full``: raises ``OSError(ENOSPC)`` after the first piece; ``pause_store``: sleeps after it.
    """
    if not spec:
        return pieces
    from hsx.errors import StoreError

    if _take(spec, "store_down"):
        log.warning("fault injection: the store does not answer writing %s", key)
        raise StoreError(f"write {key!r} failed: the store did not answer (fault injection)", transient=True)
    full = _take(spec, "store_full")

    def gen():
        for i, piece in enumerate(pieces):
            yield piece
            if i == 0 and full:
                log.warning("fault injection: store full while writing %s", key)
                raise OSError(errno.ENOSPC, "No space left on device (fault injection)", key)
            if i == 0:
                pause(spec, "store", batch)
    return gen()


def reset() -> None:
    """Forget how many counted faults each spec has injected (for tests running several in one process)."""
    with _lock:
        _state.clear()
