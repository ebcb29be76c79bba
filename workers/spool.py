"""Host buffers and the spool: where a batch's states wait when the store does not take them at once.

A batch's states land in one of the process's pinned host buffers (:class:`HostBufferPool`,
``HSX_WORKER_CONCURRENCY`` of them) and go from there straight into the store
(``Store.write_stream``: serialised, hashed beside the write, written once). The spool is an
**overflow**, not a hop: only when that write fails for a transient reason (the store is slow to
answer, down, throttling) is the shard written to the spool (one pass, hashed beside the write,
:func:`write_shard`), its host buffer freed for the next forward, and the spool file stored with
retries from there. A worker therefore keeps extracting through a store outage until its overflow
is full: ``HSX_MAX_PENDING_UPLOADS`` shards in the spool, or the spool's filesystem at
``HSX_SPOOL_MAX_FRACTION``. Then a shard stays in its host buffer and is retried from memory, and
once every host buffer holds such a shard the next forward waits (backpressure: the GPU pauses
only when the overflow is full). A shard that could never fit in the spool fails at once with
:class:`SpoolFull` when it would need it.

Spool files are named ``hsx-<pid>-<run>-<batch>-<attempt>.safetensors``; files of processes that
no longer exist (a worker killed with SIGKILL) are removed when the next worker process on the
machine opens the spool.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hsx.processes import pid_alive
from hsx.store import Sha256Beside
from hsx.errors import SpoolFull
from settings import Settings

log = logging.getLogger(__name__)

#: /dev/shm is the default spool when it has at least this much free space (bytes): shards never
#: touch a disk between the GPU and the store. Below it (containers give 64 MiB), a temp dir.
SHM_MIN_FREE_BYTES = 8 << 30
SHM_DIR = Path("/dev/shm")
#: seconds between two checks of the spool while a batch waits to be admitted.
ADMIT_POLL_S = 0.25
_NAME = re.compile(r"^hsx-(\d+)-.*\.safetensors$")


def default_spool_dir(shm: Path = SHM_DIR, min_free_bytes: int = SHM_MIN_FREE_BYTES) -> Path:
    """``/dev/shm/hsx-spool`` when /dev/shm is a writable directory with ``min_free_bytes`` free, else ``<tmp>/hsx-spool``."""
    try:
        if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) and shutil.disk_usage(shm).free >= min_free_bytes:
            return shm / "hsx-spool"
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / "hsx-spool"


def spool_dir(settings: Settings) -> Path:
    """The worker's spool directory (``HSX_SPOOL_DIR``, else :func:`default_spool_dir`), created if needed."""
    d = settings.spool_dir or default_spool_dir()
    d.mkdir(parents=True, exist_ok=True)
    return d


def spool_file_name(run_id: str, batch: str, attempt: str) -> str:
    """The spool file of one attempt: ``hsx-<pid>-<run>-<batch>-<attempt>.safetensors``."""
    return f"hsx-{os.getpid()}-{run_id}-{batch}-{attempt}.safetensors"


def remove_dead_spool_files(directory: Path) -> list[Path]:
    """Delete spool files whose writing process is gone (a worker killed mid-batch); returns them."""
    removed = []
    for path in directory.glob("hsx-*.safetensors"):
        m = _NAME.match(path.name)
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path)
    if removed:
        log.info("spool %s: removed %d files of dead worker processes", directory, len(removed))
    return removed


@dataclass
class SpoolUsage:
    """The spool filesystem as the gate sees it (bytes)."""

    directory: str
    used_bytes: int
    total_bytes: int
    reserved_bytes: int
    """Bytes promised to admitted batches whose shard is not fully written yet."""
    uploads_pending: int
    """Shards of this process in the spool (or being written there) and not yet stored."""

    @property
    def used_fraction(self) -> float:
        return self.used_bytes / self.total_bytes if self.total_bytes else 1.0

    def as_dict(self) -> dict:
        return {"dir": self.directory, "used_bytes": self.used_bytes, "total_bytes": self.total_bytes,
                "reserved_bytes": self.reserved_bytes, "used_fraction": round(self.used_fraction, 4),
                "uploads_pending": self.uploads_pending}


class Spool:
    """One worker process's overflow spool: room for shards the store has not taken yet.

    Thread-safe; every task thread of the process shares it. A shard whose direct store write
    failed asks :meth:`try_admit` (never waits); with a :class:`Ticket` it is written to the spool
    (:meth:`Ticket.written`) and stored from there, then :meth:`Ticket.release`. Without one (the
    overflow is full) it stays in its host buffer.
    """

    def __init__(self, directory: Path, *, max_fraction: float = 0.8, max_pending_uploads: int = 2,
                 disk_usage: Callable[[Path], object] = shutil.disk_usage):
        self.directory = Path(directory)
        self.max_fraction = max_fraction
        self.max_pending_uploads = max_pending_uploads
        self._disk_usage = disk_usage
        self._lock = threading.Condition()
        self._reserved = 0
        self._uploads = 0
        self.paused_reason: str | None = None
        """Why the next forward is waiting (the overflow is full and every host buffer holds a shard
        the store has not taken), or None when nothing waits (for status)."""
        self.paused_since: float | None = None

    def usage(self) -> SpoolUsage:
        """Current usage of the spool's filesystem and this process's reservations."""
        du = self._disk_usage(self.directory)
        with self._lock:
            return SpoolUsage(str(self.directory), int(du.used), int(du.total), self._reserved, self._uploads)

    def _blocked(self, expected_bytes: int) -> str | None:
        """Why a shard of ``expected_bytes`` cannot go to the spool now, or None. Caller holds the lock."""
        if self._uploads >= self.max_pending_uploads:
            return f"{self._uploads} shards waiting in the spool to be stored (limit {self.max_pending_uploads}, HSX_MAX_PENDING_UPLOADS)"
        du = self._disk_usage(self.directory)
        limit = self.max_fraction * du.total
        if du.used + self._reserved + expected_bytes > limit:
            return (f"spool {100 * du.used / du.total:.0f}% full, {100 * (du.used + self._reserved + expected_bytes) / du.total:.0f}% "
                    f"with the shards in flight (limit {100 * self.max_fraction:.0f}%, HSX_SPOOL_MAX_FRACTION) in {self.directory}")
        return None

    def full_reason(self, expected_bytes: int) -> str | None:
        """Why the overflow could not take a shard of ``expected_bytes`` now (None: it could)."""
        with self._lock:
            return self._blocked(expected_bytes)

    def try_admit(self, expected_bytes: int, what: str = "batch") -> "Ticket | None":
        """Reserve room for a shard of ``expected_bytes`` if the overflow has it now; never waits.

        Returns a :class:`Ticket`, or None when ``HSX_MAX_PENDING_UPLOADS`` shards already wait in
        the spool or its filesystem would pass ``max_fraction`` with this shard in it.

        Raises:
            SpoolFull: the shard is bigger than ``max_fraction`` of the spool's filesystem, so it
                could never be admitted.
        """
        total = int(self._disk_usage(self.directory).total)
        if expected_bytes > self.max_fraction * total:
            raise SpoolFull(
                f"{what}: its shard needs {expected_bytes / 1e6:,.1f} MB but the spool {self.directory} may hold at most "
                f"{self.max_fraction * total / 1e6:,.1f} MB ({100 * self.max_fraction:.0f}% of {total / 1e6:,.1f} MB). "
                "Fix: point HSX_SPOOL_DIR at a bigger filesystem, raise HSX_SPOOL_MAX_FRACTION, or plan smaller batches (--batch-tokens)"
            )
        with self._lock:
            reason = self._blocked(expected_bytes)
            if reason is not None:
                log.info("%s stays in host memory: the overflow is full (%s)", what, reason)
                return None
            self._reserved += expected_bytes
            self._uploads += 1
        return Ticket(self, expected_bytes)

    def _update(self, reserved: int = 0, uploads: int = 0) -> None:
        with self._lock:
            self._reserved += reserved
            self._uploads += uploads
            self._lock.notify_all()


class Ticket:
    """One shard's claim on the spool (see :class:`Spool`). Idempotent steps."""

    def __init__(self, spool: Spool, expected_bytes: int):
        self.spool = spool
        self.expected_bytes = expected_bytes
        self._written = self._released = False

    def written(self) -> None:
        """The spool file is complete: its bytes are in the filesystem's usage, not in the reservation."""
        if not self._written and not self._released:
            self._written = True
            self.spool._update(reserved=-self.expected_bytes)

    def release(self) -> None:
        """The shard is stored (or the batch failed) and its spool file deleted."""
        if self._released:
            return
        self._released = True
        self.spool._update(reserved=0 if self._written else -self.expected_bytes, uploads=-1)


class HostBufferPool:
    """The process's pinned host buffers (``HSX_WORKER_CONCURRENCY`` of them) that a batch's states
    are copied into from the GPU and written to the store from.

    A batch takes one before its forward (:meth:`acquire`, waiting while every buffer holds a shard
    the store has not taken: the GPU's backpressure) and gives it back once its shard is in the
    store or in the spool (:meth:`release`). Thread-safe.
    """

    def __init__(self, size: int):
        from workers.capture import HostBuffer

        self.size = size
        self._free = [HostBuffer() for _ in range(size)]
        self._cond = threading.Condition()

    def acquire(self, on_wait: Callable[[], None] | None = None, poll_s: float = ADMIT_POLL_S):
        """A free :class:`workers.capture.HostBuffer`; ``on_wait()`` is called every ``poll_s``
        seconds while none is free (the caller says why in the worker's status)."""
        with self._cond:
            while not self._free:
                if on_wait is not None:
                    on_wait()
                self._cond.wait(poll_s)
            return self._free.pop()

    def release(self, buffer) -> None:
        """Give ``buffer`` back (its tensors may be overwritten by the next batch from now on)."""
        with self._cond:
            self._free.append(buffer)
            self._cond.notify()

    @property
    def free(self) -> int:
        with self._cond:
            return len(self._free)


_spools: dict[tuple, Spool] = {}
_spools_lock = threading.Lock()


_pools: dict[int, HostBufferPool] = {}


def process_host_buffers(settings: Settings) -> HostBufferPool:
    """This process's :class:`HostBufferPool` of ``HSX_WORKER_CONCURRENCY`` buffers."""
    with _spools_lock:
        if settings.worker_concurrency not in _pools:
            _pools[settings.worker_concurrency] = HostBufferPool(settings.worker_concurrency)
        return _pools[settings.worker_concurrency]


def process_spool(settings: Settings) -> Spool:
    """This process's :class:`Spool` for ``settings`` (created on first use, when it also removes
    the files of dead worker processes)."""
    key = (str(settings.spool_dir), settings.spool_max_fraction, settings.max_pending_uploads)
    with _spools_lock:
        if key not in _spools:
            d = spool_dir(settings)
            remove_dead_spool_files(d)
            _spools[key] = Spool(d, max_fraction=settings.spool_max_fraction, max_pending_uploads=settings.max_pending_uploads)
        return _spools[key]


def spool_full_error(path: Path, exc: OSError, nbytes_expected: int) -> SpoolFull:
    """The error for a shard write that ran out of space (ENOSPC / EDQUOT), with the numbers."""
    try:
        du = shutil.disk_usage(path.parent)
        room = f"{du.free / 1e6:,.1f} MB free of {du.total / 1e6:,.1f} MB"
    except OSError:
        room = "free space unknown"
    return SpoolFull(
        f"the spool {path.parent} is full ({exc.strerror or exc}) writing {path.name} ({nbytes_expected / 1e6:,.1f} MB; {room}). "
        "No marker was written; the batch is done again later (redelivery or `producer reconcile`). Fix: free space there, "
        "point HSX_SPOOL_DIR at a bigger filesystem, or lower HSX_SPOOL_MAX_FRACTION if something else shares it"
    )


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is an out-of-space error (ENOSPC, EDQUOT, EFBIG)."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def write_shard(path: Path, pieces) -> tuple[int, str]:
    """Write a serialised shard (:func:`hsx.shard.serialize_shard`'s pieces) to ``path``; return
    (bytes, sha256 hex), the hash computed beside the write over the same buffers.

    Raises ``OSError`` when the spool is full or unwritable.
    """
    sha = Sha256Beside()
    try:
        with open(path, "wb") as f:
            for piece in pieces:
                sha.update(piece)
                f.write(piece)
    finally:
        digest = sha.hexdigest()
    return sha.nbytes, digest
