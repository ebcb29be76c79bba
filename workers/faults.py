"""Fault injection for the recovery tests (``HSX_FAULTS``); inert unless that setting is given.

The tests kill a worker during its forward or its upload, fill its spool, and race two deliveries
of a batch. Doing that at the right moment with real processes needs the worker to stop there for
a while: ``pause_<point>=S`` sleeps S seconds at ``point`` of every batch and logs
``fault injection: pausing S s at <point> of batch B`` first, which is what the test waits for.

| entry | effect |
|---|---|
| ``pause_forward=S`` | after the forward, its states on the host (the GPU lock already released) |
| ``pause_upload=S`` | after the shard is in the spool, before it is stored |
| ``pause_marker=S`` | after the stored shard is verified, before the marker |
| ``spool_full=N`` | the first N shard writes of this process fail with ENOSPC |

Never set it in production: it only slows batches down or fails them.
"""

from __future__ import annotations

import errno
import logging
import threading
import time

from core.errors import BadConfig

log = logging.getLogger(__name__)

POINTS = ("forward", "upload", "marker")

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
            elif name == "spool_full":
                out[name] = int(value)
            else:
                raise ValueError(f"unknown entry {name!r}")
        except ValueError as exc:
            raise BadConfig(f"HSX_FAULTS={spec!r}: {exc}; use pause_forward=S, pause_upload=S, pause_marker=S or spool_full=N") from None
    return out


def _faults(spec: str | None) -> dict:
    with _lock:
        if spec not in _state:
            _state[spec] = {"faults": parse_faults(spec), "spool_full_left": None}
            _state[spec]["spool_full_left"] = _state[spec]["faults"].get("spool_full", 0)
        return _state[spec]


def pause(spec: str | None, point: str, batch: str) -> None:
    """Sleep at ``point`` of ``batch`` if ``HSX_FAULTS`` asks for it (no-op otherwise)."""
    if not spec:
        return
    seconds = _faults(spec)["faults"].get(f"pause_{point}")
    if seconds:
        log.warning("fault injection: pausing %g s at %s of batch %s", seconds, point, batch)
        time.sleep(seconds)


def check_spool_write(spec: str | None, path) -> None:
    """Raise ``OSError(ENOSPC)`` for the first N shard writes when ``spool_full=N`` is set."""
    if not spec:
        return
    state = _faults(spec)
    with _lock:
        if state["spool_full_left"] <= 0:
            return
        state["spool_full_left"] -= 1
    log.warning("fault injection: spool full while writing %s", path)
    raise OSError(errno.ENOSPC, "No space left on device (fault injection)", str(path))
