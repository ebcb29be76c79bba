"""One batch, end to end on a worker: claim, plan, forward, write, certify.

- **claim**: a batch whose marker exists is done: a duplicate or retried task returns at once.
- **plan**: the run's config and the batch's plan from the store; the target loaded (once per
  process) and checked against the run's model; the rows laid out on the host.
- **forward**: a host buffer from the process's pool (:class:`workers.spool.HostBufferPool`: the
  backpressure), then, under the GPU lock, the forward and its device-to-host copies queued
  (``workers/capture.py``); the lock is released before waiting for the copies, so the next batch's
  forward is queued right behind this one.
- **write**: samples with NaN or Inf states are quarantined (left out, listed in the marker with
  the reason; a batch with none left fails loudly with :class:`FidelityError`: no shard, no
  marker). The shard is serialised from the host buffer straight into the store
  (``Store.write_stream``): its bytes are written once, hashed beside the write, and certified by
  that hash (S3: by the server's per-part checksums), with no read-back. If the store does not
  take it for a transient reason, the shard goes to the overflow spool and is stored from there
  with retries (``workers/spool.py``), freeing its host buffer for the next forward.
- **certify**: the marker (:class:`hsx.records.Marker`), last, with a conditional create
  (:meth:`hsx.records.Marker.create`). Shard keys carry a random attempt id, so racing duplicates never overwrite
  each other's shard; the loser deletes its own.

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
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone

import torch

from hsx.errors import FidelityError, NonFiniteBatch, RunCancelled, RunGone, StoreError, StoreFull
from hsx.fp8 import SCALE_BYTES
from hsx.layers import LayerSelection
from hsx.layout import shard_key
from hsx.plan import BatchPlan, read_batch
from hsx.records import Cancelled, Failure, Marker, MarkerWorker, ShardRef
from hsx.runconfig import load_run
from hsx.shard import Final, StoreDtype, select_samples, serialize_shard, shard_metadata
from hsx.access import ModelNotServed, Refused, check_run_allowed, normalise
from hsx.store import MissingKey, open_store, retry_transient, write_file
from settings import Settings
from workers.capture import merge_captured, right_padded_rows, split_by_tokens
from workers import faults
from workers.heartbeat import process_heartbeat
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


def _retry(settings: Settings, what: str, fn):
    return retry_transient(fn, what, total_s=settings.store_retry_s)


def shard_bytes_estimate(num_tokens: int, num_samples: int, states_per_token: int, hidden_size: int, itemsize: int,
                         scale_bytes: int = 0) -> int:
    """Upper bound of a shard's size in bytes, known before the forward: the states
    (``num_tokens x states_per_token x (hidden_size x itemsize + scale_bytes)``; fp8 stores a
    4-byte scale per token and part), the index tensors, and 64 KiB of header."""
    return (num_tokens * (states_per_token * (hidden_size * itemsize + scale_bytes) + 4 + 1) + (2 * num_samples + 1) * 8
            + (64 << 10))


class _Job:
    """What the wrapper of one task must clean up: the host buffer, the spool ticket, the heartbeat entry."""

    def __init__(self, run_url: str, batch: str, settings: Settings, task_id: str | None = None):
        self.run_url, self.batch, self.settings, self.task_id = run_url, batch, settings, task_id
        self.heartbeat = process_heartbeat(settings.heartbeat_s)
        self.store = None
        self.ticket = None
        self.pool = None
        self.buffer = None

    def phase(self, phase: str) -> None:
        if self.store is not None:
            self.heartbeat.phase(self.run_url, self.store, self.batch, phase, task_id=self.task_id)

    def release_buffer(self) -> None:
        if self.buffer is not None:
            self.pool.release(self.buffer)
            self.buffer = None


@dataclass
class Admitted:
    """A task's message, checked (:func:`admit`): its run's store and config, and the batch's plan."""

    run_url: str
    batch: str
    store: object
    config: object
    plan: BatchPlan


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
    admitted = admit(run_url, batch, settings)
    if isinstance(admitted, dict):
        return admitted
    job = _Job(run_url, batch, settings, task_id)
    job.store = admitted.store
    job.heartbeat.served(run_url)
    job.phase("claimed")
    result = None
    try:
        result = _extract_batch(admitted, settings, job)
        return result
    finally:
        job.release_buffer()
        if job.ticket is not None:
            job.ticket.release()
        job.heartbeat.finished(run_url, batch, certified=bool(result) and result.get("status") == "done")


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


def admit(run_url: str, batch: str, settings: Settings) -> Admitted | dict:
    """Check a task's message before anything is written for it: the run lies under this worker's
    roots, the batch is a batch name, the run exists and is not cancelled, the batch is planned,
    and (``HSX_MODEL``) the run was planned for this worker's model. Returns the
    :class:`Admitted` batch, or ``{"status": "already_done"}`` when its marker exists.

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
    return Admitted(run_url, batch, run_store, config, plan)


def store_room(run_store) -> tuple[str, int] | None:
    """``(path, free bytes)`` of a local store's filesystem (what a non-root user may still write);
    None for S3, whose room is known only when a write is refused."""
    path = run_store.local_path("run.json")
    if path is None:
        return None
    try:
        return str(path.parent), shutil.disk_usage(path.parent).free
    except OSError:
        return None


def _full_reason(run_store, exc: BaseException | None) -> str:
    room = store_room(run_store)
    if room is not None:
        return f"store full at {room[0]} ({room[1] / 2**20:,.0f} MiB free)"
    return f"store full at {run_store.url} ({str(exc)[:300] if exc else 'no room'})"


def until_room(job: "_Job", what: str, fn, need_bytes: int):
    """``fn()``, and while the store answers that it is full (:class:`hsx.errors.StoreFull`), a pause:
    the worker holds the batch (its host buffer and lease: no retries burned, no forward run again),
    says ``paused: store full at <path> (<free> free)`` in its presence and status records, and
    calls ``fn`` again once ``need_bytes`` are free (a local store: checked every
    ``HSX_HEARTBEAT_S``, at most 5 s) or every 30 s (S3: its room is only known by trying). Raises
    RunCancelled if the run is cancelled with ``--now`` meanwhile."""
    pause = _Pause(job, what, need_bytes)
    try:
        while True:
            try:
                return fn()
            except StoreFull as exc:
                pause.wait(exc)
    finally:
        pause.end()


def _room_before_forward(job: "_Job", need_bytes: int) -> None:
    """A local store without room for the shard pauses the worker before the forward runs."""
    room = store_room(job.store)
    if room is None or room[1] >= need_bytes:
        return
    pause = _Pause(job, "run the forward", need_bytes)
    try:
        pause.wait(None)
    finally:
        pause.end()


class _Pause:
    """One pause of a batch for room in a full store (:func:`until_room`)."""

    def __init__(self, job: "_Job", what: str, need_bytes: int):
        self.job, self.what, self.need = job, what, need_bytes
        self.since: float | None = None

    def wait(self, exc: BaseException | None) -> None:
        """Pause until the store has the room needed (local), or for 30 s (S3)."""
        job, settings = self.job, self.job.settings
        if self.since is None:
            self.since = time.monotonic()
            log.error("batch %s: %s, before it could %s: this worker pauses until there is room (%s MiB needed); "
                      "free space on the store, nothing needs restarting", job.batch, _full_reason(job.store, exc),
                      self.what, f"{self.need / 2**20:,.0f}")
        poll = max(0.5, min(settings.heartbeat_s, 5.0))
        deadline = time.monotonic() + max(30.0, 6 * settings.heartbeat_s)
        last_line = time.monotonic()
        while True:
            job.heartbeat.pause(_full_reason(job.store, exc))
            job.phase("paused")
            room = store_room(job.store)
            if room is not None and room[1] >= self.need:
                return
            if room is None and time.monotonic() >= deadline:
                return
            if time.monotonic() - last_line >= 60:
                last_line = time.monotonic()
                log.warning("batch %s: still paused, %s (%.0f s so far)", job.batch, _full_reason(job.store, exc),
                            time.monotonic() - self.since)
            _check_cancelled_now(job)
            time.sleep(poll)

    def end(self) -> None:
        if self.since is not None:
            self.job.heartbeat.resume()
            log.warning("batch %s: the store has room again; resumed after %.0f s paused", self.job.batch,
                        time.monotonic() - self.since)


def _check_cancelled_now(job: "_Job") -> None:
    """Raise RunCancelled if the run was cancelled with ``--now`` (``producer cancel --now``)."""
    try:
        cancelled = Cancelled.read(job.store)
    except Exception:  # a store that does not answer: the batch goes on
        return
    if cancelled is not None and cancelled.now:
        raise RunCancelled(f"run at {job.run_url} was cancelled with --now ({cancelled.by}, {cancelled.at}): batch "
                           f"{job.batch} stopped before its marker")


def _extract_batch(admitted: Admitted, settings: Settings, job: _Job) -> dict:
    """The body of :func:`extract_batch` (same result and errors); ``job`` tracks what its wrapper releases."""
    t0 = time.perf_counter()
    run_url, batch, run_store, config, plan = (admitted.run_url, admitted.batch, admitted.store, admitted.config,
                                               admitted.plan)
    job.store = run_store
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
    layers = config.layers
    selection = LayerSelection(tuple(layers["layer_ids"]), layers["final"], layers.get("preset"), layers["num_layers"])
    store_dtype = StoreDtype(config.store_dtype)
    scale_bytes = SCALE_BYTES if store_dtype.scaled else 0
    states_per_token = len(selection.layer_ids) + len(Final(selection.final).tensors)
    spool = process_spool(settings)
    job.heartbeat.spool = spool
    expected = shard_bytes_estimate(plan.num_tokens, plan.num_samples, states_per_token, target.info.hidden_size,
                                    store_dtype.itemsize, scale_bytes)
    cu_seqlens_N1 = torch.from_numpy(plan.cu_seqlens_N1)
    # Rows and their indices are laid out (and pinned) on the host before the lock: under it,
    # nothing but queueing the forwards and their copies. A batch bigger than this GPU's forward
    # limit runs as several forwards of consecutive samples into the same shard.
    on_cuda = target.device.type == "cuda"
    input_ids_T = torch.from_numpy(plan.input_ids_T)

    def rows_for(max_tokens):
        ranges = split_by_tokens(cu_seqlens_N1, max_tokens)
        cu = cu_seqlens_N1
        return ranges, [right_padded_rows(input_ids_T[int(cu[a]):int(cu[b])], cu[a:b + 1] - cu[a],
                                          pad_token_id=target.pad_token_id, pin=on_cuda) for a, b in ranges]

    ranges, rows = rows_for(target.max_forward_tokens)

    # forward: not into a store with no room for its shard (a pause, not a failed attempt), nor for a
    # run cancelled with --now meanwhile
    _room_before_forward(job, expected)
    _check_cancelled_now(job)
    job.pool = process_host_buffers(settings)
    job.phase("waiting_buffer")

    paused_at = []

    def waiting_for_a_buffer():
        # Every host buffer holds a shard the store has not taken yet. That is a pause (status says
        # why) only once the overflow is full too; before that the store is merely slower than the GPU.
        reason = spool.full_reason(expected)
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
    # Pinned once per buffer for the run's largest batch (+ one NaN/Inf flag byte per token and
    # part), before taking the GPU lock: pinning is slow and must not stall the GPU.
    max_tokens = max(config.batch_tokens, plan.num_tokens)
    job.buffer.reserve(max_tokens * states_per_token * (target.info.hidden_size * store_dtype.itemsize + scale_bytes + 1),
                       pin=on_cuda)
    job.phase("waiting_gpu")
    # One batch is queued on the GPU at a time. The lock is released as soon as the forward and its
    # copies are queued (no host sync), so the next thread's forward is queued right behind it and
    # the GPU never idles between batches, while this thread waits for its copies and then writes
    # its shard.
    with target.gpu_lock:
        job.phase("forward")
        t_fwd = time.perf_counter()
        pending = None
        while pending is None:
            try:
                # one range: the pooled host buffer; several: each range's own host tensors, merged below
                # target.launch: launch_capture, or through the worker's tensor-parallel group (a
                # GroupBroken from it is transient: workers/group.py)
                pending = [target.launch(r, selection, store_dtype=store_dtype.torch_dtype,
                                         host_buffer=job.buffer if len(rows) == 1 else None) for r in rows]
            except torch.OutOfMemoryError:
                # The measured limit was too optimistic (fragmentation, another process on the GPU):
                # halve it for this process and run the batch again in smaller forwards, unless the
                # forward that failed was one sample alone (nothing smaller to run: the task fails).
                padded = max(r.shape[0] * r.shape[1] for r in rows)
                smaller = rows_for(padded // 2)
                if not on_cuda or len(smaller[0]) == len(ranges):
                    raise
                pending = None
                torch.cuda.empty_cache()
                target.max_forward_tokens = padded // 2
                log.warning("batch %s: out of GPU memory at %s padded tokens per forward; retrying with at most %s",
                            batch, f"{padded:,}", f"{target.max_forward_tokens:,}")
                ranges, rows = smaller
        launch_s = time.perf_counter() - t_fwd
    range_captures = [p.wait() for p in pending]
    captured = range_captures[0] if len(range_captures) == 1 else merge_captured(range_captures, [a for a, _ in ranges])
    forward_s = time.perf_counter() - t_fwd
    faults.pause(settings.faults, "forward", batch)

    # write
    tensors = {
        "input_ids": torch.from_numpy(plan.input_ids_T.astype("int32")),
        "loss_mask": torch.from_numpy(plan.loss_mask_T.astype("uint8")),
        "cu_seqlens": cu_seqlens_N1.to(torch.int64),
        "sample_index": torch.from_numpy(plan.sample_index_N.astype("int64")),
        **captured.states,
    }
    quarantined = [
        {"sample_index": int(plan.sample_index_N[j]), "reason": f"nonfinite hidden states (layers {', '.join(parts)})"}
        for j, parts in sorted(captured.nonfinite.items())
    ]
    if quarantined:
        if len(quarantined) == plan.num_samples:
            raise NonFiniteBatch(
                f"batch {batch} of run {config.run_id}: all {plan.num_samples} samples have NaN/Inf hidden states "
                f"(first: {quarantined[0]}); nothing to write, so no shard and no marker. Every sample failing points at "
                f"the model or the kernels ({target.engine.get('compute_dtype')} on {target.engine.get('device')}), "
                "not the data: check the checkpoint and the worker's log."
            )
        keep_N = torch.ones(plan.num_samples, dtype=torch.bool)
        keep_N[list(captured.nonfinite)] = False
        tensors = select_samples(tensors, keep_N)
        log.warning("batch %s: quarantined %d of %d samples: %s", batch, len(quarantined), plan.num_samples, json.dumps(quarantined))
    num_samples, num_tokens = int(tensors["sample_index"].shape[0]), int(tensors["input_ids"].shape[0])
    metadata = shard_metadata(config.run_id, batch, layers, config.model, target.engine, store_dtype=config.store_dtype)
    pieces = serialize_shard(tensors, metadata)
    attempt = uuid.uuid4().hex[:12]
    key = shard_key(batch, attempt)
    faults.pause(settings.faults, "upload", batch)
    t_write = time.perf_counter()
    nbytes, sha256, path = until_room(
        job, f"store shard {key}",
        lambda: _write_shard(run_store, key, pieces, spool.directory / spool_file_name(config.run_id, batch, attempt),
                             batch, expected, spool, settings, job), expected)
    job.release_buffer()
    t_done = time.perf_counter()
    faults.pause(settings.faults, "marker", batch)

    # certify
    job.phase("marker")
    marker = Marker(
        run_id=config.run_id, batch=batch, config_sha256=config.identity_sha256(),
        shard=ShardRef(key=key, bytes=nbytes, sha256=sha256),
        num_samples=num_samples, num_tokens=num_tokens, supervised_tokens=int(tensors["loss_mask"].sum()),
        planned_samples=plan.num_samples, planned_tokens=plan.num_tokens,
        quarantined=quarantined, num_quarantined=len(quarantined),
        worker=MarkerWorker(host=socket.gethostname(), pid=os.getpid(), device=target.engine["device"]),
        model_revision=target.info.revision,
        forward_s=round(forward_s, 4), launch_s=round(launch_s, 4), forwards=len(ranges),
        write_s=round(t_done - t_write, 4), write_path=path,
        seconds=round(time.perf_counter() - t0, 4),
        finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), finished_unix=round(time.time(), 3),
    )

    def certify() -> bool:
        """True when the marker that exists names our shard. A lost race is only a settled one: the
        store's create said the marker exists (an unsettled create raises a transient StoreError)
        and a read finds it naming another shard; a marker that cannot be read back is not settled
        either, and the pair is tried again."""
        if marker.create(run_store):
            return True
        existing = Marker.read(run_store, batch)
        if existing is None:
            raise StoreError(f"marker of batch {batch}: the conditional create found one, a read finds none "
                             "(deleted meanwhile, or a store that is not yet consistent); not settled", transient=True)
        return existing.shard.key == key  # a retried create can find its own first attempt

    try:
        _check_cancelled_now(job)
    except RunCancelled:
        _retry(settings, f"delete shard {key}", lambda: run_store.delete(key))
        raise
    if not until_room(job, f"write the marker of batch {batch}",
                      lambda: _retry(settings, f"write the marker of batch {batch}", certify), 1 << 20):
        _retry(settings, f"delete shard {key}", lambda: run_store.delete(key))  # another worker certified its own shard first
        log.info("batch %s: another worker wrote the marker first; removed our shard %s", batch, key)
        return {"status": "lost_race", "batch": batch}
    seconds = marker.seconds
    log.info(
        "batch done %s",
        json.dumps(
            {"run": config.run_id, "batch": batch, "samples": num_samples, "tokens": num_tokens,
             "quarantined": len(quarantined), "seconds": seconds,
             "tok_s": round(plan.num_tokens / max(seconds, 1e-9)), "bytes": nbytes, "write_path": path}
        ),
    )
    return {"status": "done", "batch": batch, "num_tokens": num_tokens, "num_quarantined": len(quarantined), "seconds": seconds}


def _write_shard(run_store, key: str, pieces: list, spool_path, batch: str, expected: int, spool, settings: Settings,
                 job: _Job) -> tuple[int, str, str]:
    """Put the serialised shard ``pieces`` under ``key``: (bytes, sha256 hex, path taken).

    ``direct``: straight from the host buffer into the store, in one pass. If the store does not
    take it for a transient reason: ``spool`` when the overflow has room (the shard is written to
    the spool, the host buffer is freed for the next forward, and the spool file is stored with
    retries, its sha256 checked against the spool's), else ``memory`` (retried from the host buffer).
    """
    job.phase("writing")
    try:
        nbytes, sha256 = run_store.write_stream(key, faults.store_write(settings.faults, pieces, key, batch))
        return nbytes, sha256, "direct"
    except StoreError as exc:
        if not exc.transient:
            raise
        log.warning("batch %s: the store did not take shard %s (%s); it goes to the overflow", batch, key, exc)
    job.ticket = spool.try_admit(expected, what=f"batch {batch}")
    if job.ticket is None:
        job.phase("storing")
        nbytes, sha256 = _retry(settings, f"store shard {key} of batch {batch}",
                                lambda: run_store.write_stream(key, pieces))
        return nbytes, sha256, "memory"
    try:
        job.phase("spooling")
        try:
            faults.check_spool_write(settings.faults, spool_path)
            nbytes, sha256 = write_shard(spool_path, pieces)
        except OSError as exc:
            if is_disk_full(exc):
                raise spool_full_error(spool_path, exc, expected) from exc
            raise
        job.ticket.written()
        job.release_buffer()  # the shard is safe in the spool: the next forward may use the buffer
        job.phase("storing")  # write_file checks the stored bytes' sha256 against the spool's: nothing to read back
        _retry(settings, f"store shard {key} of batch {batch}", lambda: write_file(run_store, key, spool_path, sha256))
    finally:
        spool_path.unlink(missing_ok=True)
        job.ticket.release()
        job.ticket = None
    return nbytes, sha256, "spool"


def record_failure(run_url: str, batch: str, exc: BaseException, settings: Settings) -> None:
    """Write ``failures/<batch>.json`` (:class:`hsx.records.Failure`) so that ``status`` and ``run``
    can show why a batch failed."""
    try:
        run_store = _run_store(run_url, settings)
        Failure(batch=batch, error=f"{exc.__class__.__name__}: {exc}"[:2000], host=socket.gethostname(),
                at=datetime.now(timezone.utc).isoformat(timespec="seconds")).write(run_store)
    except Exception:  # the store may be the thing that failed; the task's own error is raised anyway
        log.exception("could not record the failure of batch %s", batch)
