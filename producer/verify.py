"""``python -m producer verify RUN_ADDRESS``: check a run's output against its markers and its plan.

What is checked, batch by batch (a thread pool; shards are hashed as a stream, never loaded whole):

- the marker: readable JSON, names its own batch, carries the ``config_sha256`` of ``run.json``'s
  identity, and belongs to a planned batch;
- its shard: present, with the marker's byte count and sha256;
- the shard's schema, from its safetensors header alone: :func:`hsx.shard.schema_problems` for
  the run's :class:`~hsx.shard.ShardSpec` (``input_ids`` int32 [T], ``loss_mask`` uint8 [T],
  ``cu_seqlens`` int64 [N+1], ``sample_index`` int64 [N], ``hidden_states`` [T, K, H] and the
  run's final states in the run's ``store_dtype``; for fp8 ``F8_E4M3`` plus
  ``hidden_states_scale`` F32 [T, K] and ``final_*_scale`` F32 [T]), contiguous data offsets
  that end at the end of the file, and the header metadata (its keys; run id, batch, layer ids,
  final, schema version);
- counts: the marker's ``num_samples`` / ``num_tokens`` / ``supervised_tokens`` equal the shard's,
  and its ``planned_*`` (when present) equal the plan's batch;
- token-id echo: every stored sample's ``input_ids`` and ``loss_mask`` equal the plan's, and the
  shard holds exactly the batch's planned samples minus the marker's ``quarantined`` ones.

The plan itself, when it was streamed in windows (``hsx/plan.py``; runs made before windows, with
``plan/samples.jsonl``, are not checked here), so that every sample of the plan is in exactly one
batch (problem kind ``plan_mismatch``, naming the batch or the window; ``plan_unreadable`` for a
record that does not parse; ``plan_missing`` for a missing batch file):

- the windows are numbered from 0 without a gap, each record under its own name; each one's
  samples start where the previous one's end (``first_sample``), its batches likewise
  (``first_batch``, named ``b<first_batch + i>``); only the last window is marked ``last``;
- each window's sample rows (``plan/samples/<window>.jsonl``) are exactly its ``sample_index``
  range, in order, and each row's ``batch`` is one of the window's batches;
- each batch file's ``sample_index`` values are exactly the rows that name the batch, each
  sample's length and supervised tokens are its row's, and the batch's sample and token counts
  are its window's summary;
- once the plan is complete: ``plan/batches.json`` is the windows' batches, in order, and
  ``plan/stats.json`` counts their samples, batches and windows.

A plan not complete yet (``plan/batches.json`` not written) is reported ``plan_incomplete``, with
the windows written so far and whether its planner still runs; the markers are then checked
against the batches of those windows, and the windows as above.

Across the run: every planned sample is present exactly once (a quarantined sample counts as
accounted for, not missing); a planned batch without a marker is reported as ``failed`` with its
reason when a worker recorded a failure for it (``failures/<batch>.json``: tried
``workers.causes.TRIES`` times, or failed for good), else as ``not_done`` (not extracted yet); a sample
in two certified shards is reported with both batches. Shards that no marker names are orphans
(the loser of a race, an interrupted upload, a worker still writing): listed, not an error.

``recompute=N`` then picks N stored samples at random and runs the run's model in fp32, one
sample at a time, through the reference forward (:func:`hsx.reference.reference_states`: the
plain transformers ``output_hidden_states`` path, where layer id ``i < N - 1`` is
``hidden_states[i + 1]`` and the post-norm state is ``hidden_states[N]``; the pre-norm state and
layer ``N - 1`` come from a hook on the last decoder layer, because transformers puts the
post-norm state in the last slot). Each stored tensor must satisfy
``|stored - ref| <= rtol * (|ref| + rms(ref))`` elementwise, with ``rtol`` by stored dtype
(:data:`RTOL_BY_DTYPE`): bf16 rounding alone is up to 2**-8 relative (8 significant bits). An fp8 run is dequantised in
float32 (``q * scale``) and compared with ``rtol = 0.075``: with the worker's value ``x`` within
bf16's ``1e-2 * (|ref| + rms)`` of the reference (a bf16 forward on GPU) and e4m3's bound
``|dq - x| <= 2**-4 |x| + 2**-10 scale`` (``hsx/fp8.py``), ``|dq - ref| <= (2**-4 + (1 + 2**-4) *
1e-2) * (|ref| + rms) = 0.0731 * (|ref| + rms)``, rounded up; the scale term (``amax / 458752``)
is covered by the ``rms(ref)`` term unless a token's largest value is ~30,000x the part's rms.

The report names each bad batch and why; :func:`verify_run` never raises for a problem in the
data, only for a run that cannot be read at all (no ``run.json``, store unreachable). Every read
goes through the store's interface with retries of transient errors (``VERIFY_RETRY_S``); a batch
whose objects still cannot be read is ``unverified``: not known to be bad, so never repaired.
"""

from __future__ import annotations

import json
import random
import struct
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from hsx.errors import BadConfig, BadPlan, StoreError
from hsx.fp8 import E4M3_REL_ERR
from hsx.layout import (PLAN_WINDOWS_PREFIX, SAMPLES_JSONL, SHARDS_PREFIX, batch_plan_key, marker_key,
                        names_under, window_key, window_samples_key)
from hsx.plan import (BatchPlan, batch_id, plan_complete, planning_failed, read_batch, read_batch_list,
                      read_planning_record, window_id)
from hsx.reader import quarantined_ids, read_markers, read_sample
from hsx.records import BatchSummary, Marker, PlanWindow, SampleRow, Stats, read_failures
from hsx.runconfig import RunConfig, load_run
from hsx.shard import ShardSpec, StoreDtype, cu_seqlens_problem, schema_problems
from hsx.store import MissingKey, Store, exists, retry_transient
from producer.words import fmt_bytes, plural

#: relative tolerance of ``--recompute`` by stored dtype (bf16 keeps 8 bits of mantissa).
#: fp8: e4m3's relative rounding bound 2**-4 on top of bf16's 1e-2, rounded up (the module docstring says why).
RTOL_BY_DTYPE = {StoreDtype.BFLOAT16: 1e-2, StoreDtype.FLOAT32: 1e-4, StoreDtype.FP8: 0.075}
assert RTOL_BY_DTYPE[StoreDtype.FP8] >= E4M3_REL_ERR + (1 + E4M3_REL_ERR) * RTOL_BY_DTYPE[StoreDtype.BFLOAT16]
#: numpy dtypes of the shard's index tensors' safetensors codes (hsx.shard.INDEX_TENSORS).
_NP_DTYPES = {"I32": np.int32, "U8": np.uint8, "I64": np.int64}
#: threads that check batches at once (S3: network-bound; local: hashing releases the GIL).
S3_THREADS = 16
LOCAL_THREADS = 8
#: largest safetensors header we accept (bytes); real shard headers are a few KB.
MAX_HEADER_BYTES = 100 << 20
#: seconds each store call of ``verify`` retries a transient error (``hsx/store/retry.py``) before the
#: batch is reported ``unverified`` (not bad: ``reconcile --repair`` leaves it alone).
VERIFY_RETRY_S = 60.0
#: problem kind of a batch whose marker, plan or shard could not be read for a store error
#: (network, throttling, credentials): nothing is known to be wrong; verify again.
UNVERIFIED = "unverified"


@dataclass
class Problem:
    """One thing wrong with the run. ``batch`` names the batch (or batches, comma-separated; ``-``
    for none); ``window`` the plan's window (``w000003``) a problem of the plan is in, else None."""

    batch: str
    kind: str
    detail: str
    window: str | None = None


@dataclass
class _BatchResult:
    batch: str
    problems: list[Problem] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    """Sample indices the batch's shard holds, in row order (or, if unreadable, the plan's)."""
    rows: list[tuple[int, int]] = field(default_factory=list)
    """(start, end) token rows of ``samples`` in the shard; empty when the shard is unreadable."""
    quarantined: set[int] = field(default_factory=set)
    shard_key: str | None = None
    bytes_hashed: int = 0
    certified: bool = False
    """The marker certifies this run's batch (readable, same batch, same config): counts for coverage."""


# --- reading a shard's header and small tensors, local or S3 --------------------------------


class _ObjectReader:
    """Byte ranges and the sha256 of one stored object, through the store's interface
    (``Store.read_range`` / ``Store.sha256``), each call retried on a transient error for up to
    ``retry_s`` seconds (``hsx/store/retry.py``). A :class:`~hsx.errors.StoreError` that outlasts the
    retries propagates: the caller reports the batch ``unverified``, never bad."""

    def __init__(self, run_store: Store, key: str, retry_s: float):
        self.store = run_store
        self.key = key
        self.retry_s = retry_s

    def read(self, offset: int, length: int) -> bytes:
        if length == 0:
            return b""
        return retry_transient(lambda: self.store.read_range(self.key, offset, length),
                               f"verify: read {self.key}", total_s=self.retry_s)

    def sha256(self) -> tuple[int, str]:
        """(bytes, sha256) of the whole object, streamed in ``CHUNK_BYTES`` pieces."""
        return retry_transient(lambda: self.store.sha256(self.key), f"verify: hash {self.key}", total_s=self.retry_s)


def _read_header(reader: _ObjectReader, size: int) -> tuple[dict, int]:
    """The safetensors header (JSON) and the offset where tensor data starts; ValueError if malformed."""
    if size < 8:
        raise ValueError(f"{size:,} bytes: too short for a safetensors file")
    (n,) = struct.unpack("<Q", reader.read(0, 8))
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise ValueError(f"header length {n} does not fit a {size}-byte file")
    header = json.loads(reader.read(8, n))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return header, 8 + n


def _small_tensor(reader: _ObjectReader, header: dict, data_start: int, name: str) -> np.ndarray:
    entry = header[name]
    begin, end = entry["data_offsets"]
    raw = reader.read(data_start + begin, end - begin)
    return np.frombuffer(raw, dtype=_NP_DTYPES[entry["dtype"]]).reshape(entry["shape"])


# --- one batch ------------------------------------------------------------------------------


def _first_diff(a: np.ndarray, b: np.ndarray) -> str:
    if a.shape != b.shape:
        return f"{a.shape[0]} tokens stored, {b.shape[0]} planned"
    bad = np.flatnonzero(a != b)
    return f"{bad.size} of {a.size} tokens differ, first at token {bad[0]}: stored {a[bad[0]]}, planned {b[bad[0]]}"


def _check_batch(run_store: Store, config: RunConfig, config_sha: str, batch: str, marker: Marker | Exception,
                 planned: set[str], retry_s: float = VERIFY_RETRY_S) -> _BatchResult:
    """Every per-batch check of the module docstring, for the marker file ``markers/<batch>.json``.

    A store error (after ``retry_s`` seconds of retries of a transient one) is reported as
    ``unverified`` with the error, and the batch's samples are taken from the plan: only what was
    read and found wrong is reported as bad."""
    res = _BatchResult(batch)

    def problem(kind: str, detail: str) -> None:
        res.problems.append(Problem(batch, kind, detail))

    def unverified(what: str, exc: StoreError) -> _BatchResult:
        problem(UNVERIFIED, f"{what} could not be read ({exc}); nothing is known to be wrong with it: verify again "
                            "once the store answers")
        return res

    def store_call(fn, what: str):
        return retry_transient(fn, f"verify {batch}: {what}", total_s=retry_s)

    if isinstance(marker, StoreError):  # read_markers' one attempt failed: read it again, with retries
        try:
            marker = store_call(lambda: Marker.read(run_store, batch), "read its marker")
        except StoreError as exc:
            return unverified(marker_key(batch), exc)
        except ValueError as exc:  # RecordFormatError
            marker = exc
        if marker is None:  # deleted since the listing
            marker = MissingKey(marker_key(batch))
    if isinstance(marker, Exception):
        problem("marker_unreadable", f"{marker_key(batch)} cannot be read: {marker}")
        return res
    res.quarantined = quarantined_ids(marker)
    named = marker.batch
    own_batch = named == batch
    if not own_batch:
        problem("marker_mismatch", f"{marker_key(batch)} certifies batch {named!r}, not {batch}")
    if marker.config_sha256 != config_sha:
        problem("config_mismatch", f"marker config_sha256 {marker.config_sha256[:16]}... differs from "
                                   f"run.json's identity {config_sha[:16]}...: written for another config")
    res.certified = own_batch and marker.config_sha256 == config_sha

    plan: BatchPlan | None = None
    if batch not in planned:
        problem("not_planned", f"{batch} is not a batch of the plan (plan/batches.json, or the windows written so far)")
    else:
        try:
            plan = store_call(lambda: read_batch(run_store, batch), "read its plan")
        except MissingKey:
            problem("plan_missing", f"{batch_plan_key(batch)} is missing")
        except StoreError as exc:
            res.certified = own_batch and marker.config_sha256 == config_sha
            return unverified(batch_plan_key(batch), exc)
        except BadPlan as exc:  # the bytes are not the planned ones: a problem of this batch, the others still checked
            problem("plan_unreadable", f"{batch_plan_key(batch)}: {exc}")
    plan_samples = [] if plan is None else plan.sample_index_N.tolist()

    shard = marker.shard  # a marker without one does not read (RecordFormatError: marker_unreadable)
    key = shard.key
    res.shard_key = key
    from_plan = [s for s in plan_samples if s not in res.quarantined]
    reader = _ObjectReader(run_store, key, retry_s)
    try:
        size = store_call(lambda: run_store.size(key), f"size of {key}")
        n, digest = (0, "") if size is None else reader.sha256()
    except MissingKey:
        size = None  # deleted between the HEAD and the GET
    except StoreError as exc:  # the store did not answer: nothing is known about the shard
        res.samples = from_plan
        return unverified(f"shard {key}", exc)
    if size is None:
        problem("shard_missing", f"shard {key} named by the marker is missing")
        res.samples = from_plan
        return res
    res.bytes_hashed = n
    altered = n != shard.bytes or digest != shard.sha256.lower()
    if altered:
        problem("shard_altered", f"shard {key}: sha256 {digest[:16]}... ({n:,} bytes), the marker says "
                                 f"{shard.sha256[:16]}... ({shard.bytes:,} bytes)")
    try:
        header, data_start = _read_header(reader, n)
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        schema = schema_problems(tensors, header.get("__metadata__") or {}, ShardSpec.of_run(config),
                                 batch=batch if own_batch else str(named), data_bytes=n - data_start)
        if schema:
            if not altered:
                problem("schema", f"shard {key}: " + "; ".join(schema))
            raise ValueError("schema")
        sample_index_N = _small_tensor(reader, header, data_start, "sample_index").astype(np.int64)
        cu_N1 = _small_tensor(reader, header, data_start, "cu_seqlens").astype(np.int64)
        input_ids_T = _small_tensor(reader, header, data_start, "input_ids")
        loss_mask_T = _small_tensor(reader, header, data_start, "loss_mask")
    except StoreError as exc:
        res.samples = from_plan
        if not altered:
            return unverified(f"shard {key}", exc)
        return res
    except Exception as exc:  # read whole and hashed: the bytes themselves are malformed
        if not altered and str(exc) != "schema":
            problem("shard_unreadable", f"shard {key}: {type(exc).__name__}: {exc}")
        res.samples = from_plan
        return res

    T = int(input_ids_T.shape[0])
    bad_cu = cu_seqlens_problem(cu_N1, T)
    if bad_cu:
        problem("schema", f"shard {key}: {bad_cu}")
        res.samples = [s for s in plan_samples if s not in res.quarantined]
        return res
    res.samples = sample_index_N.tolist()
    res.rows = list(zip(cu_N1[:-1].tolist(), cu_N1[1:].tolist()))
    if altered:
        return res  # the bytes are wrong; the rest would only restate it

    counts = {"num_samples": len(res.samples), "num_tokens": T, "supervised_tokens": int(loss_mask_T.sum())}
    wrong = [f"{k} {getattr(marker, k)} (shard: {v})" for k, v in counts.items() if getattr(marker, k) != v]
    if plan is not None:  # optional fields: checked when the marker has them
        for k, v in (("planned_samples", plan.num_samples), ("planned_tokens", plan.num_tokens)):
            if getattr(marker, k) is not None and getattr(marker, k) != v:
                wrong.append(f"{k} {getattr(marker, k)} (plan: {v})")
        if marker.num_quarantined is not None and marker.num_quarantined != len(res.quarantined):
            wrong.append(f"num_quarantined {marker.num_quarantined} (quarantined list: {len(res.quarantined)})")
    if wrong:
        problem("counts", "marker counts differ: " + ", ".join(wrong))

    if plan is None:
        return res
    plan_rows = {s: (int(plan.cu_seqlens_N1[j]), int(plan.cu_seqlens_N1[j + 1])) for j, s in enumerate(plan_samples)}
    unplanned = [s for s in res.samples if s not in plan_rows]
    if unplanned:
        problem("unplanned_sample", f"shard holds samples {unplanned[:10]} that the plan puts in other batches or nowhere")
    stored = set(res.samples)
    absent = [s for s in plan_samples if s not in stored and s not in res.quarantined]
    if absent:
        problem("missing_samples", f"planned samples {absent[:10]}{'...' if len(absent) > 10 else ''} ({len(absent)}) "
                                   "are neither in the shard nor quarantined")
    both = sorted(stored & res.quarantined)
    if both:
        problem("counts", f"samples {both[:10]} are both stored and listed as quarantined")
    if res.samples == plan_samples and np.array_equal(input_ids_T, plan.input_ids_T.astype(np.int32)) \
            and np.array_equal(loss_mask_T, plan.loss_mask_T.astype(np.uint8)):
        return res  # fast path: the whole batch echoes the plan
    for s, (lo, hi) in zip(res.samples, res.rows):
        if s not in plan_rows:
            continue
        plo, phi = plan_rows[s]
        ids, pids = input_ids_T[lo:hi], plan.input_ids_T[plo:phi].astype(np.int32)
        if not np.array_equal(ids, pids):
            problem("token_echo", f"sample {s}: stored input_ids differ from the plan: {_first_diff(ids, pids)}")
            continue
        mask, pmask = loss_mask_T[lo:hi], plan.loss_mask_T[plo:phi].astype(np.uint8)
        if not np.array_equal(mask, pmask):
            problem("loss_mask_echo", f"sample {s}: stored loss_mask differs from the plan: {_first_diff(mask, pmask)}")
    return res


# --- the plan -------------------------------------------------------------------------------


@dataclass
class PlanCheck:
    """What :func:`check_plan` found: the batches to check the markers against, and the plan's problems."""

    batches: list[BatchSummary]
    """The batch list once the plan is complete, else the batches of the windows written so far."""
    complete: bool
    windows: int | None
    """Windows of the streamed plan read (None: a run planned before windows)."""
    problems: list[Problem] = field(default_factory=list)
    missing_files: set[str] = field(default_factory=set)
    """Batches whose plan file is missing (already reported: the per-marker check does not repeat it)."""


def _summary_fields(b: BatchSummary) -> tuple:
    return b.batch, b.num_samples, b.num_tokens, b.max_len, b.supervised_tokens


def check_plan(run_store: Store, *, threads: int = LOCAL_THREADS, retry_s: float = VERIFY_RETRY_S) -> PlanCheck:
    """Check the plan's windows, sample rows and batch files against each other (the module
    docstring lists the checks); a run planned before windows only has its batch list read.

    Raises:
        hsx.errors.StoreError: the plan's listing or its batch list cannot be read.
        hsx.errors.RecordFormatError: ``plan/batches.json`` is not a batch list.
    """
    def call(fn, what: str):
        return retry_transient(fn, f"verify: {what}", total_s=retry_s)

    complete = call(lambda: plan_complete(run_store), "look for plan/batches.json")
    listed = sorted(names_under(call(lambda: run_store.list(PLAN_WINDOWS_PREFIX), "list the windows"),
                                PLAN_WINDOWS_PREFIX))
    batch_list = call(lambda: read_batch_list(run_store), "read plan/batches.json") if complete else None
    if not listed:
        if complete:
            check = PlanCheck(batch_list, True, None)
            stats = _read_stats(run_store, call, check)
            if stats is not None and stats.windows and not call(lambda: exists(run_store, SAMPLES_JSONL), "look for samples"):
                check.problems.append(Problem("-", "plan_mismatch", f"plan/stats.json counts {plural(stats.windows, 'window')} "
                                                                   f"but no window record is in {PLAN_WINDOWS_PREFIX}"))
            return check  # a run planned before windows (plan/samples.jsonl): its batch list, as before
        check = PlanCheck([], False, 0)
        check.problems.append(Problem("-", "plan_incomplete", "plan/batches.json is missing: the plan is not complete; "
                                      f"no window is written yet. {_planning_said(run_store)}"))
        return check

    problems: list[Problem] = []
    windows: list[PlanWindow] = []
    for name in listed:
        try:
            w = call(lambda: PlanWindow.read(run_store, name), f"read {window_key(name)}")
        except ValueError as exc:  # RecordFormatError
            problems.append(Problem("-", "plan_unreadable", str(exc), window=name))
            continue
        except StoreError as exc:
            problems.append(Problem("-", UNVERIFIED, f"{window_key(name)} could not be read ({exc})", window=name))
            continue
        if w is None:  # deleted since the listing
            continue
        if w.name != name:
            problems.append(Problem("-", "plan_mismatch", f"{window_key(name)} holds window {w.window} ({w.name})",
                                    window=name))
            continue
        windows.append(w)
    windows.sort(key=lambda w: w.window)
    # In order from 0 up to the first gap: what readers (hsx.records.read_windows) count as planned.
    chain: list[PlanWindow] = []
    for w in windows:
        if w.window != len(chain):
            break
        chain.append(w)
    after_gap = windows[len(chain):]
    if after_gap:
        gap = window_id(len(chain))
        problems.append(Problem("-", "plan_mismatch", f"window {gap} is missing: the windows after it "
                                f"({', '.join(w.name for w in after_gap[:5])}{' ...' if len(after_gap) > 5 else ''}) "
                                "follow a gap, so readers count none of their batches", window=gap))

    expected_sample = expected_batch = 0
    for w in chain:
        where = f"window {w.name}"
        if w.first_sample != expected_sample:
            problems.append(Problem("-", "plan_mismatch", f"{where} starts at sample {w.first_sample}, the windows before "
                                                          f"end at sample {expected_sample}", window=w.name))
        if w.first_batch != expected_batch:
            problems.append(Problem("-", "plan_mismatch", f"{where} starts at batch {batch_id(w.first_batch)}, the windows "
                                                          f"before end at {batch_id(expected_batch)}", window=w.name))
        names = [b.batch for b in w.batches]
        want = [batch_id(w.first_batch + i) for i in range(len(w.batches))]
        if names != want:
            wrong = [n for n, x in zip(names, want) if n != x][:5]
            problems.append(Problem(", ".join(wrong) or "-", "plan_mismatch",
                                    f"{where}'s batches are not {want[0] if want else '-'}.. in order: {names[:10]}",
                                    window=w.name))
        if w.last and w is not chain[-1]:
            problems.append(Problem("-", "plan_mismatch", f"{where} is marked last but windows follow it", window=w.name))
        expected_sample = w.first_sample + w.num_samples
        expected_batch = w.first_batch + len(w.batches)

    check = PlanCheck([b for w in chain for b in w.batches], complete, len(chain), problems)
    with ThreadPoolExecutor(threads) as pool:
        for window_problems, missing in pool.map(lambda w: _check_window(run_store, w, call), chain):
            problems.extend(window_problems)
            check.missing_files |= missing

    if complete:
        if chain and not chain[-1].last:
            problems.append(Problem("-", "plan_mismatch", f"the plan is complete but its last window {chain[-1].name} "
                                                          "is not marked last", window=chain[-1].name))
        listed_batches = {b.batch: b for b in batch_list}
        in_windows = {b.batch: b for b in check.batches}
        absent = [b for b in listed_batches if b not in in_windows]
        if absent:
            problems.append(Problem(", ".join(absent[:20]), "plan_mismatch",
                                    f"{plural(len(absent), 'batch')} of plan/batches.json ({', '.join(absent[:5])}"
                                    f"{' ...' if len(absent) > 5 else ''}) are in no window"))
        unlisted = [b for b in in_windows if b not in listed_batches]
        if unlisted:
            problems.append(Problem(", ".join(unlisted[:20]), "plan_mismatch",
                                    f"{plural(len(unlisted), 'batch')} of the windows ({', '.join(unlisted[:5])}"
                                    f"{' ...' if len(unlisted) > 5 else ''}) are not in plan/batches.json"))
        differ = [b for b in listed_batches if b in in_windows
                  and _summary_fields(listed_batches[b]) != _summary_fields(in_windows[b])]
        if differ:
            problems.append(Problem(", ".join(differ[:20]), "plan_mismatch",
                                    f"plan/batches.json and the windows differ on {', '.join(differ[:5])}: "
                                    f"{_summary_fields(listed_batches[differ[0]])} vs {_summary_fields(in_windows[differ[0]])}"))
        if not absent and not unlisted and [b.batch for b in batch_list] != list(in_windows):
            problems.append(Problem("-", "plan_mismatch", "plan/batches.json lists the windows' batches in another order"))
        stats = _read_stats(run_store, call, check)
        if stats is not None:
            counted = {"samples": sum(w.num_samples for w in chain), "batches": len(check.batches),
                       "windows": len(chain), "tokens": sum(w.tokens for w in chain)}
            wrong = [f"{k} {getattr(stats, k)} (the windows: {v})" for k, v in counted.items()
                     if getattr(stats, k) is not None and getattr(stats, k) != v]
            if wrong:
                problems.append(Problem("-", "plan_mismatch", "plan/stats.json differs from the windows: " + ", ".join(wrong)))
        check.batches = batch_list  # the markers are checked against the list readers use
    else:
        samples = sum(w.num_samples for w in chain)
        problems.append(Problem("-", "plan_incomplete",
                                f"plan/batches.json is missing: the plan is not complete; {plural(len(chain), 'window')} "
                                f"written so far ({plural(samples, 'sample')} in {plural(len(check.batches), 'batch')}). "
                                f"{_planning_said(run_store)}"))
    return check


def _read_stats(run_store: Store, call, check: PlanCheck) -> Stats | None:
    try:
        return call(lambda: Stats.read(run_store), "read plan/stats.json")
    except ValueError as exc:  # RecordFormatError
        check.problems.append(Problem("-", "plan_unreadable", str(exc)))
    except StoreError as exc:
        check.problems.append(Problem("-", UNVERIFIED, f"plan/stats.json could not be read ({exc})"))
    return None


def _planning_said(run_store: Store) -> str:
    """What ``plan/planning.json`` says of a plan not complete: still planned, or why it stopped."""
    record = read_planning_record(run_store)
    if record is None:
        return "No planner record (plan/planning.json): run the same `producer run` / `enqueue` command to finish it."
    why = planning_failed(record)
    if why:
        return (f"Its planning stopped: {why}; run {record.command or 'the same `producer run` / `enqueue` command'} "
                "again: it resumes after the windows written.")
    return f"The planner (pid {record.pid} on {record.host}) is still writing it: verify again once it is done."


def _check_window(run_store: Store, w: PlanWindow, call) -> tuple[list[Problem], set[str]]:
    """The window's sample rows against its range and batches, and its batch files against its rows."""
    problems: list[Problem] = []
    missing: set[str] = set()

    def problem(batch: str, kind: str, detail: str) -> None:
        problems.append(Problem(batch, kind, detail, window=w.name))

    key = window_samples_key(w.name)
    try:
        rows = call(lambda: SampleRow.read_window(run_store, w.name), f"read {key}")
    except MissingKey:
        problem("-", "plan_mismatch", f"{key} is missing: window {w.name}'s {plural(w.num_samples, 'sample')} have no rows")
        rows = None
    except ValueError as exc:  # RecordFormatError
        problem("-", "plan_unreadable", str(exc))
        rows = None
    except StoreError as exc:
        problem("-", UNVERIFIED, f"{key} could not be read ({exc})")
        rows = None
    summaries = {b.batch: b for b in w.batches}
    by_batch: dict[str, list[SampleRow]] = defaultdict(list)
    if rows is not None:
        got = [r.sample_index for r in rows]
        want = list(range(w.first_sample, w.first_sample + w.num_samples))
        if got != want:
            extra = sorted(set(got) - set(want))
            lost = sorted(set(want) - set(got))
            twice = sorted({s for s in got if got.count(s) > 1}) if len(got) != len(set(got)) else []
            parts = [f"{len(got)} rows for the {plural(w.num_samples, 'sample')} {w.first_sample}..{w.first_sample + w.num_samples - 1}"]
            if lost:
                parts.append(f"samples {lost[:10]} have no row")
            if extra:
                parts.append(f"rows {extra[:10]} are outside the window")
            if twice:
                parts.append(f"samples {twice[:10]} have two rows")
            if not (lost or extra or twice):
                parts.append("not in sample_index order")
            problem("-", "plan_mismatch", f"{key}: " + "; ".join(parts))
        for r in rows:
            if r.batch not in summaries:
                problem(r.batch, "plan_mismatch", f"{key}: sample {r.sample_index} names batch {r.batch}, not one of "
                                                  f"window {w.name}'s ({w.batches[0].batch if w.batches else '-'}.."
                                                  f"{w.batches[-1].batch if w.batches else '-'})")
            by_batch[r.batch].append(r)

    for b in w.batches:
        try:
            plan = call(lambda: read_batch(run_store, b.batch), f"read {batch_plan_key(b.batch)}")
        except MissingKey:
            problem(b.batch, "plan_missing", f"{batch_plan_key(b.batch)} is missing (window {w.name})")
            missing.add(b.batch)
            continue
        except StoreError as exc:
            problem(b.batch, UNVERIFIED, f"{batch_plan_key(b.batch)} could not be read ({exc})")
            continue
        except Exception as exc:  # the bytes are not a batch file
            problem(b.batch, "plan_unreadable", f"{batch_plan_key(b.batch)}: {type(exc).__name__}: {exc}")
            continue
        counts = {"num_samples": plan.num_samples, "num_tokens": plan.num_tokens}
        wrong = [f"{k} {getattr(b, k)} (file: {v})" for k, v in counts.items() if getattr(b, k) != v]
        if wrong:
            problem(b.batch, "plan_mismatch", f"window {w.name}'s summary of {b.batch} differs from its file: " + ", ".join(wrong))
        if rows is None:
            continue
        in_file = plan.sample_index_N.tolist()
        named = by_batch.get(b.batch, [])
        if sorted(in_file) != sorted(r.sample_index for r in named) or len(set(in_file)) != len(in_file):
            not_named = sorted(set(in_file) - {r.sample_index for r in named})
            not_in = sorted({r.sample_index for r in named} - set(in_file))
            problem(b.batch, "plan_mismatch",
                    f"{batch_plan_key(b.batch)} holds {plural(len(in_file), 'sample')}, {plural(len(named), 'row')} of {key} "
                    f"name {b.batch}: " + "; ".join(x for x in (
                        f"samples {not_named[:10]} are in the file but their rows name another batch" if not_named else "",
                        f"samples {not_in[:10]} are named but not in the file" if not_in else "",
                        "a sample is in the file twice" if len(set(in_file)) != len(in_file) else "") if x))
            continue
        cu = plan.cu_seqlens_N1.astype(np.int64)
        bad_cu = cu_seqlens_problem(cu, plan.num_tokens)
        if bad_cu or plan.loss_mask_T.shape[0] != plan.num_tokens:
            problem(b.batch, "plan_mismatch", f"{batch_plan_key(b.batch)}: "
                    + (bad_cu or f"{plan.loss_mask_T.shape[0]} loss_mask values for {plan.num_tokens} tokens"))
            continue
        lengths = np.diff(cu).tolist()
        mask_csum = np.concatenate([[0], np.cumsum(plan.loss_mask_T.astype(np.int64))])
        supervised = (mask_csum[cu[1:]] - mask_csum[cu[:-1]]).tolist()
        row_of = {r.sample_index: r for r in named}
        off = [f"sample {s}: {n} tokens ({sup} supervised) in the file, its row says {row_of[s].num_tokens} "
               f"({row_of[s].supervised_tokens})"
               for s, n, sup in zip(in_file, lengths, supervised)
               if row_of[s].num_tokens != n or row_of[s].supervised_tokens != sup]
        if off:
            problem(b.batch, "plan_mismatch", f"{batch_plan_key(b.batch)} and {key} differ: " + "; ".join(off[:5]))
    return problems, missing


# --- recompute ------------------------------------------------------------------------------


def _compare(got, want, rtol: float) -> tuple[bool, float, float]:
    """(ok, worst ratio of |diff| to its bound, max |diff|) for ``|got-want| <= rtol*(|want| + rms(want))``."""
    got = got.float()
    diff = (got - want).abs()
    bound = rtol * (want.abs() + want.pow(2).mean().sqrt().clamp_min(1e-12))
    ratio = float((diff / bound).max()) if diff.numel() else 0.0
    return ratio <= 1.0, ratio, float(diff.max()) if diff.numel() else 0.0


def available_bytes(device) -> int:
    """Bytes a model loaded on ``device`` may take: the free memory of a CUDA device
    (``torch.cuda.mem_get_info``), else the host's ``MemAvailable`` (``/proc/meminfo``; 0 where it
    cannot be read, which refuses nothing: see :func:`fp32_fits`)."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def fp32_fits(path: str, device, *, trust_remote_code: bool) -> None:
    """Refuse a recompute whose fp32 model cannot fit ``device``, before it loads: the parameters
    counted on the meta device from the checkpoint's config, 4 bytes each, against
    :func:`available_bytes` less a tenth for the activations (a 27B target is 108 GB in fp32:
    more than an H100 or H200 holds).

    Raises:
        BadConfig: naming the model's fp32 size, the memory there is, and what to do.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    free = available_bytes(device)
    if not free:
        return
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    need = 4 * sum(p.numel() for p in meta.parameters())
    if need > 0.9 * free:
        where = f"GPU {device}" if device.type == "cuda" else "this host"
        raise BadConfig(f"verify --recompute runs the target in fp32 (the reference the stored states are compared "
                        f"with): {fmt_bytes(need)} for {path}, and {where} has {fmt_bytes(free)} free; run it where "
                        "that fits (HSX_DEVICE=cpu uses host memory; a GPU with more free memory), or leave out "
                        "--recompute (the hashes, the token echo and the sample count are checked without it)")


def recompute_samples(run_store: Store, config: RunConfig, picks: list[tuple[str, Marker, int, int, int]], settings, *,
                      rtol: float | None = None, progress=None) -> tuple[dict, list[Problem]]:
    """Recompute ``picks`` (batch, marker, sample, start, end) per sample on the reference path.

    Returns (summary, problems). Loads the run's model in fp32 on the GPU, else the CPU (a problem
    when the checkpoint's identity differs from run.json's ``model``).

    Raises:
        BadConfig: the fp32 model does not fit the device's free memory (:func:`fp32_fits`).
    """
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from hsx.models import model_info, resolve_model_path, safetensors_only
    from hsx.reader import local_shard
    from hsx.reference import reference_states

    rtol = rtol if rtol is not None else RTOL_BY_DTYPE[StoreDtype(config.store_dtype)]
    summary: dict = {"samples": [], "rtol": rtol, "values_compared": 0, "worst_ratio": 0.0}
    problems: list[Problem] = []
    info = model_info(config.model_name, settings.cache_dir, trust_remote_code=settings.trust_remote_code)
    differences = info.differences(config.model)
    if differences:
        problems.append(Problem("-", "recompute_error", f"model {config.model_name!r} is no longer the checkpoint the run was "
                                                        f"extracted from ({'; '.join(differences)}): cannot recompute"))
        return summary, problems
    t0 = time.perf_counter()
    path = resolve_model_path(config.model_name, settings.cache_dir)
    # fp32 on the GPU when there is one: with fla installed, the CPU path of a GDN model would call
    # its Triton kernels on host tensors and fail.
    device = torch.device(settings.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    fp32_fits(path, device, trust_remote_code=settings.trust_remote_code)
    import transformers

    transformers.utils.logging.disable_progress_bar()  # verify draws its own progress
    # straight to the device, a tensor at a time: no whole copy in host memory first
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, device_map={"": device},
                                                 use_safetensors=safetensors_only(path, settings.allow_pickle_checkpoints),
                                                 trust_remote_code=settings.trust_remote_code)
    model.eval().requires_grad_(False)
    summary["device"] = str(device)
    summary["load_s"] = round(time.perf_counter() - t0, 2)
    layer_ids = list(config.layers.layer_ids)
    final = config.layers.final
    task = progress.add_task("recompute", total=len(picks)) if progress is not None else None
    by_batch: dict[str, list] = defaultdict(list)
    for batch, marker, sample, start, end in picks:
        by_batch[batch].append((marker, sample, start, end))
    for batch, items in sorted(by_batch.items()):
        marker = items[0][0]
        with local_shard(run_store, marker.shard.key) as path, safe_open(str(path), framework="pt") as f:
            for _, sample, start, end in items:
                stored = read_sample(f, start, end, final.tensors, dequant_dtype=torch.float32)  # fp8: q * scale in fp32
                S = stored["input_ids"].shape[0]
                hidden_SKH = stored["hidden_states"].view(S, len(layer_ids), -1)
                ref = reference_states(model, stored["input_ids"], layer_ids, final)  # hsx/reference.py
                pairs = [(f"layer {i}", hidden_SKH[:, k], ref["hidden_states"][:, k]) for k, i in enumerate(layer_ids)]
                pairs += [(name, stored[name], ref[name]) for name in final.tensors]
                worst = (0.0, "", 0.0)
                bad = []
                for name, got, want in pairs:
                    ok, ratio, max_diff = _compare(got, want, rtol)
                    summary["values_compared"] += want.numel()
                    if ratio > worst[0]:
                        worst = (ratio, name, max_diff)
                    if not ok:
                        bad.append(f"{name}: max |diff| {max_diff:.3g}, {ratio:.2f}x the tolerance")
                summary["samples"].append({"sample_index": sample, "batch": batch, "tokens": S, "worst_ratio": round(worst[0], 4),
                                           "worst_tensor": worst[1], "max_abs_diff": worst[2]})
                summary["worst_ratio"] = max(summary["worst_ratio"], worst[0])
                if bad:
                    problems.append(Problem(batch, "recompute_mismatch",
                                            f"sample {sample} differs from a per-sample fp32 forward (rtol {rtol}): " + "; ".join(bad)))
                if task is not None:
                    progress.update(task, advance=1)
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    return summary, problems


# --- the run --------------------------------------------------------------------------------


def verify_run(run_store: Store, *, recompute: int = 0, seed: int | None = None, rtol: float | None = None,
               settings=None, progress=None, threads: int | None = None, retry_s: float | None = None) -> dict:
    """Check the run at ``run_store`` (see the module docstring) and return the report.

    Report keys: ``ok`` (no problem), ``problems`` (list of ``{batch, kind, detail, window}``: ``window``
    names the plan's window of a plan problem, else null), ``plan_complete`` (``plan/batches.json``
    exists; if not, a ``plan_incomplete`` problem and the batches planned so far are those of the
    windows), ``windows`` (windows of the streamed plan; null for a run planned before windows), ``orphans``
    (shard keys no marker names), counts (``batches_planned``, ``batches_done``,
    ``samples_planned``, ``samples_stored``, ``samples_quarantined``, ``bytes_hashed``), ``plan_seconds``
    (checking the plan), ``hash_seconds`` (reading and hashing the shards; ``seconds`` is the whole verify, the recompute's own time is
    in ``recompute``) and
    ``recompute`` (when asked), ``unverified`` (batches whose marker, plan or shard could not be
    read for a store error after ``retry_s`` seconds of retries: problem kind ``unverified``, which
    ``reconcile --repair`` never acts on).

    Raises:
        hsx.store.MissingKey: no run.json at ``run_store``.
        hsx.errors.StoreError: run.json, the plan's batch list or listing, or the markers' listing cannot be read.
        hsx.errors.RecordFormatError: ``plan/batches.json`` is not a batch list.
    """
    t0 = time.perf_counter()
    retry_s = VERIFY_RETRY_S if retry_s is None else retry_s
    config = load_run(run_store)
    config_sha = config.identity_sha256()
    if threads is None:
        threads = S3_THREADS if run_store.location.is_s3 else LOCAL_THREADS
    plan_check = check_plan(run_store, threads=threads, retry_s=retry_s)
    plan_seconds = round(time.perf_counter() - t0, 2)
    t_hash = time.perf_counter()
    problems: list[Problem] = list(plan_check.problems)
    plan_list = plan_check.batches
    planned = {b.batch: b for b in plan_list}
    markers = read_markers(run_store)
    names = sorted(markers)
    task = progress.add_task("verifying", total=len(names)) if progress is not None else None
    results: list[_BatchResult] = []
    hashed = 0
    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(_check_batch, run_store, config, config_sha, b, markers[b], set(planned), retry_s)
                   for b in names]
        for fut in futures:
            res = fut.result()
            results.append(res)
            hashed += res.bytes_hashed
            if task is not None:
                elapsed = max(time.perf_counter() - t_hash, 1e-9)
                progress.update(task, advance=1, info=f"{fmt_bytes(hashed)} hashed  {fmt_bytes(hashed / elapsed)}/s")

    hash_seconds = round(time.perf_counter() - t_hash, 2)  # the recompute's model load and forwards come after
    for res in results:  # a missing plan file was named by check_plan already
        problems.extend(p for p in res.problems if not (p.kind == "plan_missing" and p.batch in plan_check.missing_files))
    done = {r.batch for r in results if r.certified}
    failures = read_failures(run_store, set(markers))  # a worker gave up on these: say why, not "not yet"
    for batch in sorted(set(planned) - done):
        if batch in markers:
            continue  # its marker exists but is bad: already reported
        failure = failures.get(batch)
        if failure is not None:
            problems.append(Problem(batch, "failed", f"no marker: the batch failed ({failure.error[:500]}; "
                                                     f"{failure.host or 'a worker'}, {failure.at or 'time unknown'}); "
                                                     f"fix the cause, then `python -m producer reconcile {run_store.url}`"))
            continue
        problems.append(Problem(batch, "not_done", f"no marker: the batch ({planned[batch].num_samples} samples) "
                                                   "is not extracted yet; run the same `producer run` / `enqueue` again"))

    # Every planned sample exactly once, across shards; quarantined ones are accounted for.
    owners: dict[int, list[str]] = defaultdict(list)
    quarantined: set[int] = set()
    for res in results:
        if isinstance(markers.get(res.batch), Exception):
            continue
        for s in res.samples:
            owners[s].append(res.batch)
        quarantined |= res.quarantined
    dup_groups: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for s, batches in owners.items():
        if len(batches) > 1:
            dup_groups[tuple(sorted(batches))].append(s)
    for batches, samples in sorted(dup_groups.items()):
        samples.sort()
        problems.append(Problem(", ".join(batches), "duplicate",
                                f"samples {samples[:10]}{'...' if len(samples) > 10 else ''} ({len(samples)}) are stored "
                                f"in {len(batches)} batches: {', '.join(batches)}"))
    samples_planned = sum(b.num_samples for b in plan_list)
    stored = set(owners)

    orphans = []
    named_keys = {r.shard_key for r in results if r.shard_key}
    for key in run_store.list(SHARDS_PREFIX):
        if key not in named_keys:
            orphans.append(key)

    report = {
        "run_id": config.run_id,
        "address": run_store.url,
        "plan_complete": plan_check.complete,
        "windows": plan_check.windows,
        "batches_planned": len(planned),
        "batches_done": len(done & set(planned)),
        "markers": len(markers),
        "samples_planned": samples_planned,
        "samples_stored": len(stored),
        "samples_quarantined": len(quarantined - stored),
        "bytes_hashed": hashed,
        "hash_seconds": hash_seconds,
        "plan_seconds": plan_seconds,
        "orphans": orphans,
        "recompute": None,
    }

    if recompute > 0:
        bad_batches = {p.batch for p in problems}
        pool_ = [(r.batch, markers[r.batch], s, lo, hi) for r in results
                 if r.certified and r.batch not in bad_batches and r.rows
                 for s, (lo, hi) in zip(r.samples, r.rows) if s not in r.quarantined]
        if seed is None:
            seed = random.SystemRandom().randrange(2**31)
        picks = random.Random(seed).sample(pool_, min(recompute, len(pool_)))
        if settings is None:
            from settings import get_settings

            settings = get_settings()
        summary, rproblems = recompute_samples(run_store, config, picks, settings, rtol=rtol, progress=progress)
        summary["seed"] = seed
        summary["asked"] = recompute
        report["recompute"] = summary
        problems.extend(rproblems)

    # a damaged plan file is met twice (the plan's own check, and the batch's against its shard): said once
    once = {(p.batch, p.kind) for p in problems if p.kind == "plan_unreadable" and p.batch != "-" and p.window}
    problems = [p for p in problems if p.window or p.kind != "plan_unreadable" or (p.batch, p.kind) not in once]
    report["unverified"] = sorted({p.batch for p in problems if p.kind == UNVERIFIED and p.batch != "-"})
    report["problems"] = [asdict(p) for p in problems]
    report["ok"] = not problems
    report["seconds"] = round(time.perf_counter() - t0, 2)
    return report


def problem_batches(report: dict) -> list[str]:
    """The batches a report names as bad (comma-separated groups split), sorted."""
    out = set()
    for p in report["problems"]:
        out.update(b.strip() for b in p["batch"].split(","))
    out.discard("-")
    return sorted(out)


__all__ = ["verify_run", "check_plan", "PlanCheck", "recompute_samples", "problem_batches", "Problem", "RTOL_BY_DTYPE", "UNVERIFIED", "VERIFY_RETRY_S"]
