"""The plan: tokenised samples and their batch assignment, as stored under ``<run>/plan/``.

Layout::

    plan/batches/<batch>.safetensors   one per batch: the samples the worker feeds to the model
    plan/samples.jsonl                 one line per sample, in sample_index order: record id, tokens, batch
    plan/batches.json                  the batch list; written LAST, so its presence means the plan is complete
    plan/planning.json                 while the plan is written: who plans it; if planning failed: why

Each batch file holds (legend: T = tokens in the batch, N = samples in the batch):

| tensor       | dtype | shape  | meaning                                          |
|--------------|-------|--------|--------------------------------------------------|
| input_ids    | int32 | [T]    | token ids of the samples, concatenated           |
| loss_mask    | uint8 | [T]    | 1 on supervised (assistant) tokens               |
| cu_seqlens   | int64 | [N+1]  | sample boundaries: sample j is [cu[j], cu[j+1])  |
| sample_index | int64 | [N]    | each sample's row in ``samples.jsonl``           |
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from core.processes import pid_alive
from core.store import Store, exists

BATCHES_JSON = "plan/batches.json"
SAMPLES_JSONL = "plan/samples.jsonl"
#: The planner's record: ``{"state": "planning" | "failed", "host", "pid", "started_at", "command",
#: "error", "failed_at"}``. Removed when the plan is complete; ignored once ``batches.json`` exists.
PLANNING_JSON = "plan/planning.json"


def batch_id(index: int) -> str:
    """Stable, sortable batch name: ``b000042``."""
    return f"b{index:06d}"


def batch_key(batch: str) -> str:
    return f"plan/batches/{batch}.safetensors"


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

    def to_bytes(self) -> bytes:
        return st_save(
            {
                "input_ids": self.input_ids_T.astype(np.int32, copy=False),
                "loss_mask": self.loss_mask_T.astype(np.uint8, copy=False),
                "cu_seqlens": self.cu_seqlens_N1.astype(np.int64, copy=False),
                "sample_index": self.sample_index_N.astype(np.int64, copy=False),
            },
            metadata={"batch": self.batch},
        )

    @classmethod
    def from_bytes(cls, batch: str, data: bytes) -> "BatchPlan":
        t = st_load(data)
        return cls(batch, t["input_ids"], t["loss_mask"], t["cu_seqlens"], t["sample_index"])

    def summary(self) -> dict:
        lengths = self.lengths_N
        return {
            "batch": self.batch,
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "max_len": int(lengths.max()) if len(lengths) else 0,
            "supervised_tokens": int(self.loss_mask_T.sum()),
        }


def read_batch(run_store: Store, batch: str) -> BatchPlan:
    """Read one batch of the plan. Raises :class:`core.store.MissingKey` if it was never planned."""
    return BatchPlan.from_bytes(batch, run_store.read(batch_key(batch)))


def read_batch_list(run_store: Store) -> list[dict]:
    """The plan's batch summaries (``batch``, ``num_samples``, ``num_tokens``, ``max_len``...)."""
    return json.loads(run_store.read(BATCHES_JSON))


def plan_complete(run_store: Store) -> bool:
    return exists(run_store, BATCHES_JSON)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def start_planning_record(run_store: Store, command: str | None = None) -> dict:
    """Write ``plan/planning.json`` saying this process is planning the run; returns the record."""
    record = {"state": "planning", "host": socket.gethostname(), "pid": os.getpid(), "started_at": _now(),
              "command": command}
    run_store.write(PLANNING_JSON, json.dumps(record, indent=1).encode())
    return record


def fail_planning_record(run_store: Store, record: dict, error: str) -> None:
    """Mark the planning of ``record`` as failed with ``error`` (best effort: never raises)."""
    try:
        run_store.write(PLANNING_JSON, json.dumps({**record, "state": "failed", "failed_at": _now(), "error": error},
                                                  indent=1).encode())
    except Exception:  # the store may be what failed; status then falls back to the planner's pid
        pass


def read_planning_record(run_store: Store) -> dict | None:
    """``plan/planning.json`` as written, or None when there is none (or it is unreadable)."""
    try:
        record = json.loads(run_store.read(PLANNING_JSON))
    except Exception:
        return None
    return record if isinstance(record, dict) else None


def planning_failed(record: dict | None) -> str | None:
    """Why the planning of a run whose plan is not complete did not finish, or None while it may still go on.

    Failed: the planner recorded a failure, or it planned on this host and its process is gone.
    """
    if not record:
        return None
    if record.get("state") == "failed":
        return str(record.get("error") or "failed")
    pid = record.get("pid")
    if record.get("host") == socket.gethostname() and isinstance(pid, int) and not pid_alive(pid):
        return f"the planner (pid {pid} on {record.get('host')}) exited without finishing the plan"
    return None
