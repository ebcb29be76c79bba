"""The Store Protocol: what a run's storage must do, and the rules every backend keeps.

Keys are ``str``, ``/``-separated and relative to the store root (``run.json``,
``markers/00012.json``), never OS paths: the same key means the same object on a local directory
(:mod:`hsx.store.local`) and on S3 (:mod:`hsx.store.s3`), and a run is just
``store.child(run_id)``. Keys cannot escape the root (:func:`check_key`).

The guarantees the marker protocol needs (README.md, "Output"):

- ``write`` and ``write_stream`` replace an object atomically for readers: a reader sees the old
  bytes or the new bytes, never a torn object (local: temp file + ``os.replace``; S3: a PUT or a
  completed multipart upload is atomic).
- ``create`` is create-if-absent across processes and machines: of N racing creators exactly one
  gets ``True`` (local: ``os.link`` of a complete temp file; S3: ``If-None-Match: *``).
- ``write_stream`` returns the (bytes, sha256) of exactly what was stored, so that nothing needs
  reading back to certify a shard.

Errors, the same on every backend and every member (``workers/causes.py`` acts on them):

- :class:`MissingKey` (a ``KeyError``): ``read``, ``read_range`` and ``sha256`` of an absent key.
  Absence is an answer, not a failure: ``size`` returns None, ``delete`` does nothing.
- :class:`~hsx.errors.BadConfig`: a key or prefix that breaks :func:`check_key`; raised before
  any I/O.
- :class:`~hsx.errors.StoreError` with ``transient=True``: trying again later may succeed (no
  answer, connection refused or reset, a timeout, a body cut short, throttling, HTTP 5xx, a
  conditional create whose outcome never settled). Callers retry these with
  :func:`hsx.store.retry.retry_transient` for up to ``HSX_STORE_RETRY_S``; a worker then puts the
  task back on the queue (cause ``transient``).
- :class:`~hsx.errors.StoreError` with ``transient=False``: a retry cannot fix it (credentials
  refused, no such bucket, HTTP 400 such as a checksum the server refused, a local disk error).
  A worker stops taking tasks (cause ``permanent``), except for a full disk (ENOSPC in the
  error's chain), which is waited for.
- :class:`~hsx.errors.FidelityError` from ``write_stream`` only: the backend reports other bytes
  than were sent (S3: a completed upload's composite SHA-256 that is not the parts'). The object
  must not be certified.

Nothing else escapes a member (but what ``write_stream``'s own ``pieces`` raise): no ``OSError``,
no botocore exception. That is what lets a caller tell "the store did not answer" (retry) from
"this batch's data is wrong" (repair): a caller that went around the store to a raw client once
took an S3 timeout for a bad shard.

Operations that a backend need not implement itself (``exists``, ``write_file``, ``verify``,
``download``) are functions over these members in :mod:`hsx.store.helpers`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Protocol, runtime_checkable

from hsx.errors import BadConfig
from hsx.storeurl import StoreURL

#: errnos of a full disk or quota: the store raises :class:`hsx.errors.StoreFull` for them.
DISK_FULL_ERRNOS = frozenset({28, 122})  # ENOSPC, EDQUOT (Linux)
#: S3 answers of a store with no room: codes of MinIO, Ceph RGW and others, and HTTP 507.
S3_FULL_CODES = frozenset({"QuotaExceeded", "XMinioStorageFull", "XMinioAdminBucketQuotaExceeded", "InsufficientStorage",
                           "StorageFull"})

#: local temp files start with this; they are never listed and no key segment may start with it.
TMP_PREFIX = ".hsx-tmp-"


class MissingKey(KeyError):
    """The key does not exist in the store (``read``, ``read_range`` or ``sha256`` of an absent object)."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else "missing key"


@runtime_checkable
class Store(Protocol):
    """A flat key -> bytes store with create-if-absent; keys are ``/``-separated ``str``.

    ``str`` keys (not ``Path``) because the same key must address a file and an S3 object.
    Every member raises :class:`~hsx.errors.BadConfig` for a key that breaks :func:`check_key`
    and :class:`~hsx.errors.StoreError` (``transient`` or not, see the module docstring) when the
    backend refuses or cannot be reached after its own retries.
    """

    url: str
    """Display URL (credentials masked): safe to log."""

    location: StoreURL
    """Where the store lives, typed: ``location.is_s3`` (objects in a bucket: no file to map, a
    request per call) or ``location.is_local`` (files under ``location.path``)."""

    # --- whole objects ---------------------------------------------------------------------

    def read(self, key: str) -> bytes:
        """The whole object. Raises :class:`MissingKey` if it is absent."""
        ...

    def write(self, key: str, data: bytes) -> None:
        """Create or overwrite ``key``; readers see the old or the new bytes, never a mix."""
        ...

    def create(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if absent: True if this call created it, False if it existed.

        False is a settled outcome only: another writer's object is there. When the backend cannot
        say (S3: 409 ConditionalRequestConflict that never settles), this raises
        :class:`~hsx.errors.StoreError` with ``transient=True``, never False.
        """
        ...

    def delete(self, key: str) -> None:
        """Remove ``key``; no error if it is absent."""
        ...

    # --- big objects (shards) -------------------------------------------------------------------

    def write_stream(self, key: str, pieces: Iterable[memoryview]) -> tuple[int, str]:
        """Store the concatenation of ``pieces`` under ``key`` in one pass; return (bytes, sha256 hex).

        The sha256 is computed over the very buffers that are written, beside the write, so the
        bytes cross host memory once after they were produced. When this returns, the object is
        complete and durable, and it holds exactly those bytes: local, written, fsynced and renamed
        into place; S3, a multipart upload whose every part the server checked against its
        SHA-256. Nothing needs reading back. Readers see the old object or the new one, never a
        part. ``pieces`` is consumed once; its buffers must not change until this returns. When
        ``pieces`` raises, the exception propagates and nothing is left under ``key`` or behind it
        (no temp file, no open upload).
        """
        ...

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` of ``key`` (fewer at the end of the object, ``b""`` past
        it or for ``length`` 0). Raises :class:`MissingKey` if it is absent."""
        ...

    def sha256(self, key: str) -> tuple[int, str]:
        """(bytes, sha256 hex) of ``key``'s stored bytes, streamed (never whole in memory).
        Raises :class:`MissingKey` if it is absent; :class:`~hsx.errors.StoreError` (``transient``
        for a network error) if it cannot be read to the end."""
        ...

    def size(self, key: str) -> int | None:
        """Size of ``key`` in bytes, or None if absent (a local directory is not a key)."""
        ...

    def local_path(self, key: str) -> Path | None:
        """A filesystem path of ``key`` that readers may memory-map, or None where objects are not files (S3).

        Why it is a member: the map-style reader (``hsx/reader.py``) reads one sample's rows of a
        10 GB shard through an mmap, which needs a file; every other caller reads through the
        members above, on any backend.
        """
        ...

    # --- listings and upkeep ----------------------------------------------------------------------

    def list(self, prefix: str = "") -> list[str]:
        """Every key that starts with ``prefix`` (recursive, string prefix like S3), sorted."""
        ...

    def list_modified(self, prefix: str = "") -> dict[str, float]:
        """``{key: last-modified time (Unix seconds)}`` of every key starting with ``prefix``.

        ``producer reconcile`` deletes a shard no marker names only once it is older than a grace
        period: younger, a worker may be about to write its marker."""
        ...

    def remove_incomplete(self, prefix: str = "", older_than_s: float = 3600.0) -> list[str]:
        """Remove unfinished writes under ``prefix`` older than ``older_than_s`` seconds (S3:
        multipart uploads never completed, with their parts; local: temp files of writers that
        died). Returns what was removed, for the report. A worker killed mid-``write_stream``
        leaves these behind; nothing else can see them (they are never listed)."""
        ...

    # --- the store itself -------------------------------------------------------------------------

    def child(self, prefix: str) -> "Store":
        """A store rooted at ``root/prefix`` (a run is ``store.child(run_id)``)."""
        ...

    # Not a member: ``check`` (the probe), which only ``open_store`` calls, on the backend it built.


# --- keys ---------------------------------------------------------------------------------------


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid relative key, else raise :class:`~hsx.errors.BadConfig`.

    Rule: non-empty ``/``-separated segments, none ``.`` or ``..``, no leading ``/``, no
    backslash or NUL, no segment starting with the temp-file prefix (:data:`TMP_PREFIX`).
    """
    if not isinstance(key, str) or not key:
        raise BadConfig(f"store key {key!r} is invalid: a key is a non-empty str like 'markers/00001.json'")
    if key.startswith("/") or "\\" in key or "\x00" in key:
        raise BadConfig(f"store key {key!r} is invalid: keys are relative, '/'-separated, no '\\' or NUL")
    for seg in key.split("/"):
        if seg in ("", ".", ".."):
            raise BadConfig(
                f"store key {key!r} is invalid: segment {seg!r} is not allowed "
                "(no empty, '.' or '..' segments: keys must stay inside the store root)"
            )
        if seg.startswith(TMP_PREFIX):
            raise BadConfig(f"store key {key!r} is invalid: segments may not start with {TMP_PREFIX!r}")
    return key


def check_prefix(prefix: str) -> str:
    """Return a list prefix if valid: ``''`` (everything), or a string prefix whose complete
    segments pass :func:`check_key`; else raise :class:`~hsx.errors.BadConfig`."""
    if prefix == "":
        return prefix
    head, _, last = prefix.rpartition("/")
    if head:
        check_key(head)
    elif prefix.startswith("/"):
        raise BadConfig(f"store prefix {prefix!r} is invalid: prefixes are relative")
    if last in (".", ".."):
        check_key(prefix)
    return prefix
