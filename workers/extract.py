"""One batch, end to end on a worker: :func:`extract_batch` runs five steps in order, each a function.

- **claim** (:func:`claim`): a batch whose marker exists is done: a duplicate or retried task returns
  at once. Otherwise the message is checked (roots, batch name, run, plan, model) before anything is
  written for it.
- **prepare** (:func:`prepare`): the target loaded (once per process) and checked against the run's
  model; the rows laid out on the host.
- **forward** (:func:`forward`): a host buffer from the process's pool (:class:`workers.spool.HostBufferPool`: the
  backpressure), then, under the GPU lock, the forward and its device-to-host copies queued
  (``workers/capture.py``); the lock is released before waiting for the copies, so the next batch's
  forward is queued right behind this one. A forward out of GPU memory halves the process's forward
  limit and runs the batch again in smaller forwards (:func:`_launch`).
- **write** (:func:`write`): samples with NaN or Inf states are quarantined (left out, listed in the marker with
  the reason; a batch with none left fails loudly with :class:`FidelityError`: no shard, no
  marker). The shard is serialised from the host buffer straight into the store
  (``Store.write_stream``): its bytes are written once, hashed beside the write, and certified by
  that hash (S3: by the server's per-part checksums), with no read-back. If the store does not
  take it for a transient reason, the shard goes to the overflow spool and is stored from there
  with retries (``workers/spool.py``), freeing its host buffer for the next forward.
- **certify** (:func:`certify`): the marker (:class:`hsx.records.Marker`), last, with a conditional create
  (:meth:`hsx.records.Marker.create`). Shard keys carry a random attempt id, so racing duplicates never overwrite
  each other's shard; the loser deletes its own.

Fault injection (``workers/faults.py``, the tests' ``HSX_FAULTS``) stays outside the steps: pauses
between them, and the run's store wrapped (a faulty store); in production its hooks do nothing.

Store calls that fail for a transient reason are retried with backoff (``hsx/store/retry.py``); the
Celery message is acknowledged only after the task returns (``acks_late``), so a batch is
acknowledged only once its marker exists. A worker that dies before that leaves the message
unacknowledged: it is delivered again (visibility timeout) or enqueued again by ``producer
reconcile``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone

import torch

from hsx.errors import FidelityError, NonFiniteBatch, RunCancelled, RunGone, StoreError
from hsx.fp8 import SCALE_BYTES
from hsx.layers import LayerSelection
from hsx.layout import shard_key
from hsx.plan import BatchPlan, read_batch
from hsx.records import Cancelled, Failure, Marker, MarkerWorker, ShardRef
from hsx.runconfig import load_run
from hsx.shard import Final, StoreDtype, select_samples, serialize_shard, shard_metadata
from hsx.access import ModelNotServed, Refused, check_run_allowed, normalise
from hsx.store import MissingKey, open_store, write_file
from settings import Settings
from workers.capture import merge_captured, right_padded_rows, split_by_tokens
from workers import faults
from workers.generate import release_kept_manager
from workers.heartbeat import process_heartbeat
from workers.room import _check_cancelled_now, _retry, _room_before_forward, store_room, until_room
from workers.spool import (is_disk_full, process_host_buffers, process_spool, spool_file_name, spool_full_error,
                           write_shard)
from workers.target import get_target

log = logging.getLogger(__name__)

#: a task's batch argument: one key segment (hsx/plan.py names batches b000000, b000001, ...).
_BATCH_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}")
_stores: dict[str, object] = {}


def _run_store(run_url: str, settings: Settings):
    # The allow-list first, before any store call: a task may name any path or bucket, and opening
    # it would already create a local directory (record_failure goes through here too).
    check_run_allowed(run_url, settings)
    if run_url not in _stores:
        _stores[run_url] = open_store(run_url, settings, create=False)
    return _stores[run_url]


_configs: dict[str, object] = {}


def _run_config(run_url: str, run_store):
    # run.json never changes once written (a different config is a different run): read it once.
    if run_url not in _configs:
        _configs[run_url] = load_run(run_store)
    return _configs[run_url]




def shard_bytes_estimate(num_tokens: int, num_samples: int, states_per_token: int, hidden_size: int, itemsize: int,
                         scale_bytes: int = 0) -> int:
    """Upper bound of a shard's size in bytes, known before the forward: the states
    (``num_tokens x states_per_token x (hidden_size x itemsize + scale_bytes)``; fp8 stores a
    4-byte scale per token and part), the index tensors, and 64 KiB of header."""
    return (num_tokens * (states_per_token * (hidden_size * itemsize + scale_bytes) + 4 + 1) + (2 * num_samples + 1) * 8
            + (64 << 10))


@dataclass
class Claimed:
    """A task's message, checked (:func:`claim`): its run's store and config, and the batch's plan."""

    run_url: str
    batch: str
    store: object
    config: object
    plan: BatchPlan


class _Job:
    """What one task holds and its wrapper releases: the host buffer, the spool ticket, the heartbeat entry."""

    def __init__(self, claimed: Claimed, settings: Settings, task_id: str | None = None):
        self.run_url, self.batch, self.settings, self.task_id = claimed.run_url, claimed.batch, settings, task_id
        self.store = claimed.store  # the store itself, never the fault hooks' (the heartbeat writes through it)
        self.started = time.perf_counter()
        self.heartbeat = process_heartbeat(settings.heartbeat_s)
        self.ticket = None
        self.pool = None
        self.buffer = None
        self.heartbeat.served(self.run_url)
        self.phase("claimed")

    def phase(self, phase: str) -> None:
        self.heartbeat.phase(self.run_url, self.store, self.batch, phase, task_id=self.task_id)

    def release_buffer(self) -> None:
        if self.buffer is not None:
            self.pool.release(self.buffer)
            self.buffer = None

    def end(self, result: dict | None) -> None:
        """Release what the task holds; ``result``: the certify step's, None when a step raised."""
        self.release_buffer()
        if self.ticket is not None:
            self.ticket.release()
        done = bool(result) and result.get("status") == "done"
        self.heartbeat.finished(self.run_url, self.batch, certified=done,
                                tokens=int(result.get("num_tokens") or 0) if done else 0)


def extract_batch(run_url: str, batch: str, settings: Settings, task_id: str | None = None) -> dict:
    """Extract one planned batch of the run at ``run_url`` and certify it with its marker.

    Returns a JSON-able summary: ``status`` is ``done`` (we wrote the marker), ``already_done``
    (a marker existed, no work), or ``lost_race`` (another worker wrote the marker first).

    Raises:
        hsx.access.NotServed: the run lies outside this worker's store roots, or was planned for
            another checkpoint than this worker's (``HSX_MODEL``, or the checkpoint changed since
            planning); nothing written.
        hsx.access.Refused: the run address is not a store URL, the batch is not a batch name, or
            the run has no such batch; nothing written.
        hsx.errors.RunGone: the address holds no run (deleted); RunCancelled: ``producer cancel``.
        hsx.errors.BadPlan: the batch's plan file is damaged.
        FidelityError: every sample of the batch had NaN/Inf states (nothing to write; no shard, no marker).
        hsx.errors.SpoolFull: the shard had to go to the spool and the spool's disk is full, or
            the shard can never fit in it.
        hsx.errors.StoreError: the store refused a write, or stayed unreachable for
            ``HSX_STORE_RETRY_S`` seconds. A full store is waited for, never raised (:func:`until_room`).
    """
    hooks = faults.hooks()  # fault injection from outside the steps: in production every hook returns at once
    claimed = claim(run_url, batch, settings)
    if isinstance(claimed, dict):
        return claimed  # its marker exists: a duplicate delivery, or the retry of a finished batch
    job = _Job(claimed, settings, task_id)
    result = None
    try:
        if claimed.config.regenerate is not None:  # a regenerate run: answered, not captured (workers/generate.py)
            from workers.generate import regenerate_batch

            result = regenerate_batch(claimed, settings, job)
            return result
        work = prepare(claimed, hooks.store(claimed.store, batch), settings, job)
        forwarded = forward(work, job)
        hooks.pause("forward", batch)
        hooks.pause("upload", batch)
        written = write(work, forwarded, job, hooks.spool_writer(write_shard))
        hooks.pause("marker", batch)
        result = certify(work, forwarded, written, job)
        return result
    finally:
        job.end(result)


def claim(run_url: str, batch: str, settings: Settings) -> Claimed | dict:
    """The claim step: check a task's message before anything is written for it. The run lies
    under this worker's roots, the batch is a batch name, the batch has no marker yet (a batch is
    done if and only if its marker exists), the run exists and is not cancelled, the batch is
    planned, and (``HSX_MODEL``) the run was planned for this worker's model. Returns the
    :class:`Claimed` batch, or ``{"status": "already_done"}`` when its marker exists.

    Raises what :func:`extract_batch` raises before the forward (NotServed, Refused, RunGone,
    RunCancelled, BadPlan, a transient StoreError after ``HSX_STORE_RETRY_S``).
    """
    # The allow-list first, before any store call (hsx/access.py): opening a store would already
    # create a local directory.
    check_run_allowed(run_url, settings)
    if not isinstance(batch, str) or not _BATCH_NAME.fullmatch(batch):
        raise Refused(f"task batch {str(batch)[:80]!r} refused: a batch is one name of letters, digits, '-' and '_' "
                      "(such as b000012, from plan/batches.json); this task was not sent by producer enqueue")
    root = normalise(run_url)
    if root.kind == "local" and not os.path.isdir(root.path):
        _stores.pop(run_url, None)
        _configs.pop(run_url, None)
        raise RunGone(f"run {run_url}: {root.path} does not exist (the run was deleted, or never planned there)")
    run_store = _retry(settings, f"open the store of batch {batch}", lambda: _run_store(run_url, settings))
    if _retry(settings, f"read the marker of batch {batch}", lambda: Marker.read(run_store, batch)) is not None:
        log.info("batch %s of %s already has its marker: nothing to do", batch, run_url)
        return {"status": "already_done", "batch": batch}
    try:
        config = _retry(settings, f"read run.json of batch {batch}", lambda: _run_config(run_url, run_store))
    except MissingKey:
        raise RunGone(f"run {run_url}: no run.json there (the run was deleted, or never planned there)") from None
    cancelled = _retry(settings, f"read cancelled.json of batch {batch}", lambda: Cancelled.read(run_store))
    if cancelled is not None:
        raise RunCancelled(f"run {config.run_id} at {run_url} was cancelled ({cancelled.by}, {cancelled.at}); "
                           "`producer run` / `enqueue` of the same run resumes it")
    try:
        plan = _retry(settings, f"read the plan of batch {batch}", lambda: read_batch(run_store, batch))
    except MissingKey:
        if not _retry(settings, f"read run.json of {run_url}", lambda: _run_exists(run_url, run_store)):
            _configs.pop(run_url, None)
            raise RunGone(f"run {run_url}: no run.json there any more (the run was deleted)") from None
        raise Refused(f"task batch {batch!r} of run {config.run_id} refused: the run has no such batch in its plan "
                      "(plan/batches/); this task was not sent by producer enqueue for this run") from None
    if settings.model:
        # HSX_MODEL: this worker serves its own checkpoint only; a run planned for another is refused
        # before anything is loaded (get_target of the run's name would replace the loaded model).
        target = get_target(settings.model, settings)
        differences = target.info.differences(config.model)
        if differences:
            raise ModelNotServed(
                f"batch {batch}: run {config.run_id} was planned for model {config.model_name!r}, and this worker serves "
                f"HSX_MODEL={settings.model!r}, another checkpoint ({'; '.join(differences)}). Fix: send the run to "
                "workers started with its model, or plan it with this worker's model")
    return Claimed(run_url, batch, run_store, config, plan)


@dataclass
class Prepared:
    """A claimed batch ready for its forward (:func:`prepare`)."""

    claimed: Claimed
    store: object
    """The run's store as the steps write through it (the fault hooks' :class:`workers.faults.FaultyStore` in tests)."""
    target: object
    selection: LayerSelection
    store_dtype: StoreDtype
    states_per_token: int
    """Stored vectors per token: one per captured layer, one per final tensor."""
    expected_bytes: int
    """Upper bound of the shard's size (:func:`shard_bytes_estimate`): the room asked of the store and the spool."""
    spool: object
    ranges: list
    """``(first, end)`` sample ranges, one per forward: several when the batch is above the forward limit."""
    rows: list
    """The padded input rows of each range, laid out (and pinned) on the host."""

    @property
    def on_cuda(self) -> bool:
        return self.target.device.type == "cuda"


@dataclass
class Forwarded:
    """The forward step's states on the host (:func:`forward`) and its timings."""

    captured: object
    forwards: int
    launch_s: float
    forward_s: float


@dataclass
class Written:
    """The write step's stored shard (:func:`write`): what its marker says of it."""

    key: str
    nbytes: int
    sha256: str
    path: str
    """How it reached the store: ``direct``, ``spool`` or ``memory`` (:func:`_write_shard`)."""
    write_s: float
    num_samples: int
    num_tokens: int
    supervised_tokens: int
    quarantined: list


def prepare(claimed: Claimed, store, settings: Settings, job: _Job) -> Prepared:
    """The prepare step: the target loaded (once per process) and checked against the run's model,
    what the shard will hold and its size bound, and the batch's rows laid out on the host.

    Raises:
        hsx.access.ModelNotServed: the worker's checkpoint is not the run's (changed since planning).
    """
    config, plan, batch = claimed.config, claimed.plan, claimed.batch
    job.phase("loading")
    target = get_target(settings.model or config.model_name, settings)
    job.heartbeat.device = target.engine.get("device")
    differences = target.info.differences(config.model)
    if differences:
        raise ModelNotServed(
            f"batch {batch}: this worker's checkpoint is not the one run {config.run_id} was planned for "
            f"({'; '.join(differences)}); the checkpoint changed since planning. Re-plan the run or point the worker at "
            "the same checkpoint."
        )
    selection = config.layers.selection()
    store_dtype = StoreDtype(config.store_dtype)
    states_per_token = len(selection.layer_ids) + len(Final(selection.final).tensors)
    spool = process_spool(settings)
    job.heartbeat.spool = spool
    expected = shard_bytes_estimate(plan.num_tokens, plan.num_samples, states_per_token, target.info.hidden_size,
                                    store_dtype.itemsize, _scale_bytes(store_dtype))
    # Rows and their indices are laid out (and pinned) on the host before the GPU lock: under it,
    # nothing but queueing the forwards and their copies.
    ranges, rows = _lay_out(plan, target, target.max_forward_tokens)
    return Prepared(claimed, store, target, selection, store_dtype, states_per_token, expected, spool, ranges, rows)


def _scale_bytes(store_dtype: StoreDtype) -> int:
    return SCALE_BYTES if store_dtype.scaled else 0


def _lay_out(plan: BatchPlan, target, max_tokens: int | None) -> tuple[list, list]:
    """``(ranges, rows)``: the batch cut into forwards of at most ``max_tokens`` padded tokens (of
    consecutive samples, into the same shard), and each forward's right-padded rows."""
    cu = torch.from_numpy(plan.cu_seqlens_N1)
    input_ids_T = torch.from_numpy(plan.input_ids_T)
    ranges = split_by_tokens(cu, max_tokens)
    return ranges, [right_padded_rows(input_ids_T[int(cu[a]):int(cu[b])], cu[a:b + 1] - cu[a],
                                      pad_token_id=target.pad_token_id, pin=target.device.type == "cuda")
                    for a, b in ranges]


def forward(work: Prepared, job: _Job) -> Forwarded:
    """The forward step: the batch's states on the host.

    Not into a store with no room for the shard (a pause, not a failed attempt), nor for a run
    cancelled with ``--now`` meanwhile; then a host buffer from the process's pool (the
    backpressure), and, under the GPU lock, the forwards and their device-to-host copies queued
    (:func:`_launch`, with its out-of-memory split). The lock is released before waiting for the
    copies, so the next batch's forward is queued right behind this one and the GPU never idles
    between batches while this thread waits and then writes its shard."""
    _room_before_forward(job, work.expected_bytes)
    _check_cancelled_now(job)
    _take_host_buffer(work, job)
    job.phase("waiting_gpu")
    with work.target.gpu_lock:
        release_kept_manager(work.target.model)  # a regenerate run's paged cache is not in the forward limit
        job.phase("forward")
        t_fwd = time.perf_counter()
        pending = _launch(work, job)
        launch_s = time.perf_counter() - t_fwd
    captures = [p.wait() for p in pending]
    captured = captures[0] if len(captures) == 1 else merge_captured(captures, [a for a, _ in work.ranges])
    return Forwarded(captured, forwards=len(work.ranges), launch_s=launch_s, forward_s=time.perf_counter() - t_fwd)


def _take_host_buffer(work: Prepared, job: _Job) -> None:
    """A host buffer from the pool, pinned for the run's largest batch, before the GPU lock
    (pinning is slow and must not stall the GPU)."""
    batch, spool = job.batch, work.spool
    job.pool = process_host_buffers(job.settings)
    job.phase("waiting_buffer")
    paused_at = []

    def waiting_for_a_buffer():
        # Every host buffer holds a shard the store has not taken yet. That is a pause (status says
        # why) only once the overflow is full too; before that the store is merely slower than the GPU.
        reason = spool.full_reason(work.expected_bytes)
        if reason is not None and not paused_at:
            paused_at.append(time.monotonic())
            spool.paused_reason = (f"every host buffer ({job.pool.size}, HSX_WORKER_CONCURRENCY) holds a shard the store "
                                   f"has not taken, and {reason}")
            spool.paused_since = spool.paused_since or time.time()
            log.warning("batch %s paused before the forward: %s", batch, spool.paused_reason)
            job.phase("paused")

    job.buffer = job.pool.acquire(on_wait=waiting_for_a_buffer)
    if paused_at:
        spool.paused_reason = spool.paused_since = None
        log.info("batch %s resumed after %.1f s paused", batch, time.monotonic() - paused_at[0])
    # once per buffer, for the run's largest batch (+ one NaN/Inf flag byte per token and part)
    max_tokens = max(work.claimed.config.batch_tokens, work.claimed.plan.num_tokens)
    job.buffer.reserve(max_tokens * work.states_per_token
                       * (work.target.info.hidden_size * work.store_dtype.itemsize + _scale_bytes(work.store_dtype) + 1),
                       pin=work.on_cuda)


def _launch(work: Prepared, job: _Job) -> list:
    """Queue the forwards of ``work.ranges`` and their copies (under the GPU lock); the pending captures.

    One range goes into the pooled host buffer; several each into their own host tensors, merged
    after. ``target.launch`` is ``launch_capture``, or the worker's tensor-parallel group (a
    GroupBroken from it is transient: ``workers/group.py``). Out of GPU memory, the measured limit
    was too optimistic (fragmentation, another process on the GPU): it is halved for this process
    and the batch runs again in smaller forwards, unless the forward that failed held one sample
    alone (nothing smaller to run: the task fails)."""
    target = work.target
    while True:
        try:
            return [target.launch(r, work.selection, store_dtype=work.store_dtype.torch_dtype,
                                  host_buffer=job.buffer if len(work.rows) == 1 else None) for r in work.rows]
        except torch.OutOfMemoryError:
            padded = max(r.shape[0] * r.shape[1] for r in work.rows)
            ranges, rows = _lay_out(work.claimed.plan, target, padded // 2)
            if not work.on_cuda or len(ranges) == len(work.ranges):
                raise
        # outside the handler: the failed forward's tensors, held by the exception's frames until
        # here, are freed, so their blocks go back to the GPU rather than staying cached
        torch.cuda.empty_cache()
        target.max_forward_tokens = padded // 2
        log.warning("batch %s: out of GPU memory at %s padded tokens per forward; retrying with at most %s",
                    job.batch, f"{padded:,}", f"{target.max_forward_tokens:,}")
        work.ranges, work.rows = ranges, rows


def write(work: Prepared, forwarded: Forwarded, job: _Job, write_spool) -> Written:
    """The write step: the shard serialised from the host buffer straight into the store.

    Samples with NaN or Inf states are quarantined first (:func:`_quarantine`). The shard's key
    carries a random attempt id, so racing duplicates never overwrite each other's shard. A store
    that does not take it for a transient reason sends it through the overflow
    (:func:`_write_shard`; ``write_spool(path, pieces)`` writes the spool file); a full store is a
    pause (:func:`until_room`). The host buffer is free once this returns.
    """
    config, batch = work.claimed.config, work.claimed.batch
    tensors, quarantined = _quarantine(work, forwarded.captured)
    metadata = shard_metadata(config.run_id, batch, config.layers, config.model, work.target.engine,
                              store_dtype=config.store_dtype)
    pieces = serialize_shard(tensors, metadata)
    attempt = uuid.uuid4().hex[:12]
    key = shard_key(batch, attempt)
    spool_path = work.spool.directory / spool_file_name(config.run_id, batch, attempt)
    t_write = time.perf_counter()
    nbytes, sha256, path = until_room(job, f"store shard {key}",
                                      lambda: _write_shard(work, key, pieces, spool_path, job, write_spool),
                                      work.expected_bytes)
    job.release_buffer()
    return Written(key, nbytes, sha256, path, write_s=time.perf_counter() - t_write,
                   num_samples=int(tensors["sample_index"].shape[0]), num_tokens=int(tensors["input_ids"].shape[0]),
                   supervised_tokens=int(tensors["loss_mask"].sum()), quarantined=quarantined)


def _quarantine(work: Prepared, captured) -> tuple[dict, list]:
    """The shard's tensors without the samples whose states hold NaN or Inf, and the list of those
    (``sample_index`` and reason, for the marker).

    Raises:
        NonFiniteBatch: every sample has them (nothing to write: no shard, no marker).
    """
    config, plan, batch, engine = work.claimed.config, work.claimed.plan, work.claimed.batch, work.target.engine
    tensors = {
        "input_ids": torch.from_numpy(plan.input_ids_T.astype("int32")),
        "loss_mask": torch.from_numpy(plan.loss_mask_T.astype("uint8")),
        "cu_seqlens": torch.from_numpy(plan.cu_seqlens_N1).to(torch.int64),
        "sample_index": torch.from_numpy(plan.sample_index_N.astype("int64")),
        **captured.states,
    }
    quarantined = [
        {"sample_index": int(plan.sample_index_N[j]), "reason": f"nonfinite hidden states (layers {', '.join(parts)})"}
        for j, parts in sorted(captured.nonfinite.items())
    ]
    if not quarantined:
        return tensors, quarantined
    if len(quarantined) == plan.num_samples:
        raise NonFiniteBatch(
            f"batch {batch} of run {config.run_id}: all {plan.num_samples} samples have NaN/Inf hidden states "
            f"(first: {quarantined[0]}); nothing to write, so no shard and no marker. Every sample failing points at "
            f"the model or the kernels ({engine.get('compute_dtype')} on {engine.get('device')}), "
            "not the data: check the checkpoint and the worker's log."
        )
    keep_N = torch.ones(plan.num_samples, dtype=torch.bool)
    keep_N[list(captured.nonfinite)] = False
    log.warning("batch %s: quarantined %d of %d samples: %s", batch, len(quarantined), plan.num_samples, json.dumps(quarantined))
    return select_samples(tensors, keep_N), quarantined


def _write_shard(work: Prepared, key: str, pieces: list, spool_path, job: _Job, write_spool) -> tuple[int, str, str]:
    """Put the serialised shard ``pieces`` under ``key``: (bytes, sha256 hex, path taken).

    ``direct``: straight from the host buffer into the store, in one pass. If the store does not
    take it for a transient reason: ``spool`` when the overflow has room (the shard is written to
    the spool by ``write_spool``, the host buffer is freed for the next forward, and the spool file
    is stored with retries, its sha256 checked against the spool's), else ``memory`` (retried from
    the host buffer).
    """
    store, batch, settings, expected = work.store, job.batch, job.settings, work.expected_bytes
    job.phase("writing")
    try:
        nbytes, sha256 = store.write_stream(key, pieces)
        return nbytes, sha256, "direct"
    except StoreError as exc:
        if not exc.transient:
            raise
        log.warning("batch %s: the store did not take shard %s (%s); it goes to the overflow", batch, key, exc)
    job.ticket = work.spool.try_admit(expected, what=f"batch {batch}")
    if job.ticket is None:
        job.phase("storing")
        nbytes, sha256 = _retry(settings, f"store shard {key} of batch {batch}", lambda: store.write_stream(key, pieces))
        return nbytes, sha256, "memory"
    try:
        job.phase("spooling")
        try:
            nbytes, sha256 = write_spool(spool_path, pieces)
        except OSError as exc:
            if is_disk_full(exc):
                raise spool_full_error(spool_path, exc, expected) from exc
            raise
        job.ticket.written()
        job.release_buffer()  # the shard is safe in the spool: the next forward may use the buffer
        job.phase("storing")  # write_file checks the stored bytes' sha256 against the spool's: nothing to read back
        _retry(settings, f"store shard {key} of batch {batch}", lambda: write_file(store, key, spool_path, sha256))
    finally:
        spool_path.unlink(missing_ok=True)
        job.ticket.release()
        job.ticket = None
    return nbytes, sha256, "spool"


def certify(work: Prepared, forwarded: Forwarded, written: Written, job: _Job) -> dict:
    """The certify step: the marker (:class:`hsx.records.Marker`), last, with a conditional create.

    Returns ``{"status": "done", ...}``, or ``lost_race`` when another worker's marker names its own
    shard (ours is deleted). A run cancelled with ``--now`` meanwhile gets no marker (our shard is
    deleted, RunCancelled raised)."""
    config, store, batch, key = work.claimed.config, work.store, work.claimed.batch, written.key
    settings = job.settings
    job.phase("marker")
    marker = _marker(work, forwarded, written, job)

    def create() -> bool:
        """True when the marker that exists names our shard. A lost race is only a settled one: the
        store's create said the marker exists (an unsettled create raises a transient StoreError)
        and a read finds it naming another shard; a marker that cannot be read back is not settled
        either, and the pair is tried again."""
        if marker.create(store):
            return True
        existing = Marker.read(store, batch)
        if existing is None:
            raise StoreError(f"marker of batch {batch}: the conditional create found one, a read finds none "
                             "(deleted meanwhile, or a store that is not yet consistent); not settled", transient=True)
        return existing.shard.key == key  # a retried create can find its own first attempt

    try:
        _check_cancelled_now(job)
    except RunCancelled:
        _retry(settings, f"delete shard {key}", lambda: store.delete(key))
        raise
    if not until_room(job, f"write the marker of batch {batch}",
                      lambda: _retry(settings, f"write the marker of batch {batch}", create), 1 << 20):
        _retry(settings, f"delete shard {key}", lambda: store.delete(key))  # another worker certified its own shard first
        log.info("batch %s: another worker wrote the marker first; removed our shard %s", batch, key)
        return {"status": "lost_race", "batch": batch}
    seconds = marker.seconds
    log.info(
        "batch done %s",
        json.dumps(
            {"run": config.run_id, "batch": batch, "samples": written.num_samples, "tokens": written.num_tokens,
             "quarantined": len(written.quarantined), "seconds": seconds,
             "tok_s": round(work.claimed.plan.num_tokens / max(seconds, 1e-9)), "bytes": written.nbytes,
             "write_path": written.path}
        ),
    )
    return {"status": "done", "batch": batch, "num_tokens": written.num_tokens,
            "num_quarantined": len(written.quarantined), "seconds": seconds}


def _marker(work: Prepared, forwarded: Forwarded, written: Written, job: _Job) -> Marker:
    config, plan, target = work.claimed.config, work.claimed.plan, work.target
    return Marker(
        run_id=config.run_id, batch=work.claimed.batch, config_sha256=config.identity_sha256(),
        shard=ShardRef(key=written.key, bytes=written.nbytes, sha256=written.sha256),
        num_samples=written.num_samples, num_tokens=written.num_tokens, supervised_tokens=written.supervised_tokens,
        planned_samples=plan.num_samples, planned_tokens=plan.num_tokens,
        quarantined=written.quarantined, num_quarantined=len(written.quarantined),
        worker=MarkerWorker(host=socket.gethostname(), pid=os.getpid(), device=target.engine["device"]),
        model_revision=target.info.revision,
        forward_s=round(forwarded.forward_s, 4), launch_s=round(forwarded.launch_s, 4), forwards=forwarded.forwards,
        write_s=round(written.write_s, 4), write_path=written.path,
        seconds=round(time.perf_counter() - job.started, 4),
        finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), finished_unix=round(time.time(), 3),
    )


# --- what the task asks after a failure ------------------------------------------------------------


def _run_exists(run_url: str, run_store) -> bool:
    try:
        run_store.read("run.json")
        return True
    except MissingKey:
        return False


def run_exists(run_url: str, settings: Settings) -> bool:
    """False only when the run's address surely holds no run any more (deleted); True when it does,
    or when the store cannot tell now."""
    try:
        root = normalise(run_url)
        if root.kind == "local":
            return os.path.isfile(os.path.join(root.path, "run.json"))
        return _run_exists(run_url, _run_store(run_url, settings))
    except Exception:
        return True


def record_failure(run_url: str, batch: str, exc: BaseException, settings: Settings) -> None:
    """Write ``failures/<batch>.json`` (:class:`hsx.records.Failure`) so that ``status`` and ``run``
    can show why a batch failed."""
    try:
        run_store = _run_store(run_url, settings)
        Failure(batch=batch, error=f"{exc.__class__.__name__}: {exc}"[:2000], host=socket.gethostname(),
                at=datetime.now(timezone.utc).isoformat(timespec="seconds")).write(run_store)
    except Exception:  # the store may be the thing that failed; the task's own error is raised anyway
        log.exception("could not record the failure of batch %s", batch)
