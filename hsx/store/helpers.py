"""Operations built from the Store Protocol's members: they work on every store, and no backend
implements them itself.

- :func:`exists`: ``size`` is not None.
- :func:`write_file`: a local file (the worker's spool copy of a shard) through ``write_stream``,
  checked against the sha256 it was written with.
- :func:`verify`: ``size`` and ``sha256`` against what a marker says.
- :func:`download`: an object to a local file through ``read_range``, ranges in parallel, each
  retried on a transient error.
"""

from __future__ import annotations

import hashlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

from hsx.errors import FidelityError, StoreError
from hsx.store.protocol import MissingKey, Store
from hsx.store.retry import retry_transient

#: bytes read from a file per piece handed to ``write_stream`` by :func:`write_file` (8 MiB).
FILE_PIECE_BYTES = 8 << 20
#: bytes per ranged read of :func:`download` (8 MiB, as boto3's managed download).
DOWNLOAD_PART_BYTES = 8 << 20
#: ranged reads of one :func:`download` in flight at once (memory: this many parts).
DOWNLOAD_THREADS = 8


def exists(store: Store, key: str) -> bool:
    """Whether ``key`` is an object in ``store`` (one ``size``: a HEAD on S3, a stat locally).

    Raises BadConfig for a bad key, StoreError when the store cannot answer."""
    return store.size(key) is not None


def _file_pieces(path: Path, piece_bytes: int, key: str) -> Iterator[memoryview]:
    """The file's bytes in pieces; an OSError reading it is the file's fault, not the store's: a
    non-transient StoreError (a backend would take a bare OSError mid-upload for a network error)."""
    try:
        with open(path, "rb") as f:
            while chunk := f.read(piece_bytes):
                yield memoryview(chunk)
    except OSError as e:
        raise StoreError(f"store {key!r} from {path}: cannot read the file: {e}") from e


def write_file(store: Store, key: str, path: Path, sha256_hex: str | None = None) -> tuple[int, str]:
    """Store the local file ``path`` under ``key`` (overwrite, atomic for readers); return (bytes, sha256 hex).

    The file is read once, in ``FILE_PIECE_BYTES`` pieces, into :meth:`Store.write_stream` (on S3 a
    multipart upload whose parts the server checks). ``sha256_hex``, when given, is the sha256 the
    file was written with (the spool's): bytes that changed on disk since then are caught here.
    The source file is left in place.

    Raises:
        FidelityError: the stored bytes' sha256 is not ``sha256_hex``; the object is deleted first
            (it is a shard no marker names yet) and the message names both digests.
        StoreError: the store refused the write or could not be reached (``transient`` for what a
            retry may fix); a ``path`` that cannot be read is a non-transient StoreError.
    """
    nbytes, digest = store.write_stream(key, _file_pieces(Path(path), FILE_PIECE_BYTES, key))
    if sha256_hex is not None and digest != sha256_hex.lower():
        store.delete(key)
        raise FidelityError(
            f"{key!r} in {store.url} from {path}: the file's bytes hash to {digest} ({nbytes} bytes), but it was written "
            f"with sha256 {sha256_hex}: it changed on disk since; the object was deleted. Fix: write the shard again"
        )
    return nbytes, digest


def verify(store: Store, key: str, nbytes: int, sha256_hex: str) -> None:
    """Check that ``key`` holds ``nbytes`` bytes whose sha256 is ``sha256_hex``: one ``size``, then one
    streamed ``sha256`` (skipped when the size already differs).

    Raises:
        FidelityError: absent, another size, or another sha256; the message names the key, both
            values and the fix (rewrite it).
        StoreError: the store could not be read (``transient`` for a network error): not a verdict
            on the object.
    """
    size = store.size(key)
    if size is None:
        raise FidelityError(f"{key!r} in {store.url}: absent, expected {nbytes} bytes; rewrite it")
    if size != nbytes:
        raise FidelityError(f"{key!r} in {store.url}: {size} bytes, expected {nbytes}; rewrite it")
    try:
        n, digest = store.sha256(key)
    except MissingKey:
        raise FidelityError(f"{key!r} in {store.url}: vanished during verify; rewrite it") from None
    if n != nbytes or digest != sha256_hex.lower():
        raise FidelityError(
            f"{key!r} in {store.url}: sha256 {digest} ({n} bytes), expected {sha256_hex} ({nbytes} bytes); rewrite it"
        )


def download(store: Store, key: str, path: Path, *, retry_s: float = 0.0, part_bytes: int = DOWNLOAD_PART_BYTES,
             threads: int = DOWNLOAD_THREADS) -> tuple[int, str]:
    """Copy object ``key`` to the local file ``path`` (created or truncated); return (bytes, sha256 hex) of what was written.

    One ``size``, then ``part_bytes`` ranges read ``threads`` at a time with :meth:`Store.read_range`, each call retried
    on a transient StoreError for up to ``retry_s`` seconds (:func:`~hsx.store.retry.retry_transient`),
    and written and hashed in order, so that the object is never whole in memory (at most
    ``threads`` parts) and the sha256 costs no second read.

    Raises:
        MissingKey: ``key`` is absent (or was deleted while it was read).
        FidelityError: the object changed size while it was read (another writer replaced it).
        StoreError: a range still failing after the retries, or a non-transient store error.
        OSError: ``path`` cannot be written.
    """
    size = retry_transient(lambda: store.size(key), f"download {key}: its size", total_s=retry_s)
    if size is None:
        raise MissingKey(f"{key!r} not found in {store.url}")
    offsets = range(0, size, part_bytes)

    def part(offset: int) -> bytes:
        length = min(part_bytes, size - offset)
        data = retry_transient(lambda: store.read_range(key, offset, length), f"download {key} [{offset}, +{length})",
                               total_s=retry_s)
        if len(data) != length:
            raise FidelityError(f"{key!r} in {store.url}: {len(data)} bytes at offset {offset}, expected {length} of "
                                f"{size}: the object changed while it was downloaded; read it again")
        return data

    sha = hashlib.sha256()
    with open(path, "wb") as f, ThreadPoolExecutor(max(1, threads), thread_name_prefix="download") as pool:
        in_flight: deque = deque()
        try:
            for offset in offsets:
                in_flight.append(pool.submit(part, offset))
                if len(in_flight) >= threads:
                    data = in_flight.popleft().result()
                    sha.update(data)
                    f.write(data)
            while in_flight:
                data = in_flight.popleft().result()
                sha.update(data)
                f.write(data)
        finally:  # an error: the parts not yet started are not read
            for fut in in_flight:
                fut.cancel()
    return size, sha.hexdigest()
