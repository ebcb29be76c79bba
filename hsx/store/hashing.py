"""SHA-256 of files and of streamed buffers, as the stores and the worker's spool compute them."""

from __future__ import annotations

import hashlib
import queue
import threading
from pathlib import Path

#: bytes read per step when hashing or copying a file (1 MiB).
CHUNK_BYTES = 1 << 20


def sha256_file(path: Path) -> tuple[int, str]:
    """(bytes, sha256 hex) of a file, read in ``CHUNK_BYTES`` steps (never whole in memory).

    Raises ``OSError`` (``FileNotFoundError``...) as ``open`` does: this reads a file, not a store."""
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
            n += len(chunk)
    return n, h.hexdigest()


class Sha256Beside:
    """The sha256 of a stream of buffers, computed in a second thread while the caller writes them.

    ``update(buf)`` hands ``buf`` (not a copy) to the hashing thread; both threads release the GIL
    on large buffers (hashlib, file and socket writes), so a shard costs max(write, hash), not
    their sum. ``hexdigest()`` waits for the thread. The caller must not modify a buffer before
    ``hexdigest()`` returns.
    """

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.nbytes = 0
        self._thread = threading.Thread(target=self._run, name="sha256-beside", daemon=True)
        self._thread.start()
        self._digest: str | None = None

    def _run(self) -> None:
        while (buf := self._queue.get()) is not None:
            self._sha.update(buf)

    def update(self, buf) -> None:
        self._queue.put(buf)
        self.nbytes += len(buf)

    def hexdigest(self) -> str:
        if self._digest is None:
            self._queue.put(None)
            self._thread.join()
            self._digest = self._sha.hexdigest()
        return self._digest
