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
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from hsx.errors import BadConfig, BadRecord
from producer.datasets import SHAREGPT, SkipCounter, dataset_files, ignored_dataset_files, iter_raw_records
# The types every source shares live below this module and the sources it picks from; named here too
# (``from producer.sources import DatasetChanged``).
from producer.sourcebase import (BLOCK_BYTES, DatasetChanged, RawItem, Source, SourceOptions, _num_blocks,  # noqa: F401
                                 _read_block)

log = logging.getLogger(__name__)

#: The fingerprint's method, recorded in run.json's ``dataset``.
FINGERPRINT_METHOD = "sha256 of (name:size; sha256 of each 8 MiB block) per file"


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
        ignored = ignored_dataset_files(self.source)  # a directory's other entries: said, not read
        if ignored:
            out["ignored"] = ignored
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
