"""Hugging Face datasets as sources, read through the ``datasets`` library, one record at a time.

Three kinds (:func:`open_hf_source` tells them apart; :func:`is_hf_source` says when a source is one):

- **a hub id** ``org/name`` (:class:`StreamedDataset`): read with the ``datasets`` streaming reader
  at the commit the hub names now (``HfApi().dataset_info(id).sha``, pinned as ``revision=`` so
  every record comes from that commit). Fingerprint: sha256 of the id, that commit, the subset and
  the split. Offline (``HF_HUB_OFFLINE=1``, or the hub unreachable) the hub cache is looked in
  once (``snapshot_download(..., local_files_only=True)``): a cached snapshot is read as a local
  directory with the same fingerprint (the same run id as online); else :class:`BadDataset` says
  what was tried and how to fix it, at once (no retries).
- **a ``save_to_disk`` directory** (:class:`SavedDataset`): a ``Dataset`` (``dataset_info.json`` +
  ``state.json`` + Arrow files) or a ``DatasetDict`` (``dataset_dict.json`` + one such directory per
  split). ``load_from_disk`` memory-maps the Arrow files; rows are read in order (or in the chosen
  order). Fingerprint: sha256 over the Arrow files' bytes in 8 MiB blocks (as
  ``producer/sources.py``) and the split.
- **a local directory in the hub's layout** (:class:`StreamedDataset`): data files in subfolders
  (``data/train-00000-of-00001.parquet``, ``chat/a/train.jsonl``), optionally a README.md whose
  YAML header declares ``configs``: read with the ``datasets`` streaming reader. Fingerprint: sha256
  over the chosen split's data files' bytes (8 MiB blocks), the README's YAML header, the subset
  and the split.

Records are the dicts the library gives (nested lists of dicts for messages); their fallback id
is ``<split>:<index>``, the record's position in the split, whatever order it is read in.

**Order** (``--shuffle`` / ``--sample``, recorded in run.json's ``dataset.order``): a
``save_to_disk`` dataset is read in a true permutation, ``numpy.random.default_rng(seed)
.permutation`` (what ``datasets.Dataset.shuffle(seed=seed)`` computes), and ``--sample N`` picks N
positions with the same generator (``producer/selection.py`` :func:`choose_positions`, the choice of
local files too). A streamed dataset cannot be read out of order: ``--shuffle`` is a seeded
**buffer shuffle** of :data:`SHUFFLE_BUFFER` records, the algorithm of the ``datasets`` streaming
``IterableDataset.shuffle`` (fill the buffer, permute it, yield half) but over the split in its own
order, without that method's shuffle of the shard order: the shard shuffle would lose each record's
position, which its fallback id is. ``--sample N`` of a streamed dataset picks N positions of the
split (its size from the dataset's metadata, else from one counting pass) and reads the split once,
in order, up to the last one picked.

**A local dataset that changes while it is planned** is refused: each file's (size, mtime_ns) is
taken when it is fingerprinted and checked again every :data:`CHECK_EVERY` records and at the end;
a difference raises :class:`~producer.sourcebase.DatasetChanged`. (The ``datasets`` library reads the
files itself, so the bytes are not checked block by block as ``producer/sources.py`` checks the
files it reads.)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from hsx.errors import BadConfig, BadDataset
from producer.datasets import SHAREGPT, SUPPORTED_SUFFIXES, SkipCounter, without_arrow_nulls
from producer.selection import choose_positions, describe_order
from producer.sourcebase import (BLOCK_BYTES, DatasetChanged, RawItem, Source, SourceOptions, _num_blocks,
                                 _read_block)

log = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
#: Extensions of the data files the ``datasets`` library reads from a directory in the hub's layout.
HF_DATA_SUFFIXES = (".parquet", ".arrow", ".json", ".jsonl", ".csv", ".tsv", ".txt")
#: Compressions it reads them in (``train.jsonl.gz``).
HF_COMPRESSIONS = ("", ".gz", ".bz2", ".xz", ".zst", ".lz4")
#: Records of a streamed dataset held by the ``--shuffle`` buffer.
SHUFFLE_BUFFER = 10_000
#: Records between two checks that the local files are unchanged.
CHECK_EVERY = 256
#: Seconds the hub gets to answer which commit a dataset is at.
HUB_TIMEOUT_S = 10.0
FINGERPRINT_SAVED = "sha256 of (split; name:size; sha256 of each 8 MiB block) per Arrow file"
FINGERPRINT_LOCAL = ("sha256 of (subset; split; the README's YAML header; path:size; sha256 of each 8 MiB block) "
                     "per data file of the split")
FINGERPRINT_HUB = "sha256 of (hub id; commit sha; subset; split)"


# --------------------------------------------------------------------------------------------
# Telling sources apart


def is_hf_source(source: str) -> bool:
    """True when ``source`` names a Hugging Face dataset rather than files ``producer/datasets.py`` reads.

    A directory is one when it is a ``save_to_disk`` directory (``dataset_info.json`` and
    ``state.json``, or ``dataset_dict.json``), when its README.md declares ``configs`` in its YAML
    header, or when it holds no data file directly but data files in subfolders (the hub's layout);
    a directory of .json/.jsonl/.parquet files is a files source. A path that does not exist is a
    hub id when it has the form ``org/name`` and no data file extension (``data/chats.jsonl`` is a
    missing file, reported as such).
    """
    if source == SHAREGPT:
        return False
    path = Path(source).expanduser()
    if path.is_dir():
        if _saved_kind(path) is not None or _readme_configs(path):
            return True
        if any(p.is_file() and p.suffix.lower() in SUPPORTED_SUFFIXES for p in path.iterdir()):
            return False
        return next(_nested_data_files(path), None) is not None
    if path.exists():
        return False
    return bool(_HUB_ID.match(source)) and not _is_data_file(source)


def _is_data_file(name: str) -> bool:
    low = name.lower()
    return any(low.endswith(s + c) for s in HF_DATA_SUFFIXES for c in HF_COMPRESSIONS)


def _saved_kind(path: Path) -> str | None:
    if (path / "dataset_dict.json").is_file():
        return "DatasetDict"
    if (path / "dataset_info.json").is_file() and (path / "state.json").is_file():
        return "Dataset"
    return None


def _readme_header(path: Path) -> str | None:
    """The YAML header of ``path/README.md`` (between the first two ``---`` lines), or None."""
    readme = path / "README.md"
    if not readme.is_file():
        return None
    try:
        with open(readme, encoding="utf-8", errors="replace") as f:
            text = f.read(1 << 20)
    except OSError:
        return None
    m = re.match(r"\A\ufeff?---[ \t]*\r?\n(.*?)^---[ \t]*$", text, re.S | re.M)
    return m.group(1) if m else None


def _readme_configs(path: Path) -> bool:
    header = _readme_header(path)
    return header is not None and re.search(r"^configs\s*:", header, re.M) is not None


def _nested_data_files(path: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        if Path(dirpath) == path:
            continue
        for name in sorted(filenames):
            if not name.startswith(".") and _is_data_file(name):
                yield Path(dirpath) / name


# --------------------------------------------------------------------------------------------
# Opening


def open_hf_source(source: str, options: SourceOptions, *, cache_dir: Path | None = None) -> Source:
    """The :class:`Source` of a Hugging Face dataset (see the module docstring for the three kinds).

    ``cache_dir``: hsx's cache directory; the ``datasets`` library keeps its lock and module files
    under ``<cache_dir>/hf-datasets`` (a streamed read caches no data).

    Raises:
        BadDataset: the dataset cannot be found or read (offline without a cached snapshot, not on
            the hub, a ``save_to_disk`` directory with a missing file, the library missing).
        BadConfig: ``--split`` / ``--subset`` name no split / subset of it (the message lists them).
    """
    _datasets()  # BadDataset when the library is missing
    hf_cache = str(Path(cache_dir) / "hf-datasets") if cache_dir is not None else None
    path = Path(source).expanduser()
    if path.is_dir():
        if _saved_kind(path) is not None:
            return SavedDataset(source, options)
        return StreamedDataset(source, options, root=path.resolve(), cache_dir=hf_cache)
    revision, snapshot = _hub_revision(source)
    return StreamedDataset(source, options, hub_id=source, revision=revision,
                           root=Path(snapshot) if snapshot else None, cache_dir=hf_cache)


def _datasets():
    try:
        import datasets
    except ImportError as exc:
        if exc.name == "datasets":
            raise BadDataset("reading a Hugging Face dataset needs the 'datasets' package, which is not installed: "
                             "pip install 'datasets>=3'") from None
        raise BadDataset(f"the 'datasets' package cannot be imported ({exc}): reinstall it (pip install --force-reinstall "
                         "'datasets>=3')") from None
    datasets.disable_progress_bars()  # the planner shows its own progress
    return datasets


def _choose_split(what: str, splits: list[str], asked: str | None) -> str:
    """``asked`` when ``what`` has it; else "train", or the only split. Raises BadConfig listing the splits."""
    if not splits:
        raise BadDataset(f"{what} has no split: the datasets library found no data file in it")
    listed = ", ".join(repr(s) for s in splits)
    if asked is not None:
        if asked in splits:
            return asked
        raise BadConfig(f"--split {asked!r}: {what} has no such split; its splits are {listed}: "
                        "give one of them with --split")
    if "train" in splits:
        return "train"
    if len(splits) == 1:
        return splits[0]
    raise BadConfig(f"{what} has {len(splits)} splits ({listed}) and none is 'train': choose one with --split NAME")


# --------------------------------------------------------------------------------------------
# The base: fingerprinted local files whose (size, mtime_ns) is watched


class _HfSource(Source):
    """What the Hugging Face sources share: options, the watched local files, the chosen split."""

    split: str
    _watched: list[tuple[Path, int, int]]

    def _hash_files(self, files: list[tuple[str, Path]], prefix: str) -> str:
        """sha256 of ``prefix`` then, per file, ``name:size;`` and the sha256 of each 8 MiB block
        (threads in parallel, as ``producer/sources.py``); the files' (size, mtime_ns) are taken
        before and checked after, so the hash names bytes that did not change while they were read."""
        stats = [(name, p, p.stat()) for name, p in files]
        self._watched = [(p, st.st_size, st.st_mtime_ns) for _name, p, st in stats]
        jobs = [(k, i) for k, (_n, _p, st) in enumerate(stats) for i in range(_num_blocks(st.st_size))]
        digests: dict[tuple[int, int], bytes] = {}

        def hash_block(job) -> None:
            k, i = job
            _n, p, st = stats[k]
            data = _read_block(p, st.st_size, i)
            if len(data) != min(BLOCK_BYTES, st.st_size - i * BLOCK_BYTES):
                raise self._changed(p, "it became shorter while it was fingerprinted")
            digests[job] = hashlib.sha256(data).digest()

        with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
            list(pool.map(hash_block, jobs))
        h = hashlib.sha256(prefix.encode())
        for k, (name, _p, st) in enumerate(stats):
            h.update(f"{name}:{st.st_size};".encode())
            for i in range(_num_blocks(st.st_size)):
                h.update(digests[(k, i)])
        self._check_unchanged()
        return h.hexdigest()

    def _changed(self, path: Path, why: str) -> DatasetChanged:
        return DatasetChanged(
            f"{path} (of dataset {self.source!r}) changed while it was planned: {why}. The plan stopped before any "
            "record read after the change was planned; run the same command again when the dataset no longer "
            "changes (a changed dataset is a new dataset: it gets a new run id)")

    def _check_unchanged(self) -> None:
        """Raises DatasetChanged when a watched file's size or mtime differs from when it was fingerprinted."""
        for path, size, mtime_ns in self._watched:
            try:
                st = path.stat()
            except OSError as exc:
                raise self._changed(path, f"it can no longer be read ({exc.strerror or exc})") from None
            if st.st_size != size or st.st_mtime_ns != mtime_ns:
                what = (f"its size went from {size:,} to {st.st_size:,} bytes" if st.st_size != size
                        else "it was written to (its mtime changed)")
                raise self._changed(path, what)

    def _rows(self, rows, what: str) -> Iterator[Any]:
        """The library's rows, its errors raised as BadDataset (DatasetChanged when a file changed)."""
        it = iter(rows)
        n = 0
        while True:
            try:
                row = next(it)
            except StopIteration:
                return
            except (DatasetChanged, KeyboardInterrupt):
                raise
            except Exception as exc:
                self._check_unchanged()
                raise BadDataset(f"{self.source}: the datasets library failed to read {what} after {n:,} records: "
                                 f"{type(exc).__name__}: {str(exc)[:500]}; fix the data files (or give a split "
                                 "that reads) and run again") from exc
            n += 1
            yield without_arrow_nulls(row)


# --------------------------------------------------------------------------------------------
# save_to_disk directories


class SavedDataset(_HfSource):
    """A ``save_to_disk`` directory: a ``Dataset``, or a ``DatasetDict`` of which one split is read.

    The split: ``options.split``, else "train", else the only split (a ``DatasetDict`` with several
    and no "train" raises BadConfig listing them). A ``Dataset`` directory is one split, named by
    its ``state.json`` (``_split``) or "train". ``options.subset`` does not apply (BadConfig).

    Raises BadDataset for a directory whose ``state.json`` names a missing file or that
    ``load_from_disk`` cannot open.
    """

    def __init__(self, source: str, options: SourceOptions):
        self.source, self.options = source, options
        self.root = Path(source).expanduser().resolve()
        self.kind = _saved_kind(self.root)
        self.name = self.root.name or "dataset"
        self.bytes_read = 0
        self._fingerprint: str | None = None
        self._watched = []
        what = f"the save_to_disk directory {source!r}"
        if options.subset is not None:
            raise BadConfig(f"--subset {options.subset!r}: {what} (a {self.kind}) has no subsets, only splits: "
                            "leave --subset out (--split chooses a split of a DatasetDict)")
        if self.kind == "DatasetDict":
            try:
                splits = [str(s) for s in json.loads((self.root / "dataset_dict.json").read_text())["splits"]]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise BadDataset(f"{self.root / 'dataset_dict.json'} cannot be read as a DatasetDict's index ({exc}); "
                                 "save the dataset again with save_to_disk") from None
            self.split = _choose_split(what, splits, options.split)
            self.split_dir = self.root / self.split
        else:
            self.split_dir = self.root
            own = self._state().get("_split") or "train"
            if options.split is not None and options.split != own:
                raise BadConfig(f"--split {options.split!r}: {what} is one Dataset (split {own!r}), not a DatasetDict: "
                                "leave --split out")
            self.split = own
        state = self._state()
        try:
            names = [str(d["filename"]) for d in state["_data_files"]]
        except (KeyError, TypeError) as exc:
            raise BadDataset(f"{self.split_dir / 'state.json'} lists no Arrow files ({exc!r} missing): save the "
                             "dataset again with save_to_disk") from None
        missing = [n for n in names if not (self.split_dir / n).is_file()]
        if missing:
            raise BadDataset(f"{what}: split {self.split!r} is missing {', '.join(missing)} (named in its state.json): "
                             "the directory is incomplete; copy it again or save the dataset again with save_to_disk")
        self.files = [self.split_dir / n for n in names]
        self.sizes = [p.stat().st_size for p in self.files]
        try:
            ds = _datasets().load_from_disk(str(self.split_dir), keep_in_memory=False)
        except Exception as exc:
            raise BadDataset(f"{what}: load_from_disk cannot open split {self.split!r}: {type(exc).__name__}: "
                             f"{str(exc)[:300]}; save the dataset again with save_to_disk") from None
        self.num_rows = int(ds.num_rows)
        self._chosen = choose_positions(self.num_rows, options)

    def _state(self) -> dict:
        try:
            return json.loads((self.split_dir / "state.json").read_text())
        except (OSError, ValueError) as exc:
            raise BadDataset(f"{self.split_dir / 'state.json'} cannot be read ({exc}): the save_to_disk directory "
                             "is incomplete; save the dataset again") from None

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    @property
    def total_records(self) -> int:
        return self.num_rows if self._chosen is None else len(self._chosen)

    def location(self) -> str:
        return str(self.root)

    def describe(self) -> dict:
        out = {"kind": "hf-saved", "format": self.kind, "split": self.split, "rows": self.num_rows,
               "files": [{"name": str(p.relative_to(self.root)), "bytes": n} for p, n in zip(self.files, self.sizes)],
               "fingerprint": FINGERPRINT_SAVED}
        order = describe_order(self.options)
        if order:
            out["order"] = order + ("; the order datasets.Dataset.shuffle(seed) gives" if self.options.shuffle
                                    and self.options.sample is None else "")
        return out

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = self._hash_files([(p.name, p) for p in self.files], f"saved;split={self.split};")
        return self._fingerprint

    def raw_records(self, skips: SkipCounter) -> Iterator[RawItem]:
        """Every chosen row, as a dict, fallback id ``<split>:<row>``. Raises DatasetChanged, BadDataset."""
        self.fingerprint()
        ds = _datasets().load_from_disk(str(self.split_dir), keep_in_memory=False).with_format(None)
        chosen = self._chosen
        # keep_in_memory: the indices of a selection stay in memory, never a cache file in the user's directory
        rows = ds if chosen is None else ds.select(chosen, keep_in_memory=True)
        total, total_bytes = self.total_records, self.total_bytes
        for j, row in enumerate(self._rows(rows, f"split {self.split!r}")):
            if j % CHECK_EVERY == 0:
                self._check_unchanged()
            yield RawItem(f"{self.split}:{j if chosen is None else int(chosen[j])}", row)
            self.bytes_read = int(total_bytes * (j + 1) / max(1, total))
        self._check_unchanged()
        self.bytes_read = total_bytes


# --------------------------------------------------------------------------------------------
# Streamed datasets: hub ids and local directories in the hub's layout


class StreamedDataset(_HfSource):
    """A dataset read with the ``datasets`` streaming reader: a hub id (``hub_id``, ``revision``; read
    from ``root`` when that is a cached snapshot) or a local directory in the hub's layout (``root``).

    The subset is ``options.subset`` (None: the dataset's default); the split ``options.split``,
    else "train", else the only split.

    Raises:
        BadConfig: the dataset has several subsets and none was chosen, or no such subset / split
            (the message lists them).
        BadDataset: the library cannot resolve the dataset's data files.
    """

    def __init__(self, source: str, options: SourceOptions, *, root: Path | None = None, hub_id: str | None = None,
                 revision: str | None = None, cache_dir: str | None = None):
        self.source, self.options = source, options
        self.root, self.hub_id, self.revision = root, hub_id, revision
        self.cache_dir = cache_dir
        self.name = hub_id.split("/")[-1] if hub_id else (root.name or "dataset")
        self.bytes_read = 0
        self._fingerprint: str | None = None
        self._watched = []
        self.what = (f"the hub dataset {hub_id!r}" + (f" (commit {revision[:12]})" if revision else "")) if hub_id \
            else f"the dataset directory {source!r}"
        target = str(root) if root is not None else hub_id
        self._target = target
        self.builder = self._builder(target)
        self.subset = self.builder.config.name
        data_files = self.builder.config.data_files
        splits = [str(s) for s in data_files] if data_files else [str(s) for s in (self.builder.info.splits or {})]
        self.split = _choose_split(self.what, splits, options.split)
        self.data_files = [str(f) for f in (data_files[self.split] if data_files else [])]
        self.local_files: list[tuple[str, Path]] = []
        if root is not None:
            for f in self.data_files:
                p = Path(f)
                if p.is_file():
                    try:
                        rel = str(p.resolve().relative_to(root.resolve())) if hub_id is None else str(p.relative_to(root))
                    except ValueError:
                        rel = str(p)
                    self.local_files.append((rel, p))
        splits_info = self.builder.info.splits or {}
        known = splits_info[self.split].num_examples if self.split in splits_info else None
        if not known and self.local_files and all(p.suffix.lower() == ".parquet" for _n, p in self.local_files):
            known = _parquet_rows([p for _n, p in self.local_files])  # the parquet builder yields every row
        self.num_rows: int | None = int(known) if known else None

    def _builder(self, target: str):
        datasets = _datasets()
        subset = self.options.subset
        try:
            return datasets.load_dataset_builder(target, name=subset, revision=self.revision if self.root is None else None,
                                                 cache_dir=self.cache_dir)
        except ValueError as exc:
            msg = str(exc)
            if "Config name is missing" in msg or ("BuilderConfig" in msg and "not found" in msg):
                configs = self._config_names(target)
                listed = ", ".join(repr(c) for c in configs) if configs else "(see the message below)"
                if subset is None:
                    raise BadConfig(f"{self.what} has {len(configs) or 'several'} subsets ({listed}): choose one with "
                                    "--subset NAME") from None
                raise BadConfig(f"--subset {subset!r}: {self.what} has no such subset; its subsets are {listed}: give "
                                "one of them with --subset" + ("" if configs else f" ({msg})")) from None
            raise BadDataset(f"{self.what} cannot be read by the datasets library: {msg[:500]}") from None
        except (BadConfig, BadDataset):
            raise
        except Exception as exc:
            hint = ("; check the id (and HF_TOKEN for a private or gated dataset)" if self.hub_id else
                    "; a directory in the hub's layout holds its data files in subfolders "
                    "(data/train-00000-of-00001.parquet) or a README.md declaring configs")
            raise BadDataset(f"{self.what} cannot be read by the datasets library: {type(exc).__name__}: "
                             f"{str(exc)[:500]}{hint}") from None

    def _config_names(self, target: str) -> list[str]:
        try:
            return [str(c) for c in _datasets().get_dataset_config_names(
                target, revision=self.revision if self.root is None else None, cache_dir=self.cache_dir)]
        except Exception:
            return []

    @property
    def total_records(self) -> int | None:
        if self.options.sample is not None:
            return min(self.options.sample, self.num_rows) if self.num_rows is not None else self.options.sample
        return self.num_rows

    @property
    def total_bytes(self) -> int | None:
        if self.local_files and self.num_rows is not None and self.options.sample is None:
            return sum(p.stat().st_size for _n, p in self.local_files)
        return None

    def location(self) -> str:
        return self.hub_id or str(self.root)

    def describe(self) -> dict:
        out: dict[str, Any] = {"kind": "hf-hub" if self.hub_id else "hf-local", "builder": self.builder.name,
                               "subset": self.subset, "split": self.split, "rows": self.num_rows}
        if self.hub_id:
            out.update(id=self.hub_id, revision=self.revision, data_files=len(self.data_files),
                       fingerprint=FINGERPRINT_HUB)
            if self.root is not None:
                out["read_from"] = f"the local hub cache: {self.root} (offline)"
        else:
            out.update(files=[{"name": n, "bytes": p.stat().st_size} for n, p in self.local_files],
                       fingerprint=FINGERPRINT_LOCAL)
        order = self._describe_order()
        if order:
            out["order"] = order
        return out

    def _describe_order(self) -> str | None:
        o = self.options
        buffer = (f"a seeded buffer shuffle of {SHUFFLE_BUFFER:,} records (numpy default_rng({o.seed}); the algorithm of "
                  "the datasets streaming IterableDataset.shuffle over the split in its order, without its shuffle of "
                  "the shard order, so that fallback ids stay positions in the split): not a true permutation, a record "
                  f"comes out at most about {SHUFFLE_BUFFER:,} records before its place")
        if o.sample is not None:
            picked = (f"a seeded random subset of {o.sample:,} records (numpy default_rng({o.seed}).choice without "
                      "replacement over the split's positions), read in dataset order")
            return picked + ("; then " + buffer if o.shuffle else "")
        return buffer if o.shuffle else None

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            if self.hub_id:
                self._fingerprint = hashlib.sha256(
                    f"hub;{self.hub_id}@{self.revision};subset={self.subset};split={self.split}".encode()).hexdigest()
                if self.root is not None:  # a cached snapshot: its files are watched while read
                    self._watched = [(p, p.stat().st_size, p.stat().st_mtime_ns) for _n, p in self.local_files]
            else:
                header = _readme_header(self.root) or ""
                prefix = (f"local;subset={self.subset};split={self.split};readme="
                          f"{hashlib.sha256(header.encode()).hexdigest()};")
                self._fingerprint = self._hash_files(self.local_files, prefix)
        return self._fingerprint

    def _stream(self):
        try:
            return self.builder.as_streaming_dataset(split=self.split)
        except Exception as exc:
            raise BadDataset(f"{self.what}: the datasets library cannot stream split {self.split!r}: "
                             f"{type(exc).__name__}: {str(exc)[:500]}") from None

    def _count(self) -> int:
        log.info("%s: counting the records of split %r for --sample (its metadata does not say): one pass",
                 self.source, self.split)
        n = 0
        for n, _row in enumerate(self._rows(self._stream(), f"split {self.split!r}"), start=1):
            if n % CHECK_EVERY == 0:
                self._check_unchanged()
        self._check_unchanged()
        self.num_rows = n
        return n

    def _in_order(self) -> Iterator[tuple[int, Any]]:
        """(position, row) of the records that are read, in the split's order."""
        rows = enumerate(self._rows(self._stream(), f"split {self.split!r}"))
        if self.options.sample is None:
            yield from rows
            return
        total = self.num_rows if self.num_rows is not None else self._count()
        chosen = choose_positions(total, SourceOptions(sample=self.options.sample, seed=self.options.seed))
        if not len(chosen):
            return
        k = 0
        for i, row in rows:
            if i == chosen[k]:
                yield i, row
                k += 1
                if k == len(chosen):
                    return

    def raw_records(self, skips: SkipCounter) -> Iterator[RawItem]:
        """Every chosen record, as a dict, fallback id ``<split>:<position>``. Raises DatasetChanged, BadDataset."""
        self.fingerprint()
        items = self._in_order()
        if self.options.shuffle:
            items = buffer_shuffle(items, SHUFFLE_BUFFER, np.random.default_rng(self.options.seed))
        total, total_bytes = self.total_records, self.total_bytes
        for j, (i, row) in enumerate(items):
            if j % CHECK_EVERY == 0:
                self._check_unchanged()
            yield RawItem(f"{self.split}:{i}", row)
            if total_bytes and total:
                self.bytes_read = int(total_bytes * min(1.0, (j + 1) / total))
        self._check_unchanged()
        if total_bytes:
            self.bytes_read = total_bytes


def _parquet_rows(paths: list[Path]) -> int | None:
    """Rows of these parquet files from their footers (no row is read), or None when one cannot be read."""
    try:
        import pyarrow.parquet as pq

        return sum(pq.ParquetFile(p).metadata.num_rows for p in paths)
    except Exception:
        return None


def buffer_shuffle(items, buffer_size: int, rng: np.random.Generator) -> Iterator:
    """``items`` in a seeded buffer-shuffled order, holding at most ``buffer_size`` of them: the
    algorithm of ``datasets``' streaming ``IterableDataset.shuffle`` (fill the buffer, permute it,
    yield all but half of it, keep that half; at the end permute and yield what is left)."""
    buffer: list = []
    for x in items:
        buffer.append(x)
        if len(buffer) >= buffer_size:
            order = rng.permutation(len(buffer))
            keep = buffer_size // 2
            cut = len(buffer) - keep
            for i in order[:cut]:
                yield buffer[i]
            buffer = [buffer[i] for i in order[cut:]]
    if buffer:
        for i in rng.permutation(len(buffer)):
            yield buffer[i]


# --------------------------------------------------------------------------------------------
# The hub


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _offline() -> bool:
    if _env_true("HF_HUB_OFFLINE") or _env_true("HF_DATASETS_OFFLINE"):
        return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except Exception:
        return False


def _hub_cache_dir() -> str:
    """The hub cache as the environment names it now (``HF_HUB_CACHE``, else ``HF_HOME/hub``)."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return os.path.expanduser(os.environ[name])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _cached_snapshot(hub_id: str) -> tuple[str, str] | None:
    """(commit sha, snapshot directory) of the dataset in the local hub cache, or None (one look, no network)."""
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(hub_id, repo_type="dataset", local_files_only=True, cache_dir=_hub_cache_dir())
    except Exception:
        return None
    return Path(path).name, path


def _hub_revision(hub_id: str) -> tuple[str, str | None]:
    """(commit sha, local snapshot directory or None) of a hub dataset.

    Online: the hub's current commit (``HfApi().dataset_info``, one request of at most
    :data:`HUB_TIMEOUT_S` s); offline or unreachable: the hub cache's snapshot. Raises BadDataset
    naming the id, what was tried and the fix.
    """
    if not _HUB_ID.match(hub_id):
        raise BadDataset(f"dataset {hub_id!r} does not exist: give a .json/.jsonl/.parquet file, a directory, "
                         f"{SHAREGPT!r}, or a Hugging Face dataset (a hub id org/name, a save_to_disk directory)")
    local = (f"(no local path {hub_id!r} exists either: if you meant a local directory or file, check the path)")
    cache = _hub_cache_dir()
    fix = (f"download it where there is network (hf download {hub_id} --repo-type dataset) into this hub cache, or "
           "give a local copy (a save_to_disk directory or a directory in the hub's layout)")
    if _offline():
        found = _cached_snapshot(hub_id)
        if found:
            log.info("%s: offline, reading the hub cache's snapshot %s", hub_id, found[1])
            return found
        raise BadDataset(f"hub dataset {hub_id!r} cannot be read offline: HF_HUB_OFFLINE is set, so the hub was not "
                         f"asked, and the hub cache {cache} holds no snapshot of it (looked once). Fix: unset HF_HUB_OFFLINE (and HF_DATASETS_OFFLINE) "
                         f"where the hub can be reached, or {fix}. {local}")
    try:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError
    except ImportError:
        raise BadDataset("reading a hub dataset needs the 'huggingface_hub' package: pip install 'datasets>=3'") from None
    try:
        info = HfApi().dataset_info(hub_id, timeout=HUB_TIMEOUT_S)
        return str(info.sha), None
    except GatedRepoError:
        raise BadDataset(f"hub dataset {hub_id!r} is gated: accept its terms on huggingface.co/datasets/{hub_id} and "
                         "set HF_TOKEN (or hf auth login) to a token of that account") from None
    except RepositoryNotFoundError:
        raise BadDataset(f"hub dataset {hub_id!r} was not found on the Hugging Face hub (or it is private: set HF_TOKEN "
                         f"to a token that can read it) {local}") from None
    except HfHubHTTPError as exc:
        why = f"the hub answered {str(exc)[:200]}"
    except Exception as exc:  # no network: httpx / requests / OSError
        why = f"the hub could not be reached ({type(exc).__name__}: {str(exc)[:200]})"
    found = _cached_snapshot(hub_id)
    if found:
        log.warning("%s: %s; reading the hub cache's snapshot %s (commit %s)", hub_id, why, found[1], found[0])
        return found
    raise BadDataset(f"hub dataset {hub_id!r} cannot be read: asked the hub which commit it is at, and {why}; the hub "
                     f"cache {cache} holds no snapshot of it (looked once). Fix: run where the hub can be reached (a proxy: HTTPS_PROXY), "
                     f"or {fix}. {local}")
