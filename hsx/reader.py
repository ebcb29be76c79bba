"""Reading a run back for training: one sample's tensors at a time, straight from the shards.

Legend (shape suffixes): S = tokens of one sample, T = tokens of a shard, N = samples of a shard,
K = captured layers, H = hidden size.

Two datasets, both ``torch.utils.data`` datasets that yield one dict per sample:

- :class:`HiddenStatesDataset` (map-style) over a **local** run. ``ds[i]`` is the i-th stored
  sample in ``sample_index`` order. Its index is built once from the markers and each shard's
  small ``sample_index`` / ``cu_seqlens`` tensors; ``__getitem__`` reads only that sample's rows
  with safetensors ``safe_open(...).get_slice(...)[start:end]`` on a memory-mapped file, so a
  10 GB shard costs one sample's bytes per item.
- :class:`IterableHiddenStatesDataset` streams shard by shard from any store. On S3 each shard
  is downloaded to a temp file (one at a time per worker), checked against its marker's sha256,
  read sample by sample and deleted. DataLoader workers (and ``rank`` / ``world_size``) split
  the shards between them.

Each sample is::

    sample_index     int                    the sample's line in plan/samples.jsonl
    input_ids        int64  [S]             token ids as fed to the target
    loss_mask        int64  [S]             1 on supervised (assistant) tokens
    hidden_states    bf16/fp32 [S, K*H]     the K layers concatenated in ascending layer id
                                            (layer k occupies columns k*H:(k+1)*H)
    final_postnorm   bf16/fp32 [S, H]       when the run stored it (and it was asked for)
    final_prenorm    bf16/fp32 [S, H]       when the run stored it (and it was asked for)

in the run's stored dtype, except for an fp8 run (``--store-dtype fp8``, ``hsx/fp8.py``): its
states are dequantised (``q * scale`` per token and layer) to ``dequant_dtype``, bf16 by default,
so that a user never sees fp8 unless they ask: ``raw=True`` returns the stored float8_e4m3fn
tensors as they are, with ``hidden_states_scale`` float32 [S, K] and ``final_*_scale`` float32 [S].

Only batches whose marker exists and carries the run's ``config_sha256`` are read (a batch is done
if and only if that holds, :class:`hsx.records.Marker`). Samples a marker lists as ``quarantined`` are never
returned, whether or not their rows are in the shard. A sample certified by two markers is a
corrupt run: the map-style dataset refuses it (run ``python -m producer verify``).
"""

from __future__ import annotations

import logging
import os
import random
import tempfile
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

from hsx.errors import BadConfig, FidelityError
from hsx.records import Marker, ShardRef, read_markers
from hsx.regen import refuse_regenerate_run
from hsx.runconfig import RunConfig, load_run
from hsx.shard import HIDDEN_STATES, Final, scale_name
from hsx.store import MissingKey, Store, download, open_store

log = logging.getLogger(__name__)

#: open safe_open handles a map-style dataset keeps (per process); each is one mmap.
MAX_OPEN_SHARDS = 16
#: seconds a reader retries a shard read that fails for a transient reason (S3 timeout, reset, 5xx)
#: before it raises StoreError: a training job rides out a short store hiccup.
SHARD_READ_RETRY_S = 120.0

try:  # torch is a hard dependency of the project, but keep the index helpers importable without it
    from torch.utils.data import Dataset as _Dataset
    from torch.utils.data import IterableDataset as _IterableDataset
except ImportError:  # pragma: no cover
    _Dataset = object  # type: ignore[assignment,misc]
    _IterableDataset = object  # type: ignore[assignment,misc]


# --- markers and shards ---------------------------------------------------------------------


def quarantined_ids(marker: Marker) -> set[int]:
    """Sample indices a marker lists as quarantined (:attr:`hsx.records.Marker.quarantined_ids`)."""
    return marker.quarantined_ids


def marker_problem(batch: str, marker: Marker | Exception, config_sha256: str) -> str | None:
    """Why ``marker`` (read from ``markers/<batch>.json``) does not certify ``batch`` of the run whose
    ``config_sha256`` is given, or None when it does: it must be readable, name its own batch and
    carry the run's config hash (:class:`hsx.records.Marker`)."""
    if isinstance(marker, Exception):
        return f"marker of {batch} is unreadable ({marker}): skipped; run `python -m producer verify`"
    if marker.batch != batch or marker.config_sha256 != config_sha256:
        return (f"marker of {batch} does not certify this run's batch {batch} (batch {marker.batch!r}, "
                f"config {marker.config_sha256[:12]}): skipped")
    return None


def certified_markers(run_store: Store, config: RunConfig) -> dict[str, Marker]:
    """Markers that certify a batch of this run: readable, naming their own batch, with the run's
    ``config_sha256``. Others are logged and left out (``verify`` reports them)."""
    want = config.identity_sha256()
    out = {}
    for batch, marker in sorted(read_markers(run_store).items()):
        problem = marker_problem(batch, marker, want)
        if problem:
            log.warning("%s", problem)
            continue
        out[batch] = marker
    return out


@contextmanager
def local_shard(run_store: Store, key: str, *, expect: ShardRef | None = None, tmp_dir: Path | None = None,
                retry_s: float = SHARD_READ_RETRY_S) -> Iterator[Path]:
    """A local path of shard ``key`` for the duration of the block.

    Local store: the file itself (memory-mappable, no copy). Other stores: a temp file
    downloaded into ``tmp_dir`` (default: the system temp dir) through the store's ranged reads
    (:func:`hsx.store.download`, each read retried on a transient error for up to ``retry_s``
    seconds) and deleted afterwards. ``expect`` (the marker's :class:`~hsx.records.ShardRef`:
    ``bytes``, ``sha256``) makes it check the bytes (hashed as they are downloaded; a local file is
    hashed with :meth:`Store.sha256`) and raise :class:`~hsx.errors.FidelityError` when they do not match.

    Raises:
        hsx.store.MissingKey: the shard is absent.
        hsx.errors.StoreError: the store could not be read (after the retries, for a transient error).
    """
    path = run_store.local_path(key)
    tmp: Path | None = None
    if path is None:
        fd, name = tempfile.mkstemp(prefix="hsx-shard-", suffix=".safetensors", dir=tmp_dir)
        os.close(fd)
        tmp = path = Path(name)
    try:
        if tmp is not None:
            n, digest = download(run_store, key, tmp, retry_s=retry_s)
        elif expect is not None:
            n, digest = run_store.sha256(key)
        if expect is not None:
            if n != expect.bytes or digest != expect.sha256.lower():
                raise FidelityError(
                    f"shard {key} in {run_store.url}: sha256 {digest} ({n} bytes), its marker says "
                    f"{expect.sha256} ({expect.bytes} bytes); run `python -m producer verify`"
                )
        yield path
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)


@contextmanager
def certified_rows(run_store: Store, marker: Marker, *, check: bool, tmp_dir: Path | None = None,
                   start: int = 0) -> Iterator[tuple[object, list[tuple[int, int, int, int]]]]:
    """The shard ``marker`` certifies, open for the block: ``(f, rows)``, ``f`` a ``safe_open(...,
    framework="pt")`` handle and ``rows`` its ``(row, sample_index, start, end)`` from row ``start`` on, in
    shard row order, quarantined samples left out (``start``/``end``: token offsets, ``cu_seqlens``).
    ``check`` hashes the shard against the marker first (:func:`local_shard`'s ``expect``).

    Raises:
        hsx.errors.FidelityError: ``check`` and the bytes differ from the marker's, or the shard is absent
            (every reader says it so, with the command that finds the rest: ``verify``).
    """
    from safetensors import safe_open

    skip = quarantined_ids(marker)
    if run_store.size(marker.shard.key) is None:  # one stat / HEAD: said as every reader says it, not a bare OSError
        raise _missing_shard(run_store, marker)
    with local_shard(run_store, marker.shard.key, expect=marker.shard if check else None, tmp_dir=tmp_dir) as path:
        with safe_open(str(path), framework="pt") as f:
            sample_index_N = f.get_tensor("sample_index").tolist()
            cu_N1 = f.get_tensor("cu_seqlens").tolist()
            yield f, [(j, int(sample_index_N[j]), cu_N1[j], cu_N1[j + 1])
                      for j in range(start, len(sample_index_N)) if sample_index_N[j] not in skip]


def _missing_shard(run_store: Store, marker: Marker) -> FidelityError:
    return FidelityError(f"batch {marker.batch}: shard {marker.shard.key} is missing from {run_store.url}; "
                         "run `python -m producer verify` (then `reconcile --repair` and the run command again)")


def shard_index(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """``(sample_index_N, cu_seqlens_N1)`` of a shard, read without touching its hidden states."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        return f.get_tensor("sample_index").astype(np.int64), f.get_tensor("cu_seqlens").astype(np.int64)


def _final_names(config: RunConfig, finals: str) -> tuple[str, ...]:
    """Which final tensors to return: ``present`` (whatever the run stored) or a
    :class:`hsx.shard.Final` value. Raises BadConfig when the run lacks what is asked."""
    stored = config.layers.final.tensors
    if finals == "present":
        return stored
    if finals not in tuple(Final):
        raise BadConfig(f"finals={finals!r}: use present, {', '.join(Final)}")
    asked = Final(finals).tensors
    missing = [n for n in asked if n not in stored]
    if missing:
        raise BadConfig(
            f"run {config.run_id} stored final={config.layers.final.value!r}, so {missing} cannot be read; "
            "re-run the extraction with --final postnorm|prenorm|both"
        )
    return asked


def read_sample(f, start: int, end: int, finals: tuple[str, ...], *, dequant_dtype=None, raw: bool = False) -> dict:
    """One sample's tensors from an open ``safe_open(..., framework="pt")`` handle.

    Rows ``[start, end)`` only: ``get_slice`` reads those bytes of the memory-mapped file.
    Returns ``input_ids`` / ``loss_mask`` int64 [S], ``hidden_states`` [S, K*H] and the asked
    ``finals`` [S, H] in the stored dtype; from an fp8 shard (it holds ``hidden_states_scale``)
    dequantised to ``dequant_dtype`` (default bf16), or with ``raw`` the stored float8_e4m3fn
    tensors plus their scales (``hidden_states_scale`` float32 [S, K], ``<final>_scale`` [S]).
    """
    import torch

    from hsx.fp8 import dequantize_fp8

    hidden_SKH = f.get_slice(HIDDEN_STATES)[start:end]
    S, K, H = hidden_SKH.shape
    scaled = scale_name(HIDDEN_STATES) in f.keys()
    dtype = torch.bfloat16 if dequant_dtype is None else dequant_dtype

    def state(name: str, value: torch.Tensor) -> torch.Tensor:
        if not scaled or raw:
            return value
        return dequantize_fp8(value, f.get_slice(scale_name(name))[start:end], dtype)

    out = {
        "input_ids": f.get_slice("input_ids")[start:end].to(torch.int64),
        "loss_mask": f.get_slice("loss_mask")[start:end].to(torch.int64),
        # Row-major [S, K, H] -> [S, K*H] is a view: layer k is columns k*H:(k+1)*H.
        HIDDEN_STATES: state(HIDDEN_STATES, hidden_SKH).reshape(S, K * H),
    }
    for name in finals:
        out[name] = state(name, f.get_slice(name)[start:end])
    if scaled and raw:
        for name in (HIDDEN_STATES, *finals):
            out[scale_name(name)] = f.get_slice(scale_name(name))[start:end]
    return out


def _open_run(run: str | Path | Store, settings) -> Store:
    if isinstance(run, (str, Path)):
        return open_store(str(run), settings, create=False)  # a reader creates nothing
    return run


# --- map-style ------------------------------------------------------------------------------


def _address(run: str | Path | Store, store: Store) -> str:
    """The run's address as given (a path or URL), for messages; a Store's URL."""
    return str(run) if isinstance(run, (str, Path)) else store.url


def _check_shards(store: Store, markers: dict[str, Marker], threads: int = 8) -> None:
    """Hash each marker's shard in ``store`` against the marker (:func:`local_shard` with ``expect``).
    Raises FidelityError naming the first bad or missing shard in batch order."""
    from concurrent.futures import ThreadPoolExecutor

    def check(item: tuple[str, Marker]) -> str | None:
        batch, marker = item
        try:
            with local_shard(store, marker.shard.key, expect=marker.shard):
                return None
        except FidelityError as exc:
            return f"batch {batch}: {exc}"
        except MissingKey:
            return f"batch {batch}: shard {marker.shard.key} is missing; run `python -m producer verify`"

    with ThreadPoolExecutor(threads) as pool:
        problems = [p for p in pool.map(check, sorted(markers.items())) if p]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise FidelityError(problems[0] + more)


class HiddenStatesDataset(_Dataset):
    """Map-style dataset over a local run: ``ds[i]`` is the i-th stored sample by ``sample_index``.

    Args:
        run: the run's address (``<output>/<run_id>``, a path or ``file://`` URL) or its Store.
        finals: which final states to return: ``present`` (default: what the run stored),
            ``none``, ``postnorm``, ``prenorm`` or ``both``.
        settings: :class:`settings.Settings` for opening ``run`` (only needed for URLs).
        dequant_dtype: dtype the states of an fp8 run are dequantised to (default ``torch.bfloat16``);
            other runs return their stored dtype.
        raw: an fp8 run's stored float8_e4m3fn tensors and their ``*_scale`` tensors, not dequantised.
        verify: hash every shard against its marker's sha256 here, once (threads; about the disk's
            read speed), before any sample is read. Default False: the shards are memory-mapped as they
            are (``python -m producer verify`` checks a run the same way).

    Raises:
        BadConfig: the run is not on a local filesystem (use :class:`IterableHiddenStatesDataset`),
            or asked finals were not stored.
        FidelityError: a sample is certified by two batches (a corrupt run: run ``verify``), or with
            ``verify``, a shard's bytes are not those its marker certifies.
        hsx.store.MissingKey: no ``run.json`` at ``run``.
    """

    def __init__(self, run: str | Path | Store, *, finals: str = "present", settings=None, dequant_dtype=None,
                 raw: bool = False, verify: bool = False):
        store = _open_run(run, settings)
        self.dequant_dtype, self.raw = dequant_dtype, raw
        self.config = load_run(store)
        refuse_regenerate_run(self.config, _address(run, store))
        if not store.location.is_local:
            raise BadConfig(
                f"{store.url} is not a local directory: the map-style HiddenStatesDataset memory-maps shards; "
                "use IterableHiddenStatesDataset to stream from S3, or copy the run locally"
            )
        self.run_url = store.url
        self.layer_ids: list[int] = list(self.config.layers.layer_ids)
        self.hidden_size = self.config.model.hidden_size
        self.finals = _final_names(self.config, finals)

        paths: list[str] = []
        rows: list[tuple[int, int, int, int]] = []  # (sample_index, shard id, start, end)
        owner: dict[int, str] = {}
        markers = certified_markers(store, self.config)
        if verify:
            _check_shards(store, markers)
        for batch, marker in markers.items():
            path = store.local_path(marker.shard.key)
            if path is None or not path.is_file():
                raise _missing_shard(store, marker)
            skip = quarantined_ids(marker)
            sample_index_N, cu_N1 = shard_index(path)
            shard_id = len(paths)
            paths.append(str(path))
            for j, sample in enumerate(sample_index_N.tolist()):
                if sample in skip:
                    continue
                if sample in owner:
                    raise FidelityError(
                        f"sample {sample} is certified twice, by batches {owner[sample]} and {batch}; "
                        "run `python -m producer verify` on " + store.url
                    )
                owner[sample] = batch
                rows.append((sample, shard_id, int(cu_N1[j]), int(cu_N1[j + 1])))
        rows.sort()
        table = np.asarray(rows, dtype=np.int64).reshape(-1, 4)
        self._sample_index_N = table[:, 0].copy()
        self._shard_N = table[:, 1].copy()
        self._start_N = table[:, 2].copy()
        self._end_N = table[:, 3].copy()
        self._paths = paths
        self._handles: OrderedDict[int, object] = OrderedDict()

    def __len__(self) -> int:
        return int(self._sample_index_N.shape[0])

    @property
    def sample_indices(self) -> np.ndarray:
        """int64 [len]: the ``sample_index`` of each position, ascending."""
        return self._sample_index_N

    def position_of(self, sample_index: int) -> int:
        """Position ``i`` with ``ds[i]["sample_index"] == sample_index``; KeyError if not stored."""
        i = int(np.searchsorted(self._sample_index_N, sample_index))
        if i >= len(self) or self._sample_index_N[i] != sample_index:
            raise KeyError(f"sample {sample_index} is not stored in {self.run_url}")
        return i

    def _handle(self, shard_id: int):
        from safetensors import safe_open

        f = self._handles.get(shard_id)
        if f is None:
            f = safe_open(self._paths[shard_id], framework="pt")
            self._handles[shard_id] = f
            if len(self._handles) > MAX_OPEN_SHARDS:
                self._handles.popitem(last=False)
        else:
            self._handles.move_to_end(shard_id)
        return f

    def __getitem__(self, i: int) -> dict:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} out of range for {n} samples")
        f = self._handle(int(self._shard_N[i]))
        sample = read_sample(f, int(self._start_N[i]), int(self._end_N[i]), self.finals, dequant_dtype=self.dequant_dtype,
                             raw=self.raw)
        return {"sample_index": int(self._sample_index_N[i]), **sample}

    def __getstate__(self) -> dict:
        # DataLoader workers get a copy without open handles: each process opens its own mmaps.
        state = dict(self.__dict__)
        state["_handles"] = OrderedDict()
        return state


# --- iterable -------------------------------------------------------------------------------


class IterableHiddenStatesDataset(_IterableDataset):
    """Streams a run shard by shard from any store (local directory or S3).

    Args:
        run: the run's address (``<output>/<run_id>``, ``s3://bucket/prefix/<run_id>``) or its Store.
        finals: as for :class:`HiddenStatesDataset`.
        settings: :class:`settings.Settings` for S3 endpoint and credentials.
        shuffle_shards: visit shards in a random order (``seed``; samples stay in shard order).
        rank, world_size: split shards between training processes (shard i goes to rank
            ``i % world_size``); DataLoader workers split each rank's shards again.
        verify: hash each shard against its marker before reading it (default: only downloaded
            copies, which costs no extra read; ``True``: local files too; ``False``: never).
        tmp_dir: where downloaded shards live while they are read (default: system temp dir).
        dequant_dtype, raw: as for :class:`HiddenStatesDataset` (fp8 runs).
    """

    def __init__(self, run: str | Path | Store, *, finals: str = "present", settings=None, shuffle_shards: bool = False,
                 seed: int = 0, rank: int = 0, world_size: int = 1, verify: bool | None = None,
                 tmp_dir: Path | None = None, dequant_dtype=None, raw: bool = False):
        if not 0 <= rank < world_size:
            raise BadConfig(f"rank {rank} / world_size {world_size}: need 0 <= rank < world_size")
        self.store = _open_run(run, settings)
        self.config = load_run(self.store)
        refuse_regenerate_run(self.config, _address(run, self.store))
        self.layer_ids: list[int] = list(self.config.layers.layer_ids)
        self.hidden_size = self.config.model.hidden_size
        self.finals = _final_names(self.config, finals)
        self.markers = certified_markers(self.store, self.config)
        self.shuffle_shards = shuffle_shards
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.verify = verify
        self.tmp_dir = tmp_dir
        self.dequant_dtype, self.raw = dequant_dtype, raw
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Change the shard order of the next pass when ``shuffle_shards`` is on."""
        self.epoch = epoch

    def batches(self) -> list[str]:
        """The batches this process (and DataLoader worker) reads, in visiting order."""
        import torch.utils.data

        names = sorted(self.markers)
        if self.shuffle_shards:
            random.Random(self.seed + self.epoch).shuffle(names)
        names = names[self.rank::self.world_size]
        info = torch.utils.data.get_worker_info()
        if info is not None:
            names = names[info.id::info.num_workers]
        return names

    def iter_batch(self, batch: str) -> Iterator[dict]:
        """The samples of one certified batch, in shard row order (quarantined ones left out)."""
        check = self.verify if self.verify is not None else self.store.location.is_s3
        with certified_rows(self.store, self.markers[batch], check=check, tmp_dir=self.tmp_dir) as (f, rows):
            for _, sample, a, b in rows:
                yield {"sample_index": sample, **read_sample(f, a, b, self.finals, dequant_dtype=self.dequant_dtype,
                                                             raw=self.raw)}

    def __iter__(self) -> Iterator[dict]:
        for batch in self.batches():
            yield from self.iter_batch(batch)
