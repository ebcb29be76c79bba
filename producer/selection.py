"""``--shuffle`` and ``--sample`` of local files: an index pass over the records, a seeded choice of
positions, then the chosen records read back in the chosen order.

**The choice** (:func:`choose_positions`) is made over the records' positions ``0 .. N-1`` in
dataset order (files sorted by name, records in file order) with ``numpy.random.default_rng(seed)``:
``--shuffle`` alone is ``rng.permutation(N)``; ``--sample K`` is ``rng.choice(N, K, replace=False)``,
sorted back into dataset order unless ``--shuffle`` is set too (all N records when K >= N). The
``save_to_disk`` sources of ``producer/hfsource.py`` make the same choice, so the same seed picks
the same positions of a dataset of the same size whatever its format.

**The index pass** reads every file once through :meth:`~producer.sources.LocalFiles.open_checked`
(each 8 MiB block is checked against the fingerprint as it is read) and keeps, per record, only
integers: for JSON lines and JSON arrays the record's byte offset and length and a 64-bit blake2b
digest of its bytes; for parquet the rows per row group (metadata, no rows are read). Memory is
O(records) integers (20 bytes a JSON record), never the records themselves.

**Reading back**: a JSON record is read with one ``pread`` of its byte range and its digest is
compared with the index pass's, so a record reaches the planner only if its bytes are those that
were checked against the fingerprint (:class:`~producer.sourcebase.DatasetChanged` otherwise); a JSON
line is then handed on as the streaming reader hands it, a :class:`~producer.datasets.RawLine`
that the tokenising process parses (``parse_raw``: the same BadRecord for a line that is not UTF-8
or not JSON), a JSON array element parsed as that reader parses it. Parquet rows are read per row group through the checked file, a
chunk of :data:`CHUNK_RECORDS` chosen records at a time (each needed row group read once per chunk).

Fallback ids stay ``<file name>:<index>`` with the record's position in its file, as without
shuffling: a record has the same id whatever the order it is read in.
"""

from __future__ import annotations

import hashlib
import json
import os
from array import array
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from hsx.errors import BadDataset
from producer.datasets import RawLine, SkipCounter, scan_json_array
from producer.sourcebase import CheckedFiles, DatasetChanged, RawItem, SourceOptions

#: Chosen records handled at a time when reading back (parquet rows of one chunk are held in memory).
CHUNK_RECORDS = 4096
_BOM = b"\xef\xbb\xbf"


def choose_positions(total: int, options: SourceOptions) -> np.ndarray | None:
    """The positions (int64 [K], values in ``0 .. total-1``) to read, in reading order, or None for
    every record in dataset order (neither ``shuffle`` nor ``sample`` set).

    ``numpy.random.default_rng(options.seed)``: ``shuffle`` alone, ``rng.permutation(total)``;
    ``sample`` K, ``rng.choice(total, K, replace=False)`` (every position when K >= total), sorted
    unless ``shuffle`` is set too (then permuted by the same generator when K >= total).
    """
    if not options.shuffle and options.sample is None:
        return None
    rng = np.random.default_rng(options.seed)
    if options.sample is None:
        return rng.permutation(total).astype(np.int64)
    if options.sample >= total:
        chosen = np.arange(total, dtype=np.int64)
        return rng.permutation(chosen) if options.shuffle else chosen
    chosen = rng.choice(total, size=options.sample, replace=False).astype(np.int64)
    return chosen if options.shuffle else np.sort(chosen)


def describe_order(options: SourceOptions) -> str | None:
    """One line for run.json's ``dataset.order``: how the records were chosen and ordered (None: dataset order)."""
    if options.shuffle and options.sample is not None:
        return (f"a seeded random subset of {options.sample:,} records in a random order (numpy default_rng({options.seed})"
                ".choice without replacement; a true permutation)")
    if options.shuffle:
        return f"every record in a seeded random order (numpy default_rng({options.seed}).permutation; a true permutation)"
    if options.sample is not None:
        return (f"a seeded random subset of {options.sample:,} records (numpy default_rng({options.seed}).choice without "
                "replacement), read in dataset order")
    return None


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


@dataclass
class _FileIndex:
    """The records of one file: ``kind`` "lines" / "array" (byte ranges) or "parquet" (row groups)."""

    kind: str
    count: int = 0
    offsets: np.ndarray | None = None  # int64 [count]
    lengths: np.ndarray | None = None  # uint32 [count]
    digests: np.ndarray | None = None  # uint64 [count]
    #: JSON lines: record indices after which blank lines were seen, and the blank lines before each
    #: (the line number of record i is i + 1 + the blanks before it: a RawLine carries it).
    blank_at: np.ndarray | None = None
    blank_before: np.ndarray | None = None
    row_group_starts: np.ndarray | None = None  # parquet: int64 [groups + 1]

    def line_number(self, i: int) -> int:
        if self.blank_at is None or not len(self.blank_at):
            return i + 1
        k = int(np.searchsorted(self.blank_at, i, side="right")) - 1
        return i + 1 + (int(self.blank_before[k]) if k >= 0 else 0)


@dataclass
class _Ranges:
    offsets: array = field(default_factory=lambda: array("q"))
    lengths: array = field(default_factory=lambda: array("I"))
    digests: array = field(default_factory=lambda: array("Q"))

    def add(self, offset: int, data: bytes) -> None:
        self.offsets.append(offset)
        self.lengths.append(len(data))
        self.digests.append(_digest(data))

    def into(self, index: _FileIndex) -> _FileIndex:
        index.count = len(self.offsets)
        index.offsets = np.frombuffer(self.offsets, dtype=np.int64) if len(self.offsets) else np.zeros(0, np.int64)
        index.lengths = np.frombuffer(self.lengths, dtype=np.uint32) if len(self.lengths) else np.zeros(0, np.uint32)
        index.digests = np.frombuffer(self.digests, dtype=np.uint64) if len(self.digests) else np.zeros(0, np.uint64)
        return index


def index_file(source: CheckedFiles, k: int, skips: SkipCounter) -> _FileIndex:
    """Index file ``k`` of ``source`` (read through its checked file object).

    The format is told as ``producer/datasets.py`` ``iter_raw_records`` tells it. Raises BadDataset
    for a file of no known format or a malformed JSON array (as that reader does), DatasetChanged.
    """
    path = source.files[k].path
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return _index_parquet(source, k)
    with source.open_checked(k) as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
        f.seek(0)
        if suffix == ".json" and head[:1] == b"[":
            return _index_json_array(path, f, skips)
        if head[:1] in (b"{", b"") or suffix == ".jsonl":
            return _index_json_lines(f)
    raise BadDataset(
        f"{path} starts with {head[:20]!r}: expected a JSON array ('[') or JSON lines ('{{'); "
        "fix the file or convert it to JSON lines"
    )


def _index_json_lines(f) -> _FileIndex:
    ranges = _Ranges()
    blank_at, blank_before = array("q"), array("q")
    offset = blanks = 0
    pending_blank = False
    for line in f:
        if not line.strip():
            blanks += 1
            pending_blank = True
        else:
            if pending_blank:
                blank_at.append(len(ranges.offsets))
                blank_before.append(blanks)
                pending_blank = False
            ranges.add(offset, line)
        offset += len(line)
    index = ranges.into(_FileIndex("lines"))
    index.blank_at = np.array(blank_at, dtype=np.int64)
    index.blank_before = np.array(blank_before, dtype=np.int64)
    return index


def _index_json_array(path, f, skips: SkipCounter) -> _FileIndex:
    """Byte ranges of a top-level JSON array's elements: the same scan as the reader's
    (``producer.datasets.scan_json_array``: same elements, same truncated tail, same errors)."""
    ranges = _Ranges()
    for _value, at, data in scan_json_array(path, f, skips, offsets=True):
        ranges.add(at, data)
    return ranges.into(_FileIndex("array"))


def _index_parquet(source: CheckedFiles, k: int) -> _FileIndex:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise BadDataset(f"reading {source.files[k].path} needs pyarrow, which is not installed: pip install pyarrow") from None
    with source.open_checked(k) as f:
        meta = pq.ParquetFile(f).metadata
        sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    starts = np.zeros(len(sizes) + 1, dtype=np.int64)
    starts[1:] = np.cumsum(sizes)
    return _FileIndex("parquet", count=int(starts[-1]), row_group_starts=starts)


class _Reader:
    """Reads chosen records back (see the module docstring); ``close`` releases the files."""

    def __init__(self, source: CheckedFiles, indexes: list[_FileIndex]):
        self.source, self.indexes = source, indexes
        self._fds: dict[int, int] = {}
        self._parquet: dict[int, object] = {}
        self._files: list = []

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        for f in self._files:
            f.close()
        self._fds.clear()
        self._parquet.clear()

    def _changed(self, k: int, why: str):
        return DatasetChanged(
            f"{self.source.files[k].path} changed while it was planned: {why}. The plan stopped before any record "
            "of the changed bytes was planned; run the same command again when the file no longer changes (a changed "
            "file is a new dataset: it gets a new run id)")

    def json_record(self, k: int, i: int):
        """Record ``i`` of JSON file ``k`` as the streaming readers give it: a JSON array's element
        parsed, a JSON line as a :class:`~producer.datasets.RawLine` (parsed where it is tokenised)."""
        index = self.indexes[k]
        f = self.source.files[k]
        fd = self._fds.get(k)
        if fd is None:
            fd = self._fds[k] = os.open(f.path, os.O_RDONLY)
        offset, n = int(index.offsets[i]), int(index.lengths[i])
        data = os.pread(fd, n, offset)
        if len(data) != n:
            raise self._changed(k, f"it is now shorter than the {f.size:,} bytes it had when the plan started")
        if _digest(data) != int(index.digests[i]):
            raise self._changed(k, f"the bytes at offset {offset:,}-{offset + n:,} differ from those indexed when the "
                                   "plan started")
        rid = f"{f.path.name}:{i}"
        if index.kind == "array":
            return json.loads(data.decode("utf-8", "surrogateescape"))
        if i == 0 and data.startswith(_BOM):
            data = data[3:]
        return RawLine(rid, data, index.line_number(i))

    def parquet_rows(self, k: int, rows: np.ndarray) -> dict[int, dict]:
        """Rows ``rows`` (positions in file ``k``) as dicts, each needed row group read once."""
        import pyarrow.parquet as pq

        pf = self._parquet.get(k)
        if pf is None:
            f = self.source.open_checked(k)
            self._files.append(f)
            pf = self._parquet[k] = pq.ParquetFile(f)
        starts = self.indexes[k].row_group_starts
        groups = np.searchsorted(starts, rows, side="right") - 1
        out: dict[int, dict] = {}
        for g in np.unique(groups):
            members = rows[groups == g]
            table = pf.read_row_group(int(g))
            for row, value in zip(members.tolist(), table.take(members - starts[g]).to_pylist()):
                out[row] = value
        return out


def selected_records(source: CheckedFiles, skips: SkipCounter) -> Iterator[RawItem]:
    """The records of ``source`` that ``source.options`` chooses (``--shuffle`` / ``--sample``), in
    the chosen order, as :class:`~producer.sourcebase.RawItem` (fallback id ``<file name>:<index>``).

    ``source.bytes_read`` (progress only) grows with the share of chosen records read. Raises
    BadDataset (a file of no known format), :class:`~producer.sourcebase.DatasetChanged` (a byte read
    back is not the byte checked against the fingerprint).
    """
    source.fingerprint()  # the block hashes the index pass is checked against
    indexes = [index_file(source, k, skips) for k in range(len(source.files))]
    counts = np.array([ix.count for ix in indexes], dtype=np.int64)
    file_starts = np.zeros(len(indexes) + 1, dtype=np.int64)
    file_starts[1:] = np.cumsum(counts)
    total = int(file_starts[-1])
    chosen = choose_positions(total, source.options)
    if chosen is None:  # not asked for: every record in order
        chosen = np.arange(total, dtype=np.int64)
    names = [f.path.name for f in source.files]
    reader = _Reader(source, indexes)
    total_bytes = source.total_bytes
    try:
        for c0 in range(0, len(chosen), CHUNK_RECORDS):
            chunk = chosen[c0:c0 + CHUNK_RECORDS]
            files = np.searchsorted(file_starts, chunk, side="right") - 1
            local = chunk - file_starts[files]
            parquet: dict[int, dict[int, dict]] = {}
            for k in np.unique(files).tolist():
                if indexes[k].kind == "parquet":
                    parquet[k] = reader.parquet_rows(k, local[files == k])
            for j, (k, i) in enumerate(zip(files.tolist(), local.tolist())):
                raw = parquet[k].pop(i) if k in parquet else reader.json_record(k, i)
                yield RawItem(f"{names[k]}:{i}", raw)
                source.bytes_read = int(total_bytes * (c0 + j + 1) / max(1, len(chosen)))
        source.bytes_read = total_bytes
    finally:
        reader.close()
