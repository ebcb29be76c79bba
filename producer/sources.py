"""Dataset sources: what the records are, the fingerprint that names their bytes, and reading them
in order with every byte checked against that fingerprint.

A source is opened from what the user typed (:func:`open_source`):

- ``sharegpt``, a ``.json`` / ``.jsonl`` / ``.parquet`` file or a directory holding such files:
  :class:`LocalFiles`, read by ``producer/datasets.py``'s own streaming readers;
- a Hugging Face dataset (a hub id ``org/name``, a ``save_to_disk`` directory, or a local directory
  in the hub's layout): ``producer/hfsource.py``, read through the ``datasets`` library.

**The fingerprint names the bytes that are planned.** The run id is derived from the fingerprint,
and the first window of the plan is enqueued seconds after the start, so the fingerprint has to be
known before the records are read: :meth:`LocalFiles.fingerprint` hashes each file in blocks of
:data:`BLOCK_BYTES` (threads in parallel; hashlib releases the GIL), then the reading pass
(:meth:`LocalFiles.raw_records`) reads each file only up to the size it had when it was hashed,
and hashes every block again as it reads it, before any record of that block reaches the planner.
A block whose bytes differ raises :class:`DatasetChanged`: the planner stops before any sample of
the changed bytes is planned or enqueued. Bytes appended to a file while it is planned are not
read (they are not in the fingerprint): that run plans the file as it was, and a later run of the
grown file gets a new run id. So a plan never mixes two versions of a dataset, and the run id names
exactly the bytes that were planned.
"""

from __future__ import annotations

import hashlib
import io
from abc import ABC, abstractmethod
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from hsx.errors import BadConfig, BadDataset, BadRecord
from producer.datasets import SHAREGPT, SkipCounter, dataset_files, iter_raw_records

log = logging.getLogger(__name__)

#: Bytes per fingerprint block: the unit the reading pass checks (and holds in memory) at a time.
BLOCK_BYTES = 8 << 20
#: The fingerprint's method, recorded in run.json's ``dataset``.
FINGERPRINT_METHOD = "sha256 of (name:size; sha256 of each 8 MiB block) per file"


class DatasetChanged(BadDataset):
    """The dataset's bytes changed between the fingerprint and the reading pass (the plan stops)."""


@dataclass(frozen=True)
class SourceOptions:
    """Which records of a source are read, and in which order (``dataset_options`` of run.json).

    ``split`` / ``subset``: of a Hugging Face dataset (None: its default); ``shuffle`` with
    ``seed``: read the records in a seeded random order; ``sample``: a seeded random subset of that
    many records (before any is skipped), read in dataset order unless ``shuffle`` is set.
    """

    split: str | None = None
    subset: str | None = None
    shuffle: bool = False
    seed: int | None = None
    sample: int | None = None
    #: Of a regenerate run's address as the dataset (``producer/regenerate.py``): skip the answers cut at
    #: ``--max-new-tokens``. Hashed through that source's fingerprint, not here.
    drop_unfinished: bool = False

    def identity(self) -> dict:
        """The options that decide which records are read, as hashed into the run's identity
        (only those set: the default dataset order hashes as ``{}``)."""
        out: dict[str, Any] = {}
        if self.split is not None:
            out["split"] = self.split
        if self.subset is not None:
            out["subset"] = self.subset
        if self.shuffle:
            out["shuffle"] = True
        if self.sample is not None:
            out["sample"] = self.sample
        if self.shuffle or self.sample is not None:
            out["seed"] = self.seed
        return out

    def check(self) -> None:
        """Raises BadConfig for options that contradict each other or are out of range."""
        if self.sample is not None and self.sample < 1:
            raise BadConfig(f"--sample {self.sample}: must be a positive number of records")
        if self.seed is not None and self.seed < 0:
            raise BadConfig(f"--seed {self.seed}: must be >= 0")
        if (self.shuffle or self.sample is not None) and self.seed is None:
            raise BadConfig("--shuffle and --sample need --seed N, so that the same command reads the same records "
                            "(and resumes the same run)")


@dataclass
class RawItem:
    """One record of the source as read: ``raw`` is the parsed object, a BadRecord for one that did
    not parse, or a :class:`producer.datasets.RawLine` still to be parsed (``parse_raw``, in the
    tokenising process); ``fallback_id`` its id when it has none of its own (``<file name>:<index>``)."""

    fallback_id: str
    raw: Any


class Source(ABC):
    """A dataset source (the abstract base of :class:`LocalFiles` and the Hugging Face sources).

    Attributes: ``source`` (what the user typed), ``name`` (the run id's stem), ``options``
    (:class:`SourceOptions`), ``bytes_read`` (bytes consumed so far by :meth:`raw_records`, for
    progress; 0 when the source cannot say).
    """

    source: str
    name: str
    options: SourceOptions
    bytes_read: int = 0

    @abstractmethod
    def fingerprint(self) -> str:
        """Hex digest naming the dataset's content (the run id is derived from it)."""

    @abstractmethod
    def describe(self) -> dict:
        """What run.json records of the source (``dataset``): never hashed."""

    @property
    def total_bytes(self) -> int | None:
        """The size of what :meth:`raw_records` reads, when known (the planning's ETA)."""
        return None

    @property
    def total_records(self) -> int | None:
        """Records :meth:`raw_records` yields in all, when known before reading."""
        return None

    @abstractmethod
    def raw_records(self, skips: SkipCounter) -> Iterator[RawItem]:
        """Every record in the order the plan reads them. Raises :class:`DatasetChanged`."""

    def location(self) -> str:
        """``dataset_source`` of run.json: an absolute path, or the hub id."""
        return self.source


def open_source(source: str, options: SourceOptions | None = None, *, cache_dir: Path | None = None) -> Source:
    """The source behind what the user typed (see the module docstring).

    Raises:
        BadDataset: the path does not exist, holds no readable file, or the hub dataset cannot be read.
        BadConfig: options that do not apply to this kind of source.
    """
    options = options or SourceOptions()
    options.check()
    from producer.regenerate import regenerated_source

    regenerated = regenerated_source(source, options)  # a regenerate run's address: its answered conversations
    if regenerated is not None:
        return regenerated
    if options.drop_unfinished:
        raise BadConfig(f"--drop-unfinished skips the unfinished answers of a regenerate run; {source!r} is not the "
                        "address of one (<output>/<run_id> of `producer regenerate`): leave it out")
    from producer import hfsource

    if hfsource.is_hf_source(source):
        return hfsource.open_hf_source(source, options, cache_dir=cache_dir)
    if options.split is not None or options.subset is not None:
        raise BadConfig(f"--split / --subset choose part of a Hugging Face dataset; {source!r} is a file source "
                        "(.json, .jsonl, .parquet, a directory of them, or 'sharegpt'): leave them out")
    return LocalFiles(source, options)


@dataclass
class _FileState:
    path: Path
    size: int
    blocks: list[bytes] = field(default_factory=list)


class LocalFiles(Source):
    """``sharegpt``, a local file, or a directory of files, read by ``producer/datasets.py``.

    Each file is fingerprinted in :data:`BLOCK_BYTES` blocks at the first call of
    :meth:`fingerprint`, and read by :meth:`raw_records` through a file object that checks every
    block against those hashes (module docstring). With ``options.shuffle`` or ``options.sample``,
    :meth:`raw_records` first indexes the records (one parse pass) and then reads the chosen ones
    in the chosen order (``producer/selection.py``).
    """

    def __init__(self, source: str, options: SourceOptions | None = None):
        self.source = source
        self.options = options or SourceOptions()
        self.files = [_FileState(p, p.stat().st_size) for p in dataset_files(source)]  # BadDataset
        self.name = source if source == SHAREGPT else (Path(source).stem or "dataset")
        self.bytes_read = 0
        self._fingerprint: str | None = None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def total_records(self) -> int | None:
        return self.options.sample

    def location(self) -> str:
        return self.source if self.source == SHAREGPT else str(Path(self.source).resolve())

    def describe(self) -> dict:
        from producer.selection import describe_order

        out = {"kind": "files", "files": [{"name": f.path.name, "bytes": f.size} for f in self.files],
               "fingerprint": FINGERPRINT_METHOD}
        order = describe_order(self.options)  # --shuffle / --sample: how the records were chosen
        if order:
            out["order"] = order
        return out

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            jobs = [(f, i) for f in self.files for i in range(_num_blocks(f.size))]
            for f in self.files:
                f.blocks = [b""] * _num_blocks(f.size)

            def hash_block(job) -> None:
                f, i = job
                f.blocks[i] = hashlib.sha256(_read_block(f.path, f.size, i)).digest()

            with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
                list(pool.map(hash_block, jobs))
            h = hashlib.sha256()
            for f in self.files:
                h.update(f"{f.path.name}:{f.size};".encode())
                for digest in f.blocks:
                    h.update(digest)
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def raw_records(self, skips: SkipCounter) -> Iterator[RawItem]:
        self.fingerprint()  # the block hashes the reading pass checks against
        if self.options.shuffle or self.options.sample is not None:
            from producer.selection import selected_records

            yield from selected_records(self, skips)
            return
        done = 0
        for k, f in enumerate(self.files):
            opened: list[_CheckedRaw] = []

            def opener(_path, k=k):
                raw = _CheckedRaw(self.files[k].path, self.files[k].size, self.files[k].blocks)
                opened.append(raw)
                return io.BufferedReader(raw, buffer_size=1 << 20)

            for index, raw in enumerate(iter_raw_records(f.path, skips, opener, lazy=True)):
                yield RawItem(f"{f.path.name}:{index}", raw)
                self.bytes_read = done + (opened[-1].high_water if opened else 0)
            done += f.size
            self.bytes_read = done
            _note_growth(f)

    def open_checked(self, index: int) -> io.BufferedReader:
        """A checked binary file object for file ``index`` (for ``producer/selection.py``)."""
        f = self.files[index]
        return io.BufferedReader(_CheckedRaw(f.path, f.size, f.blocks), buffer_size=1 << 20)


def _note_growth(f: _FileState) -> None:
    try:
        now = f.path.stat().st_size
    except OSError:
        return
    if now > f.size:
        log.info("%s grew by %d bytes while it was planned: the plan holds the file as it was when the plan "
                 "started (%d bytes, the bytes its fingerprint names); plan it again for the rest",
                 f.path, now - f.size, f.size)


def _num_blocks(size: int) -> int:
    return (size + BLOCK_BYTES - 1) // BLOCK_BYTES


def _read_block(path: Path, size: int, i: int) -> bytes:
    n = min(BLOCK_BYTES, size - i * BLOCK_BYTES)
    with open(path, "rb") as fh:
        data = os.pread(fh.fileno(), n, i * BLOCK_BYTES)
    return data


class _CheckedRaw(io.RawIOBase):
    """A read-only, seekable view of the first ``size`` bytes of ``path`` whose every block is
    checked against ``blocks`` (sha256 digests) when it is read from disk. Raises DatasetChanged."""

    def __init__(self, path: Path, size: int, blocks: list[bytes]):
        self.path, self.size, self.blocks = path, size, blocks
        self._fh = open(path, "rb")
        self._pos = 0
        self._cache: dict[int, bytes] = {}  # the last two blocks read (parquet reads out of order)
        self.high_water = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def _block(self, i: int) -> bytes:
        data = self._cache.get(i)
        if data is None:
            n = min(BLOCK_BYTES, self.size - i * BLOCK_BYTES)
            data = os.pread(self._fh.fileno(), n, i * BLOCK_BYTES)
            if len(data) != n or hashlib.sha256(data).digest() != self.blocks[i]:
                at = i * BLOCK_BYTES
                why = (f"it is now shorter than the {self.size:,} bytes it had" if len(data) != n
                       else f"the bytes at offset {at:,}-{at + n:,} differ from those hashed")
                raise DatasetChanged(
                    f"{self.path} changed while it was planned: {why} when the plan started. The plan stopped "
                    "before any record of the changed bytes was planned; run the same command again when the "
                    "file no longer changes (a changed file is a new dataset: it gets a new run id)")
            if len(self._cache) >= 2:
                self._cache.pop(next(iter(self._cache)))
            self._cache[i] = data
        return data

    def readinto(self, buf) -> int:
        if self._pos >= self.size:
            return 0
        i, off = divmod(self._pos, BLOCK_BYTES)
        data = self._block(i)
        n = min(len(buf), len(data) - off)
        buf[:n] = data[off:off + n]
        self._pos += n
        self.high_water = max(self.high_water, self._pos)
        return n

    def close(self) -> None:
        if not self.closed:
            self._fh.close()
        super().close()


def record_error_id(item: RawItem) -> str:
    """The id a skipped raw record is reported under."""
    return item.raw.record_id if isinstance(item.raw, BadRecord) else item.fallback_id
