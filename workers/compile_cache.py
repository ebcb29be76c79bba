"""Triton's compile cache travels through the store: a new node's workers do not compile again.

fla's kernels are JIT-compiled by Triton at a worker's warm-up (~48 s for a Gated DeltaNet 27B on
an H200 with an empty cache, issue 20), into ``TRITON_CACHE_DIR`` (default ``~/.triton/cache``):
compiled kernels and, for fla's autotuned kernels, the autotune results. Every new node paid it.

Now the first worker that warms up with no shared cache packs its cache directory into a gzip'd
tar and stores it at the root of its store (``HSX_STORE_URL``) under

    compile-cache/triton/<key>.tar.gz      key = sm<major><minor>-torch<v>-triton<v>-fla<v>

(:func:`cache_key`: the GPU architecture and the versions that decide the compiled code), with
the store's create-if-absent (``Store.create``), so that of the workers racing, one writes it.
A worker that finds that archive before its warm-up unpacks it into its ``TRITON_CACHE_DIR``
(files it already has are kept; each file lands with an atomic rename, so workers of one node
that share the directory can do it at once), and Triton finds every kernel compiled. Nothing of it
stops a worker: a store that fails, or an archive that cannot be read, is logged and the worker
compiles as before. ``HSX_COMPILE_CACHE=false`` turns it off.

Kernels compiled after the warm-up (a run whose ``--batch-tokens`` meets row buckets the warm-up
did not, a shape the warm-up's batches did not cover) travel too: a worker looks every
:data:`TOP_UP_INTERVAL_S` seconds (:class:`TopUp`, a daemon thread) for files its cache gained since
the warm-up and stores them as one more archive, ``compile-cache/triton/<key>/extra/<id>.tar.gz``
(``<id>``: a hash of the files' names, so that workers that compiled the same kernels store one).
A worker unpacks the extras with the main archive before its warm-up.

The archive is a tar (``tarfile``, unpacked with its ``data`` filter: no absolute paths, no
``..``, no links out, no devices); it holds compiled GPU code, so it is as trusted as the store
the fleet writes its shards to. On the CPU nothing is compiled and nothing travels.
"""

from __future__ import annotations

import importlib.metadata
import io
import logging
import os
import re
import tarfile
import tempfile
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

#: Where the archives live, under the store root.
STORE_PREFIX = "compile-cache/triton/"

#: Seconds between a worker's looks for kernels compiled after its warm-up (:class:`TopUp`).
TOP_UP_INTERVAL_S = 60.0

#: At most this many extra archives are unpacked before a warm-up (the first, by name).
MAX_EXTRAS = 64


def triton_cache_dir() -> Path:
    """Triton's cache directory in this process: ``TRITON_CACHE_DIR``, else ``~/.triton/cache``."""
    given = os.environ.get("TRITON_CACHE_DIR")
    return Path(given) if given else Path.home() / ".triton" / "cache"


def _version(*dists: str) -> str:
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "none"


def cache_key(capability: tuple[int, int], versions: dict[str, str] | None = None, warm_up: str = "") -> str:
    """The archive's key for a GPU of compute ``capability`` (``(9, 0)`` on an H200).

    ``versions``: ``{"torch", "triton", "fla"}`` (default: this process's installed versions:
    torch, triton, flash-linear-attention or fla-core). ``warm_up``: what the warm-up compiles
    (``workers.target.warm_up_tag``), so that an archive stored by a warm-up that compiled less is
    not taken for complete. Characters other than letters, digits, ``.``, ``_`` and ``-`` become
    ``_`` (``2.13.0+cu128`` -> ``2.13.0_cu128``).
    """
    if versions is None:
        versions = {"torch": _version("torch"), "triton": _version("triton"),
                    "fla": _version("flash-linear-attention", "fla-core")}
    name = f"sm{capability[0]}{capability[1]}-" + "-".join(f"{k}{versions[k]}" for k in ("torch", "triton", "fla"))
    name += f"-{warm_up}" if warm_up else ""
    return STORE_PREFIX + re.sub(r"[^A-Za-z0-9._-]", "_", name) + ".tar.gz"


def _files(cache_dir: Path) -> list[Path]:
    # Triton writes into temp directories (``tmp.pid_...``) then renames: those are half written.
    out = []
    for path in sorted(cache_dir.rglob("*")):
        rel = path.relative_to(cache_dir)
        if path.is_file() and not path.is_symlink() and not any(part.startswith("tmp") for part in rel.parts):
            out.append(path)
    return out


def cached_files(cache_dir: Path) -> set[str]:
    """The whole files of ``cache_dir`` (paths relative to it; Triton's temp directories left out)."""
    return {str(p.relative_to(cache_dir)) for p in _files(cache_dir)} if cache_dir.is_dir() else set()


def pack(cache_dir: Path, only: set[str] | None = None) -> tuple[bytes, int]:
    """The files of ``cache_dir`` as a gzip'd tar (paths relative to it), and how many files.
    ``only``: just these (relative paths), of those there.

    Raises OSError when the directory cannot be read.
    """
    buf = io.BytesIO()
    files = [p for p in _files(cache_dir) if only is None or str(p.relative_to(cache_dir)) in only]
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in files:
            tar.add(path, arcname=str(path.relative_to(cache_dir)), recursive=False)
    return buf.getvalue(), len(files)


def unpack(data: bytes, cache_dir: Path) -> int:
    """Put the files of the archive ``data`` into ``cache_dir``; returns how many were added.

    Files ``cache_dir`` already has are kept. Each file is unpacked into a temp directory beside
    ``cache_dir`` (``tarfile``'s ``data`` filter) and renamed into place, so a process that reads
    the cache at the same time sees a file whole or not at all.

    Raises:
        tarfile.TarError: ``data`` is not such an archive, or a member breaks the filter's rules.
        OSError: ``cache_dir`` cannot be written.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    added = 0
    with tempfile.TemporaryDirectory(prefix=".hsx-unpack-", dir=cache_dir.parent) as tmp:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            tar.extractall(tmp, filter="data")
        for src in sorted(Path(tmp).rglob("*")):
            if not src.is_file():
                continue
            dest = cache_dir / src.relative_to(tmp)
            if dest.exists():
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, dest)
            added += 1
    return added


def restore(store, key: str, cache_dir: Path) -> dict | None:
    """Unpack the archive at ``key`` of ``store`` into ``cache_dir`` before a warm-up.

    Returns ``{"key", "files_added", "bytes", "seconds"}``, or None when the store holds no
    archive there, or it could not be read or unpacked (logged: the warm-up then compiles).
    """
    from hsx.store import MissingKey

    t0 = time.perf_counter()
    try:
        data = store.read(key)
    except MissingKey:
        log.info("no compile cache %s in %s yet: this worker's warm-up compiles (and stores what it compiled)",
                 key, store.url)
        return None
    except Exception as exc:  # the store is down or refuses us: compiling is slower, not wrong
        log.warning("compile cache %s not read from %s (%s: %s): the warm-up compiles", key, store.url,
                    exc.__class__.__name__, exc)
        return None
    try:
        added = unpack(data, cache_dir)
    except (tarfile.TarError, OSError, EOFError) as exc:
        log.warning("compile cache %s from %s not unpacked into %s (%s: %s): the warm-up compiles", key, store.url,
                    cache_dir, exc.__class__.__name__, exc)
        return None
    seconds = time.perf_counter() - t0
    log.info("compile cache %s: %d file(s) (%.1f MB) from %s into %s in %.1f s", key, added, len(data) / 1e6,
             store.url, cache_dir, seconds)
    return {"key": key, "files_added": added, "bytes": len(data), "seconds": round(seconds, 3)}


def save(store, key: str, cache_dir: Path) -> dict | None:
    """Store ``cache_dir`` as the archive at ``key`` unless the store has one already (create-if-absent).

    Returns ``{"key", "files", "bytes", "seconds"}`` when this call stored it; None when another
    worker had, the directory is empty, or the store failed (logged; nothing else depends on it).
    """
    t0 = time.perf_counter()
    try:
        if store.size(key) is not None:
            return None  # another worker stored it while this one warmed up
        data, files = pack(cache_dir)
        if not files:
            return None
        if not store.create(key, data):
            return None
    except Exception as exc:
        log.warning("compile cache %s not stored in %s (%s: %s); the next node's workers compile again", key,
                    store.url, exc.__class__.__name__, exc)
        return None
    seconds = time.perf_counter() - t0
    log.info("compile cache %s: %d file(s) (%.1f MB) of %s stored in %s in %.1f s", key, files, len(data) / 1e6,
             cache_dir, store.url, seconds)
    return {"key": key, "files": files, "bytes": len(data), "seconds": round(seconds, 3)}


def extras_prefix(key: str) -> str:
    """Where the archives of kernels compiled after a warm-up live, for the main archive ``key``."""
    return key.removesuffix(".tar.gz") + "/extra/"


def restore_extras(store, key: str, cache_dir: Path) -> dict:
    """Unpack the extra archives of ``key`` (:func:`extras_prefix`, at most :data:`MAX_EXTRAS`) into
    ``cache_dir``. Returns ``{"archives", "files_added", "bytes"}``; an archive that cannot be read
    or unpacked is logged and skipped (those kernels are compiled when met)."""
    out = {"archives": 0, "files_added": 0, "bytes": 0}
    try:
        keys = sorted(store.list(extras_prefix(key)))[:MAX_EXTRAS]
    except Exception as exc:
        log.warning("compile cache extras of %s not listed in %s (%s: %s)", key, store.url, exc.__class__.__name__, exc)
        return out
    for extra in keys:
        try:
            data = store.read(extra)
            out["files_added"] += unpack(data, cache_dir)
        except Exception as exc:  # one bad archive costs its kernels' compile, nothing more
            log.warning("compile cache %s not unpacked (%s: %s)", extra, exc.__class__.__name__, exc)
            continue
        out["archives"] += 1
        out["bytes"] += len(data)
    if out["archives"]:
        log.info("compile cache %s: %d file(s) from %d archive(s) of kernels compiled after earlier warm-ups",
                 key, out["files_added"], out["archives"])
    return out


def top_up(store, key: str, cache_dir: Path, known: set[str]) -> dict | None:
    """Store the files ``cache_dir`` gained beyond ``known`` (relative paths; updated in place) as
    an extra archive of ``key``: ``<extras_prefix(key)><16 hex of sha256 of their sorted names>.tar.gz``,
    create-if-absent (workers that compiled the same kernels store one archive). Returns
    ``{"key", "files", "bytes", "created"}``, or None when nothing is new or the store failed (logged)."""
    import hashlib

    try:
        new = cached_files(cache_dir) - known
        if not new:
            return None
        extra = extras_prefix(key) + hashlib.sha256("\n".join(sorted(new)).encode()).hexdigest()[:16] + ".tar.gz"
        data, files = pack(cache_dir, only=new)
        created = store.create(extra, data) if files else False
    except Exception as exc:
        log.warning("compile cache: kernels compiled after the warm-up not stored in %s (%s: %s)", store.url,
                    exc.__class__.__name__, exc)
        return None
    known |= new
    if created:
        log.info("compile cache %s: %d file(s) (%.1f MB) compiled after the warm-up stored as %s", key, files,
                 len(data) / 1e6, extra)
    return {"key": extra, "files": files, "bytes": len(data), "created": bool(created)}


class TopUp(threading.Thread):
    """A daemon thread that calls :func:`top_up` every ``interval_s`` seconds for the life of the
    worker process, from the files ``cache_dir`` holds when it is made (after the warm-up)."""

    def __init__(self, store, key: str, cache_dir: Path, interval_s: float = TOP_UP_INTERVAL_S):
        super().__init__(name="hsx-compile-cache-top-up", daemon=True)
        self.store, self.key, self.cache_dir, self.interval_s = store, key, cache_dir, interval_s
        self.known = cached_files(cache_dir)
        self.stored: list[dict] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval_s):
            record = top_up(self.store, self.key, self.cache_dir, self.known)
            if record is not None and record["created"]:
                self.stored.append(record)

    def stop(self) -> None:
        """End the thread after its current look (the worker process ending ends it too)."""
        self._stop_event.set()


_top_ups: dict[str, TopUp] = {}
_top_ups_lock = threading.Lock()


def start_top_up(store, key: str, cache_dir: Path, interval_s: float = TOP_UP_INTERVAL_S) -> TopUp | None:
    """Start this process's :class:`TopUp` for ``key`` (one per key: a worker that switches targets
    keeps the one it has); None with ``interval_s <= 0`` (off)."""
    if interval_s <= 0:
        return None
    with _top_ups_lock:
        running = _top_ups.get(key)
        if running is None or not running.is_alive():
            running = _top_ups[key] = TopUp(store, key, cache_dir, interval_s)
            running.start()
        return running


def around_warm_up(store, key: str, cache_dir: Path, warm_up) -> dict:
    """Run ``warm_up()`` with the shared compile cache: restore it (and its extras) first, store it
    after when the store had none. Returns ``{"key", "cache_dir", "restored": restore's record or
    None, "extras": restore_extras' record, "saved": save's record or None}``. ``warm_up``'s own
    exceptions propagate (nothing is stored)."""
    restored = restore(store, key, cache_dir)
    extras = restore_extras(store, key, cache_dir)
    warm_up()
    saved = None if restored is not None else save(store, key, cache_dir)
    return {"key": key, "cache_dir": str(cache_dir), "restored": restored, "extras": extras, "saved": saved}


def for_worker(settings, device, warm_up: str = ""):
    """``(store, key, cache_dir)`` for a worker on ``device`` whose warm-up is ``warm_up``
    (:func:`cache_key`), or None when nothing travels: not CUDA, ``HSX_COMPILE_CACHE`` off, Triton
    not installed, or the store root cannot be opened (logged)."""
    if not settings.compile_cache or device.type != "cuda":
        return None
    try:
        import triton  # noqa: F401
    except Exception:
        return None
    import torch

    from hsx.store import mask_url, open_store

    try:
        # create: a worker may start before any run was planned under its local root
        store = open_store(settings.store_url, settings, create=True)
    except Exception as exc:
        log.warning("compile cache: store %s not opened (%s: %s); the warm-up compiles", mask_url(settings.store_url),
                    exc.__class__.__name__, exc)
        return None
    return store, cache_key(torch.cuda.get_device_capability(device), warm_up=warm_up), triton_cache_dir()
