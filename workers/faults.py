"""Fault injection for the recovery tests: a test-only hook, no user setting.

This module reads the environment variable ``HSX_FAULTS`` itself (``settings.py`` does not know it:
it is not an option of the job). Unset, as in production, :func:`hooks` returns :data:`NO_FAULTS`,
whose hooks do nothing: the store is the store, a pause returns at once. Set, the task body
(``workers/extract.py``) meets the same calls between its steps, and the run's store is wrapped in
a :class:`FaultyStore`; no step of the body knows about faults.

The tests kill a worker during its forward or its upload, fill its spool, and race two deliveries
of a batch. Doing that at the right moment with real processes needs the worker to stop there for
a while: ``pause_<point>=S`` sleeps S seconds at ``point`` of every batch and logs
``fault injection: pausing S s at <point> of batch B`` first, which is what the test waits for.

| entry | effect |
|---|---|
| ``pause_forward=S`` | after the forward step, its states on the host (the GPU lock already released) |
| ``pause_upload=S`` | before the write step (its states in a host buffer, nothing stored yet) |
| ``pause_store=S`` | in the middle of a shard write: after its first piece (the header) went out |
| ``pause_marker=S`` | after the write step (the shard stored), before the certify step writes the marker |
| ``pause_load=S`` | while the worker loads its model at its start (``HSX_MODEL``), after the weights are read: a first GPU worker compiling its kernels for minutes; logs ``fault injection: pausing S s while it loads its model`` |
| ``pause_follow=S`` | in a follower rank of a worker's group (``workers/follower.py``), after rank 0's batch arrived, before its forward: rank 0 waits inside the forward's first collective; the line names the follower's pid |
| ``store_down=N`` | the first N shard writes of this process fail as if the store did not answer (a transient ``StoreError``): the shard takes the overflow path through the spool |
| ``store_full=N`` | the first N shard writes of this process fail with ENOSPC after their first piece (a full store) |
| ``spool_full=N`` | the first N spool writes of this process fail with ENOSPC |
| ``die_received=SIG`` | the worker process kills itself with signal SIG when a message is delivered to it, before its presence lists it (the second in which only the message's claim says where it went) |
| ``die_load=SIG`` | the worker process kills itself with signal SIG (a number, or a name such as ``KILL``) while it loads its model, after the weights are read: what the kernel's OOM killer does to a worker short of host memory |

A shard write is one :meth:`Store.write_stream` call of the write step: the direct write, or a
retry of it from the host buffer or the spool. Never set it in production: it only slows batches
down or fails them.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import threading
import time

from hsx.errors import BadConfig, StoreError

log = logging.getLogger(__name__)

#: the environment variable this module reads (the tests' launchers set it like any ``HSX_*``).
ENV = "HSX_FAULTS"
POINTS = ("forward", "upload", "store", "marker", "follow", "load")
COUNTED = ("spool_full", "store_down", "store_full")
SIGNALLED = ("die_load", "die_received")


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
                value = value.strip().upper()
                out[name] = int(value) if value.isdigit() else int(signal.Signals["SIG" + value.removeprefix("SIG")])
            else:
                raise ValueError(f"unknown entry {name!r}")
        except (ValueError, KeyError) as exc:
            raise BadConfig(f"{ENV}={spec!r}: {exc}; use pause_<point>=S (points: {', '.join(POINTS)}), "
                            f"{'=N, '.join(COUNTED)}=N, die_load=SIGNAL or die_received=SIGNAL") from None
    return out


class NoFaults:
    """The hooks of a worker without fault injection (production): each one does nothing."""

    def pause(self, point: str, batch: str) -> None:
        """Return at once (:class:`Faults` sleeps here)."""

    def store(self, store, batch: str):
        """The run's store itself (:class:`Faults` wraps it in a :class:`FaultyStore`)."""
        return store

    def spool_writer(self, write):
        """The spool's writer ``write(path, pieces)`` itself (:class:`Faults` makes it fail with ENOSPC)."""
        return write

    def at_load(self) -> None:
        """Return at once (:class:`Faults` kills the process while it loads its model)."""

    def at_received(self) -> None:
        """Return at once (:class:`Faults` kills the process when a message is delivered)."""


class Faults(NoFaults):
    """The hooks of a worker under ``HSX_FAULTS``: one per spec and process, counting what it injected."""

    def __init__(self, spec: str):
        self.spec = spec
        self.faults = parse_faults(spec)
        self._lock = threading.Lock()
        self._left = {name: self.faults.get(name, 0) for name in COUNTED}

    def pause(self, point: str, batch: str) -> None:
        """Sleep ``pause_<point>`` seconds, after the line the tests wait for."""
        seconds = self.faults.get(f"pause_{point}")
        if seconds:
            log.warning("fault injection: pausing %g s at %s of batch %s", seconds, point, batch)
            time.sleep(seconds)

    def take(self, name: str) -> bool:
        """True (and one fewer left) while the counted fault ``name`` has injections left."""
        with self._lock:
            if self._left[name] <= 0:
                return False
            self._left[name] -= 1
            return True

    def store(self, store, batch: str):
        """``store`` with its shard writes failing or pausing as the spec asks (:class:`FaultyStore`)."""
        return FaultyStore(store, self, batch)

    def spool_writer(self, write):
        """``write(path, pieces)`` whose first ``spool_full`` calls raise ``OSError(ENOSPC)`` instead."""

        def faulty_write(path, pieces):
            if self.take("spool_full"):
                log.warning("fault injection: spool full while writing %s", path)
                raise OSError(errno.ENOSPC, "No space left on device (fault injection)", str(path))
            return write(path, pieces)

        return faulty_write

    def at_load(self) -> None:
        """Sleep ``pause_load`` seconds, then kill this process with ``die_load``'s signal, as the spec has them."""
        seconds = self.faults.get("pause_load")
        if seconds:
            log.warning("fault injection: pausing %g s while it loads its model", seconds)
            time.sleep(seconds)
        self._die("die_load", "while it loads its model")

    def at_received(self) -> None:
        """Kill this process with ``die_received``'s signal, if the spec has it."""
        self._die("die_received", "on a delivery, before listing it")

    def _die(self, name: str, when: str) -> None:
        sig = self.faults.get(name)
        if sig:
            log.warning("fault injection: killing this worker with signal %d %s", sig, when)
            os.kill(os.getpid(), sig)


class FaultyStore:
    """A run's store whose shard writes (:meth:`write_stream`) meet ``store_down``, ``store_full``
    and ``pause_store``; every other call is the store's own."""

    def __init__(self, store, faults: Faults, batch: str):
        self._store, self._faults, self._batch = store, faults, batch

    def __getattr__(self, name: str):
        return getattr(self._store, name)

    def write_stream(self, key: str, pieces):
        """The store's ``write_stream``, unless a fault comes first: ``store_down`` raises a transient
        :class:`hsx.errors.StoreError` before any byte, ``store_full`` raises ``OSError(ENOSPC)``
        after the first piece (the store reports it as full), ``pause_store`` sleeps after it."""
        if self._faults.take("store_down"):
            log.warning("fault injection: the store does not answer writing %s", key)
            raise StoreError(f"write {key!r} failed: the store did not answer (fault injection)", transient=True)
        return self._store.write_stream(key, self._pieces(key, pieces, full=self._faults.take("store_full")))

    def _pieces(self, key: str, pieces, full: bool):
        for i, piece in enumerate(pieces):
            yield piece
            if i == 0 and full:
                log.warning("fault injection: store full while writing %s", key)
                raise OSError(errno.ENOSPC, "No space left on device (fault injection)", key)
            if i == 0:
                self._faults.pause("store", self._batch)


#: the hooks of every process without ``HSX_FAULTS``.
NO_FAULTS = NoFaults()
_lock = threading.Lock()
_by_spec: dict[str, Faults] = {}


def hooks() -> NoFaults:
    """This process's fault hooks: :data:`NO_FAULTS` unless ``HSX_FAULTS`` is set (then one
    :class:`Faults` per spec, so that counted faults count across the process's batches).

    Raises:
        BadConfig: ``HSX_FAULTS`` has an unknown entry or a value that is not a number.
    """
    spec = os.environ.get(ENV, "").strip()
    if not spec:
        return NO_FAULTS
    with _lock:
        if spec not in _by_spec:
            _by_spec[spec] = Faults(spec)
        return _by_spec[spec]


def reset() -> None:
    """Forget how many counted faults each spec has injected (for tests running several in one process)."""
    with _lock:
        _by_spec.clear()
