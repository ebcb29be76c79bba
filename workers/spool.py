"""The spool: where a worker writes a shard before it is stored.

Shards are written in the safetensors format by a streaming writer that hashes the bytes as they
go out, so that a shard is read from memory exactly once: no serialised copy in RAM (as
``safetensors.torch.save_file`` makes) and no second pass to compute its sha256. The format
(8-byte little-endian header length, JSON header with ``dtype``/``shape``/``data_offsets`` and
``__metadata__``, then the raw little-endian bytes with no holes) is the one documented by the
safetensors project; tests check that ``safetensors.safe_open`` reads our files back bit for bit.

Backpressure (:class:`Spool`): before its forward (holding the GPU lock, so the check is made by
the batch that runs next) a batch is admitted by the process's spool, which waits while the
spool's filesystem would be fuller than ``HSX_SPOOL_MAX_FRACTION``
with the batch's shard in it (its size is known from the plan before the forward), or while
``HSX_MAX_PENDING_UPLOADS`` shards of this process wait to be stored. Extraction therefore stops
when the store is slow or down, and resumes as the shards already written are stored; the spool
never fills its disk. A shard that could never fit fails at once with :class:`SpoolFull`.

Spool files are named ``hsx-<pid>-<run>-<batch>-<attempt>.safetensors``; files of processes that
no longer exist (a worker killed with SIGKILL) are removed when the next worker process on the
machine opens the spool.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from core.processes import pid_alive
from core.errors import SpoolFull
from settings import Settings

log = logging.getLogger(__name__)

_DTYPE_NAMES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_CHUNK_BYTES = 64 << 20  # 64 MiB: large writes, bounded time with the GIL released per call


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
    """Shards of this process past their forward and not yet stored and verified."""

    @property
    def used_fraction(self) -> float:
        return self.used_bytes / self.total_bytes if self.total_bytes else 1.0

    def as_dict(self) -> dict:
        return {"dir": self.directory, "used_bytes": self.used_bytes, "total_bytes": self.total_bytes,
                "reserved_bytes": self.reserved_bytes, "used_fraction": round(self.used_fraction, 4),
                "uploads_pending": self.uploads_pending}


class Spool:
    """One worker process's spool: the backpressure gate and the count of shards waiting to be stored.

    Thread-safe; every task thread of the process shares it. A batch goes through
    :meth:`admit` (blocks while the spool is too full or too many uploads are pending) ->
    :meth:`Ticket.forward_done` -> :meth:`Ticket.written` -> :meth:`Ticket.release`.
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
        """Why the last batch to ask is waiting, or None when nobody waits (for status)."""
        self.paused_since: float | None = None

    def usage(self) -> SpoolUsage:
        """Current usage of the spool's filesystem and this process's reservations."""
        du = self._disk_usage(self.directory)
        with self._lock:
            return SpoolUsage(str(self.directory), int(du.used), int(du.total), self._reserved, self._uploads)

    def _blocked(self, expected_bytes: int) -> str | None:
        """Why a shard of ``expected_bytes`` cannot be admitted now, or None. Caller holds the lock."""
        if self._uploads >= self.max_pending_uploads:
            return f"{self._uploads} shards waiting to be stored (limit {self.max_pending_uploads}, HSX_MAX_PENDING_UPLOADS)"
        du = self._disk_usage(self.directory)
        limit = self.max_fraction * du.total
        if du.used + self._reserved + expected_bytes > limit:
            return (f"spool {100 * du.used / du.total:.0f}% full, {100 * (du.used + self._reserved + expected_bytes) / du.total:.0f}% "
                    f"with the shards in flight (limit {100 * self.max_fraction:.0f}%, HSX_SPOOL_MAX_FRACTION) in {self.directory}")
        return None

    def admit(self, expected_bytes: int, what: str = "batch", on_wait: Callable[[str | None], None] | None = None,
              poll_s: float = ADMIT_POLL_S) -> "Ticket":
        """Wait until a shard of ``expected_bytes`` may be written, then reserve its space.

        ``on_wait(reason)`` is called when the wait starts (with why) and when it ends (None).

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
        waited = None
        with self._lock:
            while (reason := self._blocked(expected_bytes)) is not None:
                if waited is None:
                    waited = time.monotonic()
                    self.paused_reason, self.paused_since = reason, time.time()
                    log.warning("%s paused before the forward: %s", what, reason)
                    if on_wait:
                        on_wait(reason)
                elif reason != self.paused_reason:
                    self.paused_reason = reason
                self._lock.wait(poll_s)
            self._reserved += expected_bytes
            if waited is not None:
                self.paused_reason = self.paused_since = None
                log.info("%s resumed after %.1f s paused", what, time.monotonic() - waited)
        if waited is not None and on_wait:
            on_wait(None)
        return Ticket(self, expected_bytes)

    def _update(self, reserved: int = 0, uploads: int = 0) -> None:
        with self._lock:
            self._reserved += reserved
            self._uploads += uploads
            self._lock.notify_all()


class Ticket:
    """One admitted batch's claim on the spool (see :class:`Spool`). Idempotent steps."""

    def __init__(self, spool: Spool, expected_bytes: int):
        self.spool = spool
        self.expected_bytes = expected_bytes
        self._forward_done = self._written = self._released = False

    def forward_done(self) -> None:
        """The forward is over: the shard now counts as an upload pending."""
        if not self._forward_done and not self._released:
            self._forward_done = True
            self.spool._update(uploads=1)

    def written(self) -> None:
        """The shard file is complete: its bytes are in the filesystem's usage, not in the reservation."""
        if not self._written and not self._released:
            self._written = True
            self.spool._update(reserved=-self.expected_bytes)

    def release(self) -> None:
        """The shard is stored (or the batch failed) and its spool file deleted."""
        if self._released:
            return
        self._released = True
        self.spool._update(reserved=0 if self._written else -self.expected_bytes,
                           uploads=-1 if self._forward_done else 0)


_spools: dict[tuple, Spool] = {}
_spools_lock = threading.Lock()


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


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_shard(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[int, str]:
    """Write ``tensors`` (CPU, any shapes) as a safetensors file; return (bytes, sha256 hex).

    Tensors are laid out largest element size first, then by name (as safetensors does), so each
    one starts aligned to its element size. Raises ``OSError`` when the spool is full or unwritable.
    """
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict = {"__metadata__": dict(metadata)}
    offset = 0
    for name in order:
        t = tensors[name]
        if t.device.type != "cpu":
            raise ValueError(f"tensor {name} is on {t.device}; the spool writes host tensors")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # data starts 8-byte aligned
    pieces = [memoryview(struct.pack("<Q", len(head))), memoryview(head)]
    for name in order:
        raw = _raw_bytes(tensors[name])
        pieces += [raw[start : start + _CHUNK_BYTES] for start in range(0, len(raw), _CHUNK_BYTES)]
    # The hash runs in a second thread over the same host memory while this one writes: both
    # release the GIL per chunk, so a shard costs max(write, hash) instead of their sum.
    sha = hashlib.sha256()
    hasher = threading.Thread(target=lambda: [sha.update(piece) for piece in pieces], name="shard-sha256", daemon=True)
    hasher.start()
    total = 0
    try:
        with open(path, "wb") as f:
            for piece in pieces:
                f.write(piece)
                total += len(piece)
    finally:
        hasher.join()
    return total, sha.hexdigest()
