"""What every dataset source shares, below the modules that read one: the options that choose its
records (:class:`SourceOptions`), a record as read (:class:`RawItem`), the abstract :class:`Source`,
:class:`DatasetChanged`, and the fingerprint's blocks (:data:`BLOCK_BYTES`).

``producer/sources.py`` (local files, and :func:`~producer.sources.open_source`, which picks the
source), ``producer/hfsource.py`` (Hugging Face datasets), ``producer/selection.py`` (``--shuffle`` /
``--sample`` of local files) and ``producer/regenerate.py`` (a regenerate run as a dataset) import
these from here and nothing of each other's but what they call; ``producer/sources.py`` re-exports
them. See ``producer/sources.py``'s docstring for what the fingerprint names and how it is checked.
"""

from __future__ import annotations

import io
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

from hsx.errors import BadConfig, BadDataset
from producer.datasets import SkipCounter

#: Bytes per fingerprint block: the unit the reading pass checks (and holds in memory) at a time.
BLOCK_BYTES = 8 << 20


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


class CheckedFiles(Protocol):
    """What ``producer/selection.py`` reads of a local-files source (:class:`producer.sources.LocalFiles`):
    its ``files`` (each with ``path`` and ``size``, as fingerprinted), ``options``, ``total_bytes``,
    ``bytes_read`` (progress), :meth:`fingerprint` and :meth:`open_checked`."""

    files: Sequence[Any]
    options: SourceOptions
    bytes_read: int

    @property
    def total_bytes(self) -> int: ...

    def fingerprint(self) -> str: ...

    def open_checked(self, index: int) -> io.BufferedReader:
        """A binary file object of file ``index`` whose every block is checked against the fingerprint."""
        ...


def _num_blocks(size: int) -> int:
    return (size + BLOCK_BYTES - 1) // BLOCK_BYTES


def _read_block(path: Path, size: int, i: int) -> bytes:
    n = min(BLOCK_BYTES, size - i * BLOCK_BYTES)
    with open(path, "rb") as fh:
        data = os.pread(fh.fileno(), n, i * BLOCK_BYTES)
    return data
