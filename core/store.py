"""Where runs live: a local directory or an S3 bucket, behind one small Protocol.

Keys are ``str``, ``/``-separated and relative to the store root (``run.json``,
``markers/00012.json``), never OS paths: the same key means the same object on both backends,
and a run is just ``store.child(run_id)``. Keys cannot escape the root (no ``..``, no leading
``/``, no empty segment).

Both stores give the guarantees the marker protocol needs (DESIGN.md, "Store layout"):

- ``write`` replaces an object atomically for readers: a reader sees the old bytes or the new
  bytes, never a torn file (local: temp file + ``os.replace``; S3: a PUT is atomic).
- ``create`` is create-if-absent across processes and machines: of N racing creators exactly one
  gets ``True`` (local: ``os.link`` of a complete temp file; S3: ``If-None-Match: *``).

:func:`open_store` turns a URL into a store and probes it once (:meth:`Store.check`), so a wrong
endpoint, bucket or credential fails in seconds with :class:`~core.errors.StoreError` rather than
after a model has loaded.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import os
import queue
import re
import shutil
import stat
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Protocol, runtime_checkable
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from core.errors import BadConfig, FidelityError, StoreError

if TYPE_CHECKING:
    from settings import Settings

#: bytes read per step when hashing or copying a file (1 MiB).
CHUNK_BYTES = 1 << 20
#: objects at least this big are uploaded in parts, each this big (64 MiB).
MULTIPART_BYTES = 64 << 20
#: parallel part uploads of one big object.
MULTIPART_CONCURRENCY = 8
#: S3 connect / read timeouts of ordinary calls (seconds); retries are botocore's "adaptive" mode,
#: few of them: a worker's own retries (``core/retry.py``, ``HSX_STORE_RETRY_S``) ride out long
#: outages, and a shard the store does not take within seconds goes to the overflow spool.
S3_CONNECT_TIMEOUT_S = 10
S3_READ_TIMEOUT_S = 120
S3_MAX_ATTEMPTS = 3
#: the probe at open: short timeouts and few attempts, so a bad endpoint fails in seconds.
PROBE_CONNECT_TIMEOUT_S = 3
PROBE_READ_TIMEOUT_S = 5
PROBE_MAX_ATTEMPTS = 2
#: a 409 ConditionalRequestConflict (AWS: another conditional write is in flight) is retried this
#: many times, this far apart (seconds), so that the loser sees the winner's 412.
CONFLICT_RETRIES = 5
CONFLICT_BACKOFF_S = 0.2
#: local temp files start with this; they are never listed and no key may start with it.
TMP_PREFIX = ".hsx-tmp-"

ACCEPTED_FORMS = "a local path, file:///ABS/PATH, s3://BUCKET or s3://BUCKET/PREFIX"


class MissingKey(KeyError):
    """The key does not exist in the store (``read`` of an absent object)."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else "missing key"


@runtime_checkable
class Store(Protocol):
    """A flat key -> bytes store with create-if-absent; keys are ``/``-separated ``str``.

    ``str`` keys (not ``Path``) because the same key must address a file and an S3 object.
    Every method raises :class:`~core.errors.BadConfig` for a key that would escape the root and
    :class:`~core.errors.StoreError` when the backend refuses or cannot be reached (after retries).
    """

    url: str
    """Display URL (credentials masked): safe to log."""

    def read(self, key: str) -> bytes:
        """The whole object. Raises :class:`MissingKey` (a ``KeyError``) if it is absent."""
        ...

    def write(self, key: str, data: bytes) -> None:
        """Create or overwrite ``key``; readers see the old or the new bytes, never a mix."""
        ...

    def write_file(self, key: str, path: Path, sha256_hex: str | None = None) -> None:
        """Store the local file ``path`` under ``key`` (overwrite, atomic for readers).

        ``sha256_hex``, when given, is the file's sha256: S3 then checks the bytes it receives
        against it and refuses a mismatch (HTTP 400 BadDigest).
        """
        ...

    def create(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if absent: True if this call created it, False if it existed.

        False is a settled outcome only: another writer's object is there. When the backend cannot
        say (S3: 409 ConditionalRequestConflict that never settles), this raises
        :class:`~core.errors.StoreError` with ``transient=True``, never False.
        """
        ...

    def write_stream(self, key: str, pieces: Iterable[memoryview]) -> tuple[int, str]:
        """Store the concatenation of ``pieces`` under ``key`` in one pass; return (bytes, sha256 hex).

        The sha256 is computed over the very buffers that are written, beside the write, so the
        bytes cross host memory once after they were produced. When this returns, the object is
        complete and durable, and it holds exactly those bytes: local, written, fsynced and renamed
        into place; S3, a multipart upload whose every part the server checked against its
        SHA-256. Nothing needs reading back. Readers see the old object or the new one, never a
        part. ``pieces`` is consumed once; its buffers must not change until this returns.
        """
        ...


    def read_range(self, key: str, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` of ``key`` (fewer at the end of the object, ``b""`` past
        it). Raises :class:`MissingKey` if it is absent."""
        ...

    def sha256(self, key: str) -> tuple[int, str]:
        """(bytes, sha256 hex) of ``key``'s stored bytes, streamed in ``CHUNK_BYTES`` reads (never whole
        in memory). Raises :class:`MissingKey` if it is absent; :class:`~core.errors.StoreError`
        (``transient`` for a network error) if it cannot be read to the end."""
        ...

    def exists(self, key: str) -> bool:
        """Whether ``key`` exists."""
        ...

    def size(self, key: str) -> int | None:
        """Size of ``key`` in bytes, or None if absent."""
        ...

    def list(self, prefix: str = "") -> list[str]:
        """Every key that starts with ``prefix`` (recursive, string prefix like S3), sorted."""
        ...

    def delete(self, key: str) -> None:
        """Remove ``key``; no error if it is absent."""
        ...

    def local_path(self, key: str) -> Path | None:
        """A filesystem path of ``key`` that readers may mmap (local store), None on S3."""
        ...

    def verify(self, key: str, nbytes: int, sha256_hex: str) -> None:
        """Raise :class:`~core.errors.FidelityError` unless ``key`` exists with this size and sha256."""
        ...

    def list_modified(self, prefix: str = "") -> dict[str, float]:
        """``{key: last-modified time (Unix seconds)}`` of every key starting with ``prefix``."""
        ...

    def remove_incomplete(self, prefix: str = "", older_than_s: float = 3600.0) -> list[str]:
        """Remove unfinished writes under ``prefix`` older than ``older_than_s`` seconds (S3:
        multipart uploads never completed, with their parts; local: temp files of writers that
        died). Returns what was removed, for the report."""
        ...

    def child(self, prefix: str) -> "Store":
        """A store rooted at ``root/prefix`` (a run is ``store.child(run_id)``)."""
        ...

    def check(self, create: bool = True) -> None:
        """Probe the backend once; raise :class:`~core.errors.StoreError` with the fix if unusable.

        ``create=False``: a local root that does not exist is refused, not made (read-only opens)."""
        ...


# --- keys and URLs ------------------------------------------------------------------------


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid relative key, else raise :class:`~core.errors.BadConfig`.

    Rule: non-empty ``/``-separated segments, none ``.`` or ``..``, no leading ``/``, no
    backslash or NUL, no segment starting with the temp-file prefix.
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


def _check_prefix(prefix: str) -> str:
    """A list prefix: '' (everything), or a string prefix whose complete segments are valid."""
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


_SECRET_QUERY_KEYS = {"password", "pass", "pwd", "secret", "token", "access_key", "secret_key", "key"}


def mask_url(url: str) -> str:
    """``url`` with any ``user:password@`` password (or bare ``token@``) and secret query values
    replaced by ``***``, for printing. Non-URLs come back unchanged."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, sep, _password = userinfo.partition(":")
        netloc = f"{user}:***@{hostport}" if sep else f"***@{hostport}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(k.lower() in _SECRET_QUERY_KEYS for k, _ in pairs):
            query = urlencode([(k, "***" if k.lower() in _SECRET_QUERY_KEYS else v) for k, v in pairs], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_ONE_SLASH = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:/(?!/)")


def open_store(url: str, settings: "Settings | None" = None, *, create: bool = True) -> Store:
    """Open the store at ``url`` and probe it once (:meth:`Store.check`).

    ``url``: a local path (relative paths are made absolute; the directory is created unless
    ``create=False``, which the read-only commands and the workers use: a missing directory is
    then refused and nothing is made),
    ``file:///abs/path``, ``s3://bucket`` or ``s3://bucket/prefix``. S3 endpoint, region and
    credentials come from ``settings`` (``HSX_S3_*``) when set, else from boto3's default chain
    (``AWS_*`` variables, ``AWS_ENDPOINT_URL``, profiles).

    Raises :class:`~core.errors.BadConfig` for a URL of another form, and
    :class:`~core.errors.StoreError` (within ~10 s) when the endpoint is unreachable, the bucket
    is missing, the credentials are refused, or the directory cannot be created (or, with
    ``create=False``, does not exist).
    """
    if not isinstance(url, str) or not url.strip():
        raise BadConfig(f"store URL {url!r} is empty: use {ACCEPTED_FORMS}")
    url = url.strip()
    m = _SCHEME.match(url)
    scheme = m.group(1).lower() if m else ""
    if scheme == "s3":
        store: Store = S3Store.from_url(url, settings)
    elif scheme == "file":
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
            raise BadConfig(f"store URL {mask_url(url)!r} is not a local file URL: use file:///ABS/PATH")
        store = LocalStore(Path(unquote(parts.path)))
    elif scheme:
        raise BadConfig(f"store URL {mask_url(url)!r} has unsupported scheme {scheme!r}: use {ACCEPTED_FORMS}")
    elif _ONE_SLASH.match(url):
        # 's3:/bucket' is a typo of 's3://bucket', not a directory named 's3:' to create
        raise BadConfig(f"store URL {mask_url(url)!r} is a scheme with one slash: use {ACCEPTED_FORMS} "
                        f"(for a local directory whose name ends in ':', write ./{mask_url(url)})")
    else:
        store = LocalStore(Path(url).expanduser())
    store.check(create=create)
    return store


# --- local directory ----------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    """Make a rename or link in ``path`` durable (best effort: not every filesystem allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_file(path: Path) -> tuple[int, str]:
    """(bytes, sha256 hex) of a file, read in ``CHUNK_BYTES`` steps (never whole in memory)."""
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


class LocalStore:
    """A directory as a store: key ``a/b`` is the file ``root/a/b``.

    Writes go to a temp file in the same directory, are fsynced, then renamed into place, so
    readers never see a partial object. Temp files (``.hsx-tmp-*``) are never listed.
    """

    def __init__(self, root: Path):
        self.root = Path(os.path.abspath(root))
        self.url = self.root.as_uri()
        # Files this process stored by hard link with the writer's sha256: path -> (dev, inode, size, mtime_ns, sha256).
        self._linked: dict[str, tuple[int, int, int, int, str]] = {}

    def __repr__(self) -> str:
        return f"LocalStore({self.url})"

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    @contextmanager
    def _os_errors(self, op: str, key: str) -> Iterator[None]:
        try:
            yield
        except OSError as e:
            raise StoreError(f"{op} {key!r} in {self.url} failed: {e}") from e

    def _tmp_for(self, final: Path) -> Path:
        return final.with_name(f"{TMP_PREFIX}{uuid.uuid4().hex}-{final.name}")

    def check(self, create: bool = True) -> None:
        """Create the root directory if needed; raise StoreError if that fails or it is not writable.

        ``create=False``: a root that does not exist is refused (StoreError naming it), nothing is
        made; an existing root need not be writable (read-only commands)."""
        if not create:
            if self.root.is_dir():
                return
            what = "is not a directory" if self.root.exists() else "does not exist"
            raise StoreError(f"store {self.url}: {self.root} {what}; nothing was created. Fix: give the "
                             "directory of an existing run, <output>/<run_id>")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(f"store {self.url}: cannot create directory {self.root}: {e}") from e
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise StoreError(f"store {self.url}: directory {self.root} is not writable; fix its permissions")

    def read(self, key: str) -> bytes:
        """The file's bytes; :class:`MissingKey` if absent."""
        path = self._path(key)
        with self._os_errors("read", key):
            try:
                return path.read_bytes()
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                raise MissingKey(f"{key!r} not found in {self.url}") from None

    def _write_tmp(self, final: Path, fill) -> Path:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._tmp_for(final)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                fill(f)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def _replace_with(self, key: str, fill) -> None:
        final = self._path(key)
        with self._os_errors("write", key):
            tmp = self._write_tmp(final, fill)
            try:
                os.replace(tmp, final)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            _fsync_dir(final.parent)

    def write(self, key: str, data: bytes) -> None:
        """Overwrite atomically: temp file in the same directory, fsync, ``os.replace``."""
        self._replace_with(key, lambda f: f.write(data))

    def write_file(self, key: str, path: Path, sha256_hex: str | None = None) -> None:
        """Store ``path`` via a temp file + ``os.replace`` (the source is left in place).

        On the same filesystem the temp file is a hard link to ``path`` (no bytes copied; the
        caller must not modify ``path`` afterwards, only unlink it); otherwise the kernel copies
        it (``shutil.copyfile``: sendfile / copy_file_range, no Python-level buffers).
        """
        final = self._path(key)
        with self._os_errors("write", key):
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._tmp_for(final)
            try:
                try:
                    os.link(path, tmp)
                    linked = True
                except OSError:
                    shutil.copyfile(path, tmp)
                    linked = False
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, final)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            _fsync_dir(final.parent)
            if linked and sha256_hex:
                st = final.stat()
                self._linked[str(final)] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, sha256_hex.lower())

    def write_stream(self, key: str, pieces: Iterable[memoryview]) -> tuple[int, str]:
        """Write ``pieces`` straight into a temp file beside ``key``, hashed beside the write; fsync,
        ``os.replace``, fsync the directory; return (bytes, sha256 hex).

        After each piece its pages are handed to the kernel's writeback at once
        (``POSIX_FADV_DONTNEED``, see posix_fadvise(2)): the disk writes while the next piece is
        copied, the final fsync waits only for the tail, and gigabytes of shards do not push the
        page cache out. :meth:`verify` trusts a file this store wrote this way while it is the
        same inode, size and mtime (its bytes are the buffers that were hashed).
        """
        final = self._path(key)
        sha = Sha256Beside()

        def fill(f) -> None:
            fd, offset = f.fileno(), 0
            for piece in pieces:
                piece = memoryview(piece).cast("B")
                sha.update(piece)
                f.write(piece)
                if len(piece) >= CHUNK_BYTES and hasattr(os, "posix_fadvise"):
                    f.flush()
                    os.posix_fadvise(fd, offset, len(piece), os.POSIX_FADV_DONTNEED)
                offset += len(piece)

        with self._os_errors("write", key):
            try:
                tmp = self._write_tmp(final, fill)
            finally:
                digest = sha.hexdigest()
            try:
                os.replace(tmp, final)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            _fsync_dir(final.parent)
            st = final.stat()
        if st.st_size != sha.nbytes:
            raise StoreError(f"write {key!r} in {self.url}: {st.st_size} bytes on disk after writing {sha.nbytes}")
        self._linked[str(final)] = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, digest)
        return sha.nbytes, digest

    def create(self, key: str, data: bytes) -> bool:
        """Create-if-absent, safe across processes: a complete temp file is hard-linked to the
        final name (``link`` fails if the name exists). Where hard links are unsupported it falls
        back to ``O_CREAT|O_EXCL`` on the final name (still one winner, but a reader racing the
        winner may briefly see a short file)."""
        final = self._path(key)
        with self._os_errors("create", key):
            if final.exists():
                return False
            tmp = self._write_tmp(final, lambda f: f.write(data))
            try:
                os.link(tmp, final)
            except FileExistsError:
                return False
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK, errno.ENOSYS):
                    raise
                return self._create_excl(final, data)
            finally:
                tmp.unlink(missing_ok=True)
            _fsync_dir(final.parent)
            return True

    def _create_excl(self, final: Path, data: bytes) -> bool:
        try:
            fd = os.open(final, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(final.parent)
        return True

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes of the file from ``offset`` (fewer at its end); :class:`MissingKey` if absent."""
        path = self._path(key)
        with self._os_errors("read", key):
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    return f.read(length)
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                raise MissingKey(f"{key!r} not found in {self.url}") from None

    def sha256(self, key: str) -> tuple[int, str]:
        """(bytes, sha256 hex) of the file, read in ``CHUNK_BYTES`` steps; :class:`MissingKey` if absent."""
        path = self._path(key)
        with self._os_errors("read", key):
            try:
                return sha256_file(path)
            except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                raise MissingKey(f"{key!r} not found in {self.url}") from None

    def exists(self, key: str) -> bool:
        """Whether the file exists (a directory is not a key)."""
        return self._path(key).is_file()

    def size(self, key: str) -> int | None:
        """File size in bytes, None if absent."""
        path = self._path(key)
        with self._os_errors("size", key):
            try:
                st = path.stat()
            except (FileNotFoundError, NotADirectoryError):
                return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def list(self, prefix: str = "") -> list[str]:
        """Every key starting with ``prefix`` (string prefix, recursive), sorted; temp files hidden."""
        _check_prefix(prefix)
        head = prefix.rpartition("/")[0]
        base = self.root.joinpath(*head.split("/")) if head else self.root
        out: list[str] = []
        with self._os_errors("list", prefix):
            for dirpath, _dirnames, filenames in os.walk(base):
                rel = Path(dirpath).relative_to(self.root).as_posix()
                for name in filenames:
                    if name.startswith(TMP_PREFIX):
                        continue
                    key = name if rel == "." else f"{rel}/{name}"
                    if key.startswith(prefix):
                        out.append(key)
        out.sort()
        return out

    def delete(self, key: str) -> None:
        """Remove the file; absent is fine."""
        path = self._path(key)
        with self._os_errors("delete", key):
            path.unlink(missing_ok=True)

    def local_path(self, key: str) -> Path | None:
        """The file's path (whether or not it exists yet)."""
        return self._path(key)

    def verify(self, key: str, nbytes: int, sha256_hex: str) -> None:
        """Hash the file; FidelityError if absent or its size or sha256 differ.

        A file that :meth:`write_file` of this store stored by hard link, with its writer's
        sha256, and that is still that same inode and size, is not read again: its bytes are the
        very pages whose hash the writer computed (a re-read would come from the same page cache),
        as S3's verify trusts the server's checksum of what it received.
        """
        path = self._path(key)
        with self._os_errors("verify", key):
            try:
                st = path.stat()
            except FileNotFoundError:
                st = None
        if st is None:
            raise FidelityError(f"{key!r} in {self.url}: absent, expected {nbytes} bytes; rewrite it")
        size = st.st_size
        if size != nbytes:
            raise FidelityError(f"{key!r} in {self.url}: {size} bytes, expected {nbytes}; rewrite it")
        linked = self._linked.pop(str(path), None)
        if linked is not None:
            if linked[4] != sha256_hex.lower():
                raise FidelityError(f"{key!r} in {self.url}: stored with sha256 {linked[4]}, expected {sha256_hex}; rewrite it")
            if linked[:4] == (st.st_dev, st.st_ino, size, st.st_mtime_ns):
                return
        with self._os_errors("verify", key):
            n, digest = sha256_file(path)
        if n != nbytes or digest != sha256_hex.lower():
            raise FidelityError(
                f"{key!r} in {self.url}: sha256 {digest} ({n} bytes), expected {sha256_hex} ({nbytes} bytes); rewrite it"
            )

    def list_modified(self, prefix: str = "") -> dict[str, float]:
        """``{key: mtime}`` (Unix seconds) of every key starting with ``prefix``; temp files hidden."""
        out = {}
        for key in self.list(prefix):
            try:
                out[key] = self._path(key).stat().st_mtime
            except FileNotFoundError:
                continue  # deleted since the listing
        return out

    def remove_incomplete(self, prefix: str = "", older_than_s: float = 3600.0) -> list[str]:
        """Delete temp files (``.hsx-tmp-*``, left by a writer that died) under ``prefix``'s
        directory that are older than ``older_than_s`` seconds; returns their paths (relative)."""
        _check_prefix(prefix)
        head = prefix.rpartition("/")[0]
        base = self.root.joinpath(*head.split("/")) if head else self.root
        cutoff = time.time() - older_than_s
        removed = []
        with self._os_errors("clean", prefix):
            for dirpath, _dirnames, filenames in os.walk(base):
                for name in filenames:
                    if not name.startswith(TMP_PREFIX):
                        continue
                    path = Path(dirpath) / name
                    try:
                        if path.stat().st_mtime < cutoff:
                            path.unlink()
                            removed.append(path.relative_to(self.root).as_posix())
                    except FileNotFoundError:
                        continue
        return sorted(removed)

    def child(self, prefix: str) -> "LocalStore":
        """A store rooted at ``root/prefix`` (the directory is created on first write)."""
        child = LocalStore(self._path(prefix))
        child._linked = self._linked
        return child


# --- S3 ------------------------------------------------------------------------------------


def _error_code(e: Exception) -> tuple[str, int]:
    resp = getattr(e, "response", None) or {}
    code = str(resp.get("Error", {}).get("Code", ""))
    status = int(resp.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def _is_not_found(e: Exception) -> bool:
    code, status = _error_code(e)
    return status == 404 or code in ("404", "NoSuchKey", "NotFound")


#: S3 error codes that a later attempt may not get (throttling, server-side trouble).
TRANSIENT_S3_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "RequestTimeout",
                      "InternalError", "ServiceUnavailable", "ServiceUnavailableException", "RequestThrottled",
                      "TooManyRequestsException", "BandwidthLimitExceeded", "OperationAborted"}


def transient_s3_error(e: BaseException) -> bool:
    """Whether trying again later may succeed: no answer (connection refused, reset, timeouts, a
    body cut short), throttling, or HTTP 5xx; not credentials, a missing bucket or a bad request."""
    from botocore import exceptions as bx

    if isinstance(e, bx.ClientError):
        code, status = _error_code(e)
        return status >= 500 or status == 429 or code in TRANSIENT_S3_CODES
    if isinstance(e, (bx.ConnectionError, bx.HTTPClientError, bx.IncompleteReadError, bx.ResponseStreamingError,
                      ConnectionError, TimeoutError)):
        return True
    try:
        import urllib3.exceptions

        return isinstance(e, urllib3.exceptions.HTTPError)
    except ImportError:  # pragma: no cover - urllib3 ships with botocore
        return False


def _b64(hex_digest: str) -> str:
    """A hex digest as S3 writes checksums: base64 of the raw bytes."""
    return base64.b64encode(bytes.fromhex(hex_digest)).decode()


class S3Store:
    """An S3 bucket (optionally under a prefix) as a store: key ``a/b`` is ``s3://bucket/prefix/a/b``.

    One boto3 client, shared by threads (boto3 clients are thread-safe), with botocore's adaptive
    retries (``S3_MAX_ATTEMPTS``); errors left after retries become StoreError naming the object
    and the endpoint.
    """

    multipart_bytes: int = MULTIPART_BYTES
    """Files this big or bigger are uploaded in parts of this size (bytes; S3 minimum 5 MiB)."""

    def __init__(self, client: Any, bucket: str, prefix: str = "", *, endpoint: str | None = None,
                 probe_client: Any = None):
        self.client = client
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        if self.prefix:
            check_key(self.prefix)
        self.endpoint = endpoint or getattr(getattr(client, "meta", None), "endpoint_url", None) or "AWS default"
        self._probe_client = probe_client
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._composite: dict[str, str] = {}
        """Full key -> composite checksum of multipart uploads this process made, until verified."""

    def __repr__(self) -> str:
        return f"S3Store({self.url} at {self.endpoint})"

    @classmethod
    def from_url(cls, url: str, settings: "Settings | None" = None) -> "S3Store":
        """Build (without probing) the store for ``s3://bucket[/prefix]``; BadConfig on a bad URL."""
        import boto3
        from botocore.config import Config

        parts = urlsplit(url)
        if "@" in parts.netloc:
            raise BadConfig(
                f"store URL {mask_url(url)!r} carries credentials: put them in HSX_S3_ACCESS_KEY_ID / "
                "HSX_S3_SECRET_ACCESS_KEY and use s3://BUCKET/PREFIX"
            )
        bucket = parts.netloc
        if not bucket or parts.query or parts.fragment:
            raise BadConfig(f"store URL {mask_url(url)!r} is not s3://BUCKET or s3://BUCKET/PREFIX")
        prefix = parts.path.strip("/")
        if prefix:
            try:
                check_key(prefix)
            except BadConfig as e:
                raise BadConfig(f"store URL {url!r}: bad prefix: {e}") from None

        endpoint = settings.s3_endpoint_url if settings else None
        kwargs: dict[str, Any] = {}
        if endpoint:
            kwargs["endpoint_url"] = endpoint
        if settings and settings.s3_region:
            kwargs["region_name"] = settings.s3_region
        if settings and settings.s3_access_key_id:
            kwargs["aws_access_key_id"] = settings.s3_access_key_id
            kwargs["aws_secret_access_key"] = settings.s3_secret_access_key
        session = boto3.session.Session()
        # Custom endpoints (SeaweedFS, MinIO, moto) need path-style; AWS picks its own.
        s3_cfg = {"addressing_style": "path"} if endpoint else {}
        client = session.client("s3", config=Config(
            retries={"max_attempts": S3_MAX_ATTEMPTS, "mode": "adaptive"},
            connect_timeout=S3_CONNECT_TIMEOUT_S, read_timeout=S3_READ_TIMEOUT_S,
            max_pool_connections=32, s3=s3_cfg,
        ), **kwargs)
        probe = session.client("s3", config=Config(
            retries={"max_attempts": PROBE_MAX_ATTEMPTS, "mode": "standard"},
            connect_timeout=PROBE_CONNECT_TIMEOUT_S, read_timeout=PROBE_READ_TIMEOUT_S, s3=s3_cfg,
        ), **kwargs)
        return cls(client, bucket, prefix, endpoint=client.meta.endpoint_url, probe_client=probe)

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    @contextmanager
    def _errors(self, op: str, key: str) -> Iterator[None]:
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            yield
        except ClientError as e:
            code, status = _error_code(e)
            raise StoreError(
                f"S3 {op} {self.url}/{key} at {self.endpoint} failed: HTTP {status} {code}: {e}",
                transient=transient_s3_error(e),
            ) from e
        except (BotoCoreError, Boto3Error) as e:
            raise StoreError(f"S3 {op} {self.url}/{key} at {self.endpoint} failed: {e}",
                             transient=transient_s3_error(e)) from e
        except OSError as e:  # a socket error while streaming a body (botocore does not wrap those)
            raise StoreError(f"S3 {op} {self.url}/{key} at {self.endpoint} failed: {type(e).__name__}: {e}",
                             transient=True) from e
        except Exception as e:
            if transient_s3_error(e):  # urllib3 errors from a streamed body
                raise StoreError(f"S3 {op} {self.url}/{key} at {self.endpoint} failed: {type(e).__name__}: {e}",
                                 transient=True) from e
            raise

    def check(self, create: bool = True) -> None:
        """One ``head_bucket`` with short timeouts (3 s connect, 2 attempts); StoreError naming the
        URL, the endpoint, the error and the fix when the endpoint is unreachable, the bucket is
        missing or the credentials are refused."""
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        client = self._probe_client or self.client
        where = f"store {self.url} at endpoint {self.endpoint}"
        try:
            client.head_bucket(Bucket=self.bucket)
        except NoCredentialsError as e:
            raise StoreError(
                f"{where}: no S3 credentials found ({e}). Fix: set HSX_S3_ACCESS_KEY_ID and "
                "HSX_S3_SECRET_ACCESS_KEY (or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)"
            ) from e
        except ClientError as e:
            code, status = _error_code(e)
            server = e.response.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("server")
            if server:  # a 404 from something that is not an S3 server reads the same otherwise
                where += f" (server: {server})"
            if status == 404 or code in ("404", "NoSuchBucket", "NotFound"):
                raise StoreError(
                    f"{where}: bucket {self.bucket!r} does not exist (HTTP {status} {code}). Fix: create "
                    f"it (aws s3 mb s3://{self.bucket} --endpoint-url {self.endpoint}) or correct "
                    "the store URL / HSX_S3_ENDPOINT_URL"
                ) from e
            if status in (401, 403) or code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403"):
                raise StoreError(
                    f"{where}: credentials refused (HTTP {status} {code}). Fix: check "
                    "HSX_S3_ACCESS_KEY_ID / HSX_S3_SECRET_ACCESS_KEY and the bucket's permissions"
                ) from e
            raise StoreError(f"{where}: head_bucket failed (HTTP {status} {code}): {e}",
                             transient=transient_s3_error(e)) from e
        except BotoCoreError as e:
            raise StoreError(
                f"{where}: cannot reach the S3 endpoint ({type(e).__name__}: {e}). Fix: check "
                "HSX_S3_ENDPOINT_URL (or AWS_ENDPOINT_URL) and that the server is running and reachable",
                transient=transient_s3_error(e),
            ) from e

    def read(self, key: str) -> bytes:
        """The object's bytes; :class:`MissingKey` if absent."""
        from botocore.exceptions import ClientError

        full = self._key(key)
        with self._errors("read", key):
            try:
                return self.client.get_object(Bucket=self.bucket, Key=full)["Body"].read()
            except ClientError as e:
                if _is_not_found(e):
                    raise MissingKey(f"{key!r} not found in {self.url}") from None
                raise

    def write(self, key: str, data: bytes) -> None:
        """PUT the bytes (overwrite; a PUT is atomic for readers)."""
        full = self._key(key)
        with self._errors("write", key):
            self.client.put_object(Bucket=self.bucket, Key=full, Body=data)

    def write_file(self, key: str, path: Path, sha256_hex: str | None = None) -> None:
        """Upload a local file with SHA-256 checksums that the server checks on arrival.

        Below ``multipart_bytes``: one PUT carrying ``ChecksumSHA256`` (the file's sha256 when
        given, so the server refuses bytes that differ from what the caller hashed). From
        ``multipart_bytes`` on: a multipart upload, ``MULTIPART_CONCURRENCY`` parts at a time, each
        part with its own SHA-256 (computed as it is read); the expected composite checksum is kept
        for :meth:`verify`. A failed multipart upload is aborted so that no parts stay behind.
        Raises StoreError (``transient`` for what a retry may fix).
        """
        full = self._key(key)
        size = os.path.getsize(path)
        with self._errors("write_file", key):
            if size < self.multipart_bytes:
                extra = {"ChecksumSHA256": _b64(sha256_hex)} if sha256_hex else {"ChecksumAlgorithm": "SHA256"}
                with open(path, "rb") as f:
                    self.client.put_object(Bucket=self.bucket, Key=full, Body=f, **extra)
                self._composite.pop(full, None)
                return
            self._composite[full] = self._upload_parts(full, Path(path), size)

    def _upload_parts(self, full: str, path: Path, size: int) -> str:
        """Multipart upload of ``path`` to ``full``; returns the composite checksum S3 will report."""
        part = self.multipart_bytes
        upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=full, ChecksumAlgorithm="SHA256")["UploadId"]

        def one(number: int) -> dict:
            with open(path, "rb") as f:
                f.seek((number - 1) * part)
                data = f.read(part)
            digest = hashlib.sha256(data).hexdigest()
            resp = self.client.upload_part(Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=number,
                                           Body=data, ChecksumSHA256=_b64(digest))
            return {"PartNumber": number, "ETag": resp["ETag"], "ChecksumSHA256": _b64(digest)}

        numbers = range(1, (size + part - 1) // part + 1)
        try:
            with ThreadPoolExecutor(min(MULTIPART_CONCURRENCY, len(numbers))) as pool:
                parts = list(pool.map(one, numbers))
            self.client.complete_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id,
                                                  MultipartUpload={"Parts": parts})
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
            except Exception:  # the server may be the thing that failed; reconcile removes it later
                pass
            raise
        joined = b"".join(base64.b64decode(p["ChecksumSHA256"]) for p in parts)
        return f"{base64.b64encode(hashlib.sha256(joined).digest()).decode()}-{len(parts)}"

    def write_stream(self, key: str, pieces: Iterable[memoryview]) -> tuple[int, str]:
        """Upload ``pieces`` from host memory with checksums the server checks; return (bytes, sha256 hex).

        The pieces are cut into parts of ``multipart_bytes`` (each part one copy into a bytes
        object, as the HTTP body), uploaded ``MULTIPART_CONCURRENCY`` at a time, each with its
        own ``ChecksumSHA256`` that the server verifies on arrival (a mismatch is HTTP 400
        BadDigest); the whole object's sha256 is computed beside the upload over the same
        buffers. An object smaller than one part is one PUT with its full ``ChecksumSHA256``. The
        completed upload's composite checksum is compared with the one the parts give and kept for
        :meth:`verify`; nothing is downloaded. A failed upload is aborted (no parts stay behind)
        and raises StoreError (``transient`` for what a retry may fix).
        """
        from concurrent.futures import FIRST_COMPLETED, wait

        full = self._key(key)
        part_bytes = self.multipart_bytes
        sha = Sha256Beside()
        upload_id = None
        pool = None
        with self._errors("write_stream", key):
            try:
                pending: list[memoryview] = []  # slices of the caller's buffers for the next part
                pending_len = 0
                futures: dict = {}
                parts: list[dict] = []

                def send(number: int, data: bytes) -> dict:
                    digest = _b64(hashlib.sha256(data).hexdigest())
                    resp = self.client.upload_part(Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=number,
                                                   Body=data, ChecksumSHA256=digest)
                    return {"PartNumber": number, "ETag": resp["ETag"], "ChecksumSHA256": digest}

                def flush_part() -> None:
                    nonlocal upload_id, pool, pending, pending_len
                    if upload_id is None:
                        upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=full,
                                                                        ChecksumAlgorithm="SHA256")["UploadId"]
                        pool = ThreadPoolExecutor(MULTIPART_CONCURRENCY, thread_name_prefix="s3-part")
                    while len(futures) >= MULTIPART_CONCURRENCY:  # bounded memory: parts in flight
                        done, _ = wait(futures, return_when=FIRST_COMPLETED)
                        for f in done:
                            parts.append(f.result())
                            del futures[f]
                    number = len(parts) + len(futures) + 1
                    futures[pool.submit(send, number, b"".join(pending))] = number  # the one copy: the part's body
                    pending, pending_len = [], 0

                for piece in pieces:
                    piece = memoryview(piece).cast("B")
                    sha.update(piece)
                    while len(piece):
                        take = min(len(piece), part_bytes - pending_len)
                        pending.append(piece[:take])
                        pending_len += take
                        piece = piece[take:]
                        if pending_len == part_bytes:
                            flush_part()
                if upload_id is None:  # small: one PUT with the whole object's checksum
                    digest = sha.hexdigest()
                    self.client.put_object(Bucket=self.bucket, Key=full, Body=b"".join(pending),
                                           ChecksumSHA256=_b64(digest))
                    self._composite.pop(full, None)
                    return sha.nbytes, digest
                if pending_len:
                    flush_part()
                for f in list(futures):
                    parts.append(f.result())
                parts.sort(key=lambda p: p["PartNumber"])
                resp = self.client.complete_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id,
                                                             MultipartUpload={"Parts": parts})
                joined = b"".join(base64.b64decode(p["ChecksumSHA256"]) for p in parts)
                composite = f"{base64.b64encode(hashlib.sha256(joined).digest()).decode()}-{len(parts)}"
                reported = resp.get("ChecksumSHA256")
                if reported and reported != composite:
                    raise FidelityError(f"{key!r} in {self.url}: the server's composite SHA-256 {reported} differs from "
                                        f"the parts' {composite}")
                self._composite[full] = composite
                upload_id = None  # completed: nothing to abort
                return sha.nbytes, sha.hexdigest()
            finally:
                sha.hexdigest()
                if pool is not None:
                    pool.shutdown(wait=True, cancel_futures=True)
                if upload_id is not None:
                    try:
                        self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
                    except Exception:  # the server may be the thing that failed; reconcile removes it later
                        pass

    def create(self, key: str, data: bytes) -> bool:
        """``put_object(IfNoneMatch="*")``: True if created, False on 412 PreconditionFailed.

        A 409 ConditionalRequestConflict (AWS: a racing conditional write is in flight) is retried
        ``CONFLICT_RETRIES`` times so the outcome settles (412 -> False, or 200 if the other writer
        failed). If it never settles, the outcome is unknown, not lost: StoreError with
        ``transient=True`` (the caller's retries, ``core/retry.py``, try again; a worker must not
        take it for another worker's marker and delete its own shard). If botocore had to retry our
        PUT and then got 412, the first attempt may have landed: the object is read back and True
        returned when it holds our bytes.
        """
        from botocore.exceptions import ClientError

        full = self._key(key)
        with self._errors("create", key):
            for attempt in range(CONFLICT_RETRIES + 1):
                try:
                    self.client.put_object(Bucket=self.bucket, Key=full, Body=data, IfNoneMatch="*")
                    return True
                except ClientError as e:
                    code, status = _error_code(e)
                    if status == 412 or code == "PreconditionFailed":
                        retried = e.response.get("ResponseMetadata", {}).get("RetryAttempts", 0)
                        if retried:
                            try:
                                return self.read(key) == data
                            except MissingKey:
                                return False
                        return False
                    if status == 409 or code == "ConditionalRequestConflict":
                        if attempt < CONFLICT_RETRIES:
                            time.sleep(CONFLICT_BACKOFF_S * (attempt + 1))
                            continue
                        raise StoreError(
                            f"S3 create {self.url}/{key} at {self.endpoint}: {CONFLICT_RETRIES + 1} answers of HTTP 409 "
                            f"{code or 'ConditionalRequestConflict'} (another conditional write to the key in flight) "
                            "and none settled whether the object exists; not created. Fix: none needed, try again "
                            "(transient)", transient=True) from e
                    raise
        raise AssertionError("unreachable")

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        """One ranged GET (``Range: bytes=offset-end``); fewer bytes at the object's end, ``b""`` past it
        (HTTP 416) or for ``length`` 0; :class:`MissingKey` if absent."""
        from botocore.exceptions import ClientError

        full = self._key(key)
        if length <= 0:
            if self.size(key) is None:
                raise MissingKey(f"{key!r} not found in {self.url}")
            return b""
        with self._errors("read", key):
            try:
                return self.client.get_object(Bucket=self.bucket, Key=full,
                                              Range=f"bytes={offset}-{offset + length - 1}")["Body"].read()
            except ClientError as e:
                if _is_not_found(e):
                    raise MissingKey(f"{key!r} not found in {self.url}") from None
                code, status = _error_code(e)
                if status == 416 or code == "InvalidRange":
                    return b""
                raise

    def sha256(self, key: str) -> tuple[int, str]:
        """(bytes, sha256 hex) of the object's body, streamed in ``CHUNK_BYTES`` chunks; :class:`MissingKey`
        if absent; StoreError (``transient``) when the body cannot be read to its end."""
        from botocore.exceptions import ClientError

        full = self._key(key)
        h = hashlib.sha256()
        n = 0
        with self._errors("read", key):
            try:
                body = self.client.get_object(Bucket=self.bucket, Key=full)["Body"]
            except ClientError as e:
                if _is_not_found(e):
                    raise MissingKey(f"{key!r} not found in {self.url}") from None
                raise
            for chunk in body.iter_chunks(CHUNK_BYTES):
                h.update(chunk)
                n += len(chunk)
        return n, h.hexdigest()

    def size(self, key: str) -> int | None:
        """``ContentLength`` from a HEAD, None if absent."""
        from botocore.exceptions import ClientError

        full = self._key(key)
        with self._errors("size", key):
            try:
                return int(self.client.head_object(Bucket=self.bucket, Key=full)["ContentLength"])
            except ClientError as e:
                if _is_not_found(e):
                    return None
                raise

    def exists(self, key: str) -> bool:
        """Whether the object exists (one HEAD)."""
        return self.size(key) is not None

    def list(self, prefix: str = "") -> list[str]:
        """Every key starting with ``prefix`` (recursive), sorted; paginated (1000 per page)."""
        _check_prefix(prefix)
        base = f"{self.prefix}/" if self.prefix else ""
        out: list[str] = []
        with self._errors("list", prefix):
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base + prefix)
            for page in pages:
                for obj in page.get("Contents", ()):
                    k = obj["Key"]
                    if k.startswith(base) and not k.endswith("/"):  # "dir/" placeholders are not keys
                        out.append(k[len(base):])
        out.sort()
        return out

    def delete(self, key: str) -> None:
        """DELETE the object; absent is fine."""
        full = self._key(key)
        with self._errors("delete", key):
            self.client.delete_object(Bucket=self.bucket, Key=full)

    def local_path(self, key: str) -> Path | None:
        """None: S3 objects have no local path."""
        self._key(key)
        return None

    def _head_checksum(self, key: str) -> tuple[int | None, str | None]:
        """(size, ChecksumSHA256 as the server reports it) of ``key``; (None, None) if absent."""
        from botocore.exceptions import ClientError

        with self._errors("verify", key):
            try:
                head = self.client.head_object(Bucket=self.bucket, Key=self._key(key), ChecksumMode="ENABLED")
            except ClientError as e:
                if _is_not_found(e):
                    return None, None
                raise
        return int(head["ContentLength"]), head.get("ChecksumSHA256")

    def verify(self, key: str, nbytes: int, sha256_hex: str) -> None:
        """Check ``key`` against (bytes, sha256); FidelityError if absent or different.

        One HEAD with ``ChecksumMode=ENABLED``: when the server reports the object's full SHA-256
        (objects sent in one PUT), or the composite of its parts that :meth:`write_file` uploaded
        and remembered, that is compared and nothing is downloaded. Otherwise (a server without
        checksums, an object this process did not upload) the body is streamed and hashed.
        """
        from botocore.exceptions import ClientError

        size, checksum = self._head_checksum(key)
        if size is None:
            raise FidelityError(f"{key!r} in {self.url}: absent, expected {nbytes} bytes; rewrite it")
        if size != nbytes:
            raise FidelityError(f"{key!r} in {self.url}: {size} bytes, expected {nbytes}; rewrite it")
        full = self._key(key)
        expected = self._composite.get(full) if checksum and "-" in checksum else _b64(sha256_hex)
        if checksum and expected:
            if checksum != expected:
                raise FidelityError(f"{key!r} in {self.url}: the server's SHA-256 checksum {checksum} differs from the "
                                    f"expected {expected} (sha256 {sha256_hex}); rewrite it")
            self._composite.pop(full, None)
            return
        try:
            n, digest = self.sha256(key)
        except MissingKey:
            raise FidelityError(f"{key!r} in {self.url}: vanished during verify; rewrite it") from None
        if n != nbytes or digest != sha256_hex.lower():
            raise FidelityError(
                f"{key!r} in {self.url}: sha256 {digest} ({n} bytes), expected {sha256_hex} ({nbytes} bytes); rewrite it"
            )

    def list_modified(self, prefix: str = "") -> dict[str, float]:
        """``{key: LastModified}`` (Unix seconds) of every key starting with ``prefix`` (one paginated listing)."""
        _check_prefix(prefix)
        base = f"{self.prefix}/" if self.prefix else ""
        out: dict[str, float] = {}
        with self._errors("list", prefix):
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base + prefix):
                for obj in page.get("Contents", ()):
                    k = obj["Key"]
                    if k.startswith(base) and not k.endswith("/"):
                        out[k[len(base):]] = obj["LastModified"].timestamp()
        return out

    def remove_incomplete(self, prefix: str = "", older_than_s: float = 3600.0) -> list[str]:
        """Abort multipart uploads under ``prefix`` started more than ``older_than_s`` seconds ago
        (a worker killed mid-upload leaves their parts, which cost storage but are invisible to
        listings); returns their keys."""
        _check_prefix(prefix)
        base = f"{self.prefix}/" if self.prefix else ""
        cutoff = time.time() - older_than_s
        removed = []
        with self._errors("clean", prefix):
            for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=base + prefix):
                for up in page.get("Uploads", ()):
                    if up["Initiated"].timestamp() < cutoff:
                        self.client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])
                        removed.append(up["Key"][len(base):])
        return sorted(removed)

    def child(self, prefix: str) -> "S3Store":
        """A store rooted at ``prefix`` under this one, sharing the client."""
        child = S3Store(self.client, self.bucket, self._key(prefix), endpoint=self.endpoint,
                        probe_client=self._probe_client)
        child._composite = self._composite
        return child
