"""A batch's plan file (``hsx/plan.py``): the token ids, loss mask and offsets the workers run and the
token echo checks against. Its tensors' sha256 is recorded in its own metadata when it is planned, so a
byte changed afterwards is found when the batch is read (by a worker, ``verify``, ``export``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load, save

from jobfixtures import run_here
from smallrun import copy_run

from hsx.errors import BadPlan
from hsx.plan import BatchPlan


def _metadata(data: bytes) -> dict:
    """The ``__metadata__`` of safetensors bytes (8 bytes of header length, then the JSON header)."""
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + n])["__metadata__"]


def _plan() -> BatchPlan:
    return BatchPlan("b000001", np.array([11, 12, 13, 14, 15, 16], dtype=np.int32), np.array([0, 1, 1, 0, 1, 1], np.uint8),
                     np.array([0, 3, 6]), np.array([7, 8]))


def test_a_plan_file_reads_back_as_written_and_a_changed_token_id_is_refused_naming_the_batch():
    data = _plan().to_bytes()
    back = BatchPlan.from_bytes("b000001", data)
    assert back.input_ids_T.tolist() == [11, 12, 13, 14, 15, 16] and back.sample_index_N.tolist() == [7, 8]
    tensors = load(data)
    ids = tensors["input_ids"].copy()
    ids[2] = 99  # still a valid id, shapes and offsets unchanged: only the hash can tell
    altered = save({**tensors, "input_ids": ids}, metadata=_metadata(data))  # the metadata as written, kept
    with pytest.raises(BadPlan, match=r"plan of batch b000001: its tensors do not hash to the sha256 recorded when it "
                                      r"was planned .*plan the run again into a new output"):
        BatchPlan.from_bytes("b000001", altered)


def test_a_plan_file_written_before_the_hash_was_recorded_still_reads():
    tensors = load(_plan().to_bytes())
    old = save(tensors, metadata={"batch": "b000001"})
    assert BatchPlan.from_bytes("b000001", old).num_tokens == 6


def test_verify_names_a_plan_file_whose_token_id_changed_after_planning(small_run, tmp_path):
    """A changed token id in a done batch's plan: the shard still echoes the old ids, the plan no longer hashes
    to what was recorded: ``verify`` fails naming the batch's plan (it passed before: the echo compared the
    stored ids with the damaged plan only when the batch was redone)."""
    run_dir = copy_run(small_run, tmp_path)
    path = run_dir / "plan" / "batches" / "b000001.safetensors"
    data = path.read_bytes()
    tensors = load(data)
    ids = tensors["input_ids"].copy()
    ids[0] = ids[0] + 1 if ids[0] < 1000 else ids[0] - 1
    path.write_bytes(save({**tensors, "input_ids": ids}, metadata=_metadata(data)))
    proc = run_here(["verify", str(run_dir)], small_run["env"])
    said = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode != 0, said
    assert "b000001" in said and "do not hash to the sha256 recorded when it was planned" in said, said


def test_verify_reports_a_damaged_plan_of_a_done_batch_as_a_problem_and_checks_the_others(small_run, tmp_path):
    """The batch still has its marker: verify does not stop at it (it exited 2 with no report), it lists it as
    ``plan_unreadable``, checks every other batch, exits 1, and says that only a new plan helps."""
    import json as _json

    run_dir = copy_run(small_run, tmp_path)
    path = run_dir / "plan" / "batches" / "b000001.safetensors"
    data = path.read_bytes()
    tensors = load(data)
    ids = tensors["input_ids"].copy()
    ids[-1] += 1
    path.write_bytes(save({**tensors, "input_ids": ids}, metadata=_metadata(data)))
    proc = run_here(["verify", str(run_dir), "--json"], small_run["env"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = _json.loads(proc.stdout)
    assert [(p["batch"], p["kind"]) for p in report["problems"]] == [("b000001", "plan_unreadable")], report["problems"]
    said = " ".join(run_here(["verify", str(run_dir)], small_run["env"]).stdout.split())
    assert "plan the run again into a new --output" in said and "reconcile" not in said.split("verify FAILED")[1], said
