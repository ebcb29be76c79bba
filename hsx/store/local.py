"""A local directory as a store (:class:`LocalStore`): key ``a/b`` is the file ``root/a/b``."""

from __future__ import annotations

import errno
import os
import stat
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from hsx.errors import StoreError, StoreFull
from hsx.store.hashing import CHUNK_BYTES, Sha256Beside, sha256_file
from hsx.store.protocol import DISK_FULL_ERRNOS, TMP_PREFIX, MissingKey, check_key, check_prefix
from hsx.storeurl import LOCAL, StoreURL


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


class LocalStore:
    """A directory as a store: key ``a/b`` is the file ``root/a/b``.

    Writes go to a temp file in the same directory, are fsynced, then renamed into place, so
    readers never see a partial object. Temp files (``.hsx-tmp-*``) are never listed.
    """

    def __init__(self, root: Path):
        self.root = Path(os.path.abspath(root))
        self.location = StoreURL(LOCAL, path=str(self.root))
        self.url = self.root.as_uri()
        # opened as an existing run (check(create=False)): a write never makes the root again
        self._root_must_exist = False

    def __repr__(self) -> str:
        return f"LocalStore({self.url})"

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    @contextmanager
    def _os_errors(self, op: str, key: str) -> Iterator[None]:
        try:
            yield
        except OSError as e:
            if e.errno in DISK_FULL_ERRNOS:
                raise StoreFull(f"{op} {key!r} in {self.url} failed: the disk is full ({e})") from e
            raise StoreError(f"{op} {key!r} in {self.url} failed: {e}") from e

    def _tmp_for(self, final: Path) -> Path:
        return final.with_name(f"{TMP_PREFIX}{uuid.uuid4().hex}-{final.name}")

    def check(self, create: bool = True) -> None:
        """Create the root directory if needed; raise StoreError if that fails or it is not writable.

        ``create=False``: a root that does not exist is refused (StoreError naming it), nothing is
        made; an existing root need not be writable (read-only commands)."""
        if not create:
            if self.root.is_dir():
                self._root_must_exist = True
                return
            what = "is not a directory" if self.root.exists() else "does not exist"
            raise StoreError(f"store {self.url}: {self.root} {what}; nothing was created. Fix: give the "
                             "directory of an existing run, <output>/<run_id>")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            blocker = next((p for p in (self.root, *self.root.parents) if p.exists() and not p.is_dir()), None)
            if blocker is not None:
                made = "it cannot be a store's directory" if blocker == self.root else f"{self.root} cannot be made in it"
                raise StoreError(f"store {self.url}: {blocker} is a file, not a directory, so {made}; fix: give a "
                                 "directory (or a path that does not exist yet)") from e
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
        if self._root_must_exist and not self.root.is_dir():
            # A run deleted under a worker (rm -rf): a late status record must not bring its directory back.
            raise StoreError(f"store {self.url}: {self.root} no longer exists (the run was deleted?): nothing is "
                             "written there; it was opened as an existing run")
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

    @staticmethod
    def _publish(tmp: Path, final: Path) -> None:
        """``os.replace`` the complete temp file onto its final name, then fsync the directory so
        that the new name survives a crash (the temp file is removed if the rename fails)."""
        try:
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(final.parent)

    def _replace_with(self, key: str, fill) -> None:
        final = self._path(key)
        with self._os_errors("write", key):
            self._publish(self._write_tmp(final, fill), final)

    def write(self, key: str, data: bytes) -> None:
        """Overwrite atomically: temp file in the same directory, fsync, ``os.replace``."""
        self._replace_with(key, lambda f: f.write(data))

    def write_stream(self, key: str, pieces: Iterable[memoryview]) -> tuple[int, str]:
        """Write ``pieces`` straight into a temp file beside ``key``, hashed beside the write; fsync,
        ``os.replace``, fsync the directory; return (bytes, sha256 hex).

        After each piece its pages are handed to the kernel's writeback at once
        (``POSIX_FADV_DONTNEED``, see posix_fadvise(2)): the disk writes while the next piece is
        copied, the final fsync waits only for the tail, and gigabytes of shards do not push the
        page cache out.
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
            self._publish(tmp, final)
            st = final.stat()
        if st.st_size != sha.nbytes:
            raise StoreError(f"write {key!r} in {self.url}: {st.st_size} bytes on disk after writing {sha.nbytes}")
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
        check_prefix(prefix)
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

    def list_modified(self, prefix: str = "") -> dict[str, float]:
        """``{key: mtime}`` (Unix seconds) of every key starting with ``prefix``; temp files hidden."""
        out = {}
        for key in self.list(prefix):
            with self._os_errors("list", key):
                try:
                    out[key] = self._path(key).stat().st_mtime
                except FileNotFoundError:
                    continue  # deleted since the listing
        return out

    def remove_incomplete(self, prefix: str = "", older_than_s: float = 3600.0) -> list[str]:
        """Delete temp files (``.hsx-tmp-*``, left by a writer that died) under ``prefix``'s
        directory that are older than ``older_than_s`` seconds; returns their paths (relative)."""
        check_prefix(prefix)
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
        return LocalStore(self._path(prefix))
