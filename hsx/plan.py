"""The plan: tokenised samples and their batch assignment, as stored under ``<run>/plan/``.

Layout (keys: ``hsx/layout.py``; the JSON records: ``hsx/records.py``)::

    plan/batches/<batch>.safetensors   one per batch: the samples the worker feeds to the model
    plan/samples/<window>.jsonl        one line per sample of the window, in sample_index order: record id, tokens, batch (SampleRow)
    plan/windows/<window>.json         one per window, after its batches and samples: the window's batches (PlanWindow)
    plan/stats.json                    what the plan holds (Stats)
    plan/batches.json                  the batch list (BatchSummary); written LAST, so its presence means the plan is complete
    plan/planning.json                 while the plan is written: who plans it and how far it got; if planning failed: why (Planning)

**The plan is streamed.** The planner writes it one window at a time (``producer/planner.py``):
a window's batches are in the store, and may be enqueued, as soon as its record is; the batches
planned so far are the windows' batches (:func:`planned_batches`). ``plan/batches.json``, the
whole list, comes last. Runs made before windows have ``plan/samples.jsonl`` and no windows.

Each batch file holds (legend: T = tokens in the batch, N = samples in the batch):

| tensor       | dtype | shape  | meaning                                          |
|--------------|-------|--------|--------------------------------------------------|
| input_ids    | int32 | [T]    | token ids of the samples, concatenated           |
| loss_mask    | uint8 | [T]    | 1 on supervised (assistant) tokens               |
| cu_seqlens   | int64 | [N+1]  | sample boundaries: sample j is [cu[j], cu[j+1])  |
| sample_index | int64 | [N]    | each sample's row in ``samples.jsonl``           |
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from hsx.layout import BATCHES_JSON, PLANNING_JSON, SAMPLES_JSONL, batch_plan_key
from hsx.processes import pid_alive
from hsx.records import BatchSummary, Planning, PlanWindow, read_windows
from hsx.store import MissingKey, Store, exists

__all__ = ["BATCHES_JSON", "PLANNING_JSON", "SAMPLES_JSONL", "BatchPlan", "PlanWindow", "batch_id", "window_id",
           "batch_key", "read_batch", "read_batch_list", "read_windows", "planned_batches", "plan_complete", "start_planning_record", "fail_planning_record",
           "read_planning_record", "planning_failed"]


def batch_id(index: int) -> str:
    """Stable, sortable batch name: ``b000042``."""
    return f"b{index:06d}"


def window_id(index: int) -> str:
    """Stable, sortable window name: ``w000003``."""
    return f"w{index:06d}"


def batch_key(batch: str) -> str:
    """``plan/batches/<batch>.safetensors`` (:func:`hsx.layout.batch_plan_key`)."""
    return batch_plan_key(batch)


#: The plan file's metadata key holding :meth:`BatchPlan.tensors_sha256`.
PLAN_SHA256_KEY = "tensors_sha256"


def _metadata(data: bytes) -> dict:
    """The ``__metadata__`` of safetensors bytes (its header: 8 bytes of length, then JSON); {} if unreadable."""
    try:
        n = int.from_bytes(data[:8], "little")
        return json.loads(data[8:8 + n]).get("__metadata__") or {}
    except (ValueError, AttributeError):
        return {}


@dataclass
class BatchPlan:
    """One batch as planned: concatenated samples (no padding). See the module docstring for shapes."""

    batch: str
    input_ids_T: np.ndarray
    loss_mask_T: np.ndarray
    cu_seqlens_N1: np.ndarray
    sample_index_N: np.ndarray

    @property
    def num_samples(self) -> int:
        return int(self.sample_index_N.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_T.shape[0])

    @property
    def lengths_N(self) -> np.ndarray:
        return np.diff(self.cu_seqlens_N1)

    def _stored(self) -> dict[str, np.ndarray]:
        return {
            "input_ids": self.input_ids_T.astype(np.int32, copy=False),
            "loss_mask": self.loss_mask_T.astype(np.uint8, copy=False),
            "cu_seqlens": self.cu_seqlens_N1.astype(np.int64, copy=False),
            "sample_index": self.sample_index_N.astype(np.int64, copy=False),
        }

    def tensors_sha256(self) -> str:
        """sha256 of the four tensors' bytes as stored (int32 ``input_ids``, uint8 ``loss_mask``, int64
        ``cu_seqlens`` and ``sample_index``, little-endian, in that order): what the file's metadata
        records at planning, so that a changed token id or mask byte is found when the batch is read."""
        h = hashlib.sha256()
        for a in self._stored().values():
            h.update(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).data)
        return h.hexdigest()

    def to_bytes(self) -> bytes:
        data = st_save(self._stored(), metadata={"batch": self.batch, PLAN_SHA256_KEY: self.tensors_sha256()})
        # safetensors writes the metadata in a hash map's order, which differs between processes: the header
        # again with sorted keys, so that one plan is the same bytes however often it is written (a resumed
        # plan equals one pass). The data offsets count from the header's end: unchanged.
        n = int.from_bytes(data[:8], "little")
        head = json.dumps(json.loads(data[8:8 + n]), separators=(",", ":"), sort_keys=True).encode()
        head += b" " * (-len(head) % 8)
        return len(head).to_bytes(8, "little") + head + data[8 + n:]

    @classmethod
    def from_bytes(cls, batch: str, data: bytes) -> "BatchPlan":
        """Parse and check one batch file.

        Raises:
            hsx.errors.BadPlan: not safetensors, a tensor missing, or shapes that do not agree
                (``cu_seqlens`` must run from 0 to ``len(input_ids)`` without decreasing, with one
                entry more than ``sample_index``; ``loss_mask`` as long as ``input_ids``).
        """
        from hsx.errors import BadPlan

        try:
            t = st_load(data)
            plan = cls(batch, t["input_ids"], t["loss_mask"], t["cu_seqlens"], t["sample_index"])
        except Exception as exc:  # safetensors raises its own error types (and KeyError for a missing tensor)
            raise BadPlan(f"plan of batch {batch}: not a readable batch file ({exc.__class__.__name__}: {exc}); "
                          "it was damaged after planning: plan the run again into a new output") from None
        problem = plan.problem()
        if problem:
            raise BadPlan(f"plan of batch {batch}: {problem}; the file was damaged after planning: plan the run "
                          "again into a new output")
        recorded = _metadata(data).get(PLAN_SHA256_KEY)  # plans written before it was recorded have none
        if recorded is not None and recorded != plan.tensors_sha256():
            raise BadPlan(f"plan of batch {batch}: its tensors do not hash to the sha256 recorded when it was planned "
                          f"({recorded[:16]}...): a token id, mask byte or offset changed after planning; plan the run "
                          "again into a new output")
        return plan

    def problem(self) -> str | None:
        """What makes this plan inconsistent (see :meth:`from_bytes`), or None."""
        cu, t = self.cu_seqlens_N1, int(self.input_ids_T.shape[0])
        if self.input_ids_T.ndim != 1 or self.loss_mask_T.shape != self.input_ids_T.shape:
            return f"input_ids {tuple(self.input_ids_T.shape)} and loss_mask {tuple(self.loss_mask_T.shape)} differ"
        if cu.ndim != 1 or cu.shape[0] != self.sample_index_N.shape[0] + 1:
            return f"cu_seqlens has {cu.shape[0] if cu.ndim else 0} entries for {self.sample_index_N.shape[0]} samples"
        if cu.shape[0] == 0 or int(cu[0]) != 0 or int(cu[-1]) != t or bool((np.diff(cu) < 0).any()):
            return f"cu_seqlens {cu.tolist()[:6]}... does not run from 0 to the {t} tokens of input_ids without decreasing"
        return None

    def summary(self) -> BatchSummary:
        """The batch's entry in ``plan/batches.json``: samples, tokens, longest sample, supervised tokens."""
        lengths = self.lengths_N
        return BatchSummary(batch=self.batch, num_samples=self.num_samples, num_tokens=self.num_tokens,
                            max_len=int(lengths.max()) if len(lengths) else 0,
                            supervised_tokens=int(self.loss_mask_T.sum()))


def read_batch(run_store: Store, batch: str) -> BatchPlan:
    """Read one batch of the plan. Raises :class:`hsx.store.MissingKey` if it was never planned."""
    return BatchPlan.from_bytes(batch, run_store.read(batch_key(batch)))


def read_batch_list(run_store: Store) -> list[BatchSummary]:
    """The plan's batch summaries (``plan/batches.json``), in batch order.

    Raises:
        hsx.store.MissingKey: the plan is not complete.
        hsx.errors.RecordFormatError: ``plan/batches.json`` is not a valid batch list.
    """
    return BatchSummary.read_list(run_store)


def planned_batches(run_store: Store) -> tuple[list[BatchSummary], bool]:
    """The batches planned so far and whether the plan is complete: ``plan/batches.json`` when it
    is, else the batches of the windows written so far (in batch order). A run being planned has
    some; one not planned yet, none.

    Raises:
        hsx.errors.RecordFormatError: a damaged batch list or window record.
    """
    if plan_complete(run_store):
        try:
            return read_batch_list(run_store), True
        except MissingKey:  # a race with a delete: fall through to the windows
            pass
    return [b for w in read_windows(run_store) for b in w.batches], False


def plan_complete(run_store: Store) -> bool:
    """True when ``plan/batches.json`` exists: every batch of the run is planned."""
    return exists(run_store, BATCHES_JSON)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def start_planning_record(run_store: Store, command: str | None = None) -> Planning:
    """Write ``plan/planning.json`` saying this process is planning the run; returns the record."""
    record = Planning(state="planning", host=socket.gethostname(), pid=os.getpid(), started_at=_now(), command=command)
    record.write(run_store)
    return record


def fail_planning_record(run_store: Store, record: Planning, error: str) -> None:
    """Mark the planning of ``record`` as failed with ``error`` (best effort: never raises)."""
    try:
        record.model_copy(update={"state": "failed", "failed_at": _now(), "error": error}).write(run_store)
    except Exception:  # the store may be what failed; status then falls back to the planner's pid
        pass


def read_planning_record(run_store: Store) -> Planning | None:
    """``plan/planning.json``, or None when there is none (or it is unreadable)."""
    try:
        return Planning.read(run_store)
    except Exception:  # a record half written, or the store down: status says "planning" meanwhile
        return None


def planning_failed(record: Planning | None) -> str | None:
    """Why the planning of a run whose plan is not complete did not finish, or None while it may still go on.

    Failed: the planner recorded a failure, or it planned on this host and its process is gone.
    """
    if record is None:
        return None
    if record.state == "failed":
        return record.error or "failed"
    pid = record.pid
    if record.host == socket.gethostname() and pid is not None and not pid_alive(pid):
        return f"the planner (pid {pid} on {record.host}) exited without finishing the plan"
    return None
