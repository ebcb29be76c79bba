"""The worker's batch job (workers/extract.py) in-process on a planned run: quarantine of samples
whose hidden states hold NaN/Inf, and a loud failure when no sample of a batch is left.

The run is planned with the real planner (real ShareGPT records, the Qwen3 tokenizer, the built-in
tiny-qwen3.5 target: 8 layers, EAGLE-3 ids [1, 3, 4] + the post-norm final state). NaN is injected
with a forward hook on decoder layer 2 of the worker's loaded target, on the rows of chosen samples.
"""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np
import pytest
import torch

from jobfixtures import assert_matches_reference, plan_samples, read_samples

from hsx.errors import FidelityError
from hsx.plan import read_batch
from hsx.records import Marker
from settings import Settings


@pytest.fixture(scope="module")
def planned(tmp_path_factory, tiny_cache):
    """A run planned in-process: 16 ShareGPT records, several batches of 2+ samples, float32 states."""
    from producer.planner import PlanOptions, plan_run

    tmp = tmp_path_factory.mktemp("extract")
    settings = Settings(_env_file=None, cache_dir=tiny_cache, spool_dir=tmp / "spool", device="cpu", store_url=str(tmp / "out"))
    opts = PlanOptions(dataset="sharegpt", model="tiny-qwen3.5", output=str(tmp / "out"), limit=16, max_length=256,
                       batch_tokens=1024, store_dtype="float32")
    run = plan_run(opts, settings)
    batches = [b.batch for b in run.batches if b.num_samples >= 3]
    assert len(batches) >= 2, f"need two batches of 3+ samples, planned {run.batches}"
    return {"run": run, "settings": settings, "batches": batches, "spool": tmp / "spool"}


def inject_nan(target, batch_plan, rows: list[int], layer: int = 2):
    """A forward hook on decoder layer ``layer`` that writes NaN on the valid tokens of batch rows ``rows``.

    Acts only on the batch's own forward (same padded shape); returns the hook handle.
    """
    lengths = batch_plan.lengths_N.tolist()
    shape = (len(lengths), max(lengths))

    def hook(_module, _args, output):
        hidden_BSH = output[0] if isinstance(output, tuple) else output
        if tuple(hidden_BSH.shape[:2]) != shape:
            return None
        poisoned = hidden_BSH.clone()
        for row in rows:
            poisoned[row, : lengths[row]] = float("nan")
        return (poisoned, *output[1:]) if isinstance(output, tuple) else poisoned

    return target.model.model.layers[layer].register_forward_hook(hook)


def batch_shards(run_store, batch: str) -> list[str]:
    return [k for k in run_store.list("shards/") if k.rsplit("/", 1)[-1].startswith(batch + "-")]


def test_a_sample_with_nan_states_is_quarantined_and_the_rest_of_the_batch_is_written(planned):
    """NaN from layer 2 on in one sample: the shard lacks exactly that sample, the others equal the reference, the marker lists it."""
    from workers.extract import extract_batch
    from workers.target import get_target

    run, settings = planned["run"], planned["settings"]
    batch = planned["batches"][0]
    plan = read_batch(run.run_store, batch)
    victim_row = 1
    victim = int(plan.sample_index_N[victim_row])
    target = get_target("tiny-qwen3.5", settings)
    handle = inject_nan(target, plan, [victim_row])
    try:
        result = extract_batch(run.run_url, batch, settings)
    finally:
        handle.remove()
    assert result["status"] == "done" and result["num_quarantined"] == 1

    marker = Marker.read(run.run_store, batch)
    # Layer 1 is captured before the poison; layers 3, 4 and the post-norm state come after it.
    assert [q.model_dump() for q in marker.quarantined] == [{"sample_index": victim, "reason": "nonfinite hidden states (layers 3, 4, final_postnorm)"}]
    assert marker.num_quarantined == 1
    assert marker.planned_samples == plan.num_samples and marker.num_samples == plan.num_samples - 1
    assert marker.planned_tokens == plan.num_tokens
    assert marker.num_tokens == plan.num_tokens - int(plan.lengths_N[victim_row])

    stored = {s: v for s, v in read_samples(run.run_store).items() if v["batch"] == batch}
    kept = set(plan.sample_index_N.tolist()) - {victim}
    assert set(stored) == kept and len(kept) == plan.num_samples - 1
    planned_samples = plan_samples(run.run_store)
    for sample, s in stored.items():
        np.testing.assert_array_equal(s["input_ids"].numpy(), planned_samples[sample]["input_ids"].astype(np.int32))
        np.testing.assert_array_equal(s["loss_mask"].numpy(), planned_samples[sample]["loss_mask"])
        assert torch.isfinite(s["hidden_states"]).all() and torch.isfinite(s["final_postnorm"]).all()
    assert marker.supervised_tokens == sum(int(s["loss_mask"].sum()) for s in stored.values())
    compared = assert_matches_reference(target.model, stored, [1, 3, 4], atol=1e-4, rtol=1e-4)
    assert compared > 10_000, "the kept samples' states must have been compared"


def test_a_batch_whose_every_sample_is_nonfinite_fails_loudly_and_writes_no_marker(planned):
    """NaN in every sample: FidelityError naming the batch and the count; no marker, no shard, nothing left in the spool."""
    from workers.extract import extract_batch
    from workers.target import get_target

    run, settings = planned["run"], planned["settings"]
    batch = planned["batches"][1]
    plan = read_batch(run.run_store, batch)
    handle = inject_nan(get_target("tiny-qwen3.5", settings), plan, list(range(plan.num_samples)))
    try:
        with pytest.raises(FidelityError, match=rf"batch {batch} of run .*: all {plan.num_samples} samples have NaN/Inf hidden states"):
            extract_batch(run.run_url, batch, settings)
    finally:
        handle.remove()
    assert Marker.read(run.run_store, batch) is None
    assert batch_shards(run.run_store, batch) == []
    assert not any(planned["spool"].glob(f"*{batch}*"))

    # The same batch without the fault is then extracted in full: nothing half-done was left behind.
    result = extract_batch(run.run_url, batch, settings)
    marker = Marker.read(run.run_store, batch)
    assert result["status"] == "done" and marker.quarantined == [] and marker.num_samples == plan.num_samples
    assert json.loads(run.run_store.read(f"markers/{batch}.json"))["shard"]["key"] in batch_shards(run.run_store, batch)


def test_a_batch_bigger_than_the_forward_limit_runs_as_several_forwards_into_one_identical_shard(planned):
    """With a forward limit below the batch's padded size (as a GPU with little free memory measures),
    the batch runs in several forwards of consecutive samples; the one shard holds every sample,
    equal to each sample's own forward, and the marker counts the forwards."""
    from workers.extract import extract_batch
    from workers.target import get_target

    run, settings = planned["run"], planned["settings"]
    batch = planned["batches"][-1]
    plan = read_batch(run.run_store, batch)
    target = get_target("tiny-qwen3.5", settings)
    limit = int(plan.lengths_N.max())  # one longest row per forward
    saved, target.max_forward_tokens = target.max_forward_tokens, limit
    try:
        for key in batch_shards(run.run_store, batch):  # start clean if an earlier test ran this batch
            run.run_store.delete(key)
        if Marker.read(run.run_store, batch):
            run.run_store.delete(f"markers/{batch}.json")
        result = extract_batch(run.run_url, batch, settings)
    finally:
        target.max_forward_tokens = saved
    marker = Marker.read(run.run_store, batch)
    assert result["status"] == "done" and marker.forwards >= 2 and marker.num_samples == plan.num_samples
    stored = {s: v for s, v in read_samples(run.run_store).items() if v["batch"] == batch}
    assert set(stored) == set(plan.sample_index_N.tolist())
    assert assert_matches_reference(target.model, stored, [1, 3, 4], atol=1e-4, rtol=1e-4) > 0


def _redo(run_store, batch: str) -> None:
    for key in batch_shards(run_store, batch):
        run_store.delete(key)
    if Marker.read(run_store, batch):
        run_store.delete(f"markers/{batch}.json")


def _extract_with(planned, batch: str, faults: str | None = None, **overrides):
    """The batch extracted again in this process, with ``faults`` as ``HSX_FAULTS`` (workers/faults.py) and
    ``overrides`` of the run's settings: (result, marker)."""
    from workers import faults as fault_hooks
    from workers.extract import extract_batch

    fault_hooks.reset()
    settings = planned["settings"].model_copy(update=overrides)
    _redo(planned["run"].run_store, batch)
    with _faults_env(faults):
        return extract_batch(planned["run"].run_url, batch, settings), Marker.read(planned["run"].run_store, batch)


@contextlib.contextmanager
def _faults_env(spec: str | None):
    """``HSX_FAULTS=spec`` in this process's environment for the block (unset when None)."""
    from workers.faults import ENV

    before = os.environ.pop(ENV, None)
    if spec is not None:
        os.environ[ENV] = spec
    try:
        yield
    finally:
        os.environ.pop(ENV, None)
        if before is not None:
            os.environ[ENV] = before


def _certified(run_store, marker) -> bytes:
    import hashlib

    data = run_store.read(marker.shard.key)
    assert len(data) == marker.shard.bytes and hashlib.sha256(data).hexdigest() == marker.shard.sha256
    return data


def test_a_shard_goes_straight_from_host_memory_into_the_store_without_touching_the_spool(planned):
    """The default path: the marker says `direct`, the stored bytes hash to the marker's sha256, and no spool file was ever made."""
    batch = planned["batches"][0]
    spool = planned["spool"]
    before = set(spool.glob("*")) if spool.exists() else set()
    result, marker = _extract_with(planned, batch)
    assert result["status"] == "done" and marker.write_path == "direct"
    _certified(planned["run"].run_store, marker)
    assert (set(spool.glob("*")) if spool.exists() else set()) == before


def test_a_store_that_does_not_answer_sends_the_shard_through_the_spool_with_the_same_bytes(planned):
    """store_down=1: the direct write fails transiently, the shard is written to the spool and stored from there;
    the certified bytes equal those of a direct write of the same batch, and the spool file is gone."""
    batch = planned["batches"][0]
    _, direct = _extract_with(planned, batch)
    direct_bytes = _certified(planned["run"].run_store, direct)
    result, marker = _extract_with(planned, batch, faults="store_down=1")
    assert result["status"] == "done" and marker.write_path == "spool"
    assert marker.shard.key != direct.shard.key
    spooled = _certified(planned["run"].run_store, marker)
    # The shard's bytes are the same but for the batch-independent header; the tensors equal.
    from safetensors.torch import load

    a, b = load(direct_bytes), load(spooled)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not list(planned["spool"].glob(f"*{batch}*")), "the spool file is removed once stored"


def test_with_the_overflow_full_a_shard_the_store_refused_is_retried_from_host_memory(planned):
    """store_down=1 and no room in the spool (HSX_SPOOL_MAX_FRACTION below its use): the shard stays in its host
    buffer, is retried from there, and the marker says `memory`."""
    import shutil

    du = shutil.disk_usage(planned["spool"])
    if du.used == 0:
        pytest.skip("the spool's filesystem reports no use")
    result, marker = _extract_with(planned, planned["batches"][0], faults="store_down=1",
                                   spool_max_fraction=du.used / du.total / 2, store_retry_s=30)
    assert result["status"] == "done" and marker.write_path == "memory"
    _certified(planned["run"].run_store, marker)


def test_a_write_that_meets_a_full_disk_is_written_again_from_the_host_buffer_and_leaves_no_half_shard(planned):
    """store_full=1 (ENOSPC after the header): the write waits for room (here there is room at once) and is made
    again from the same host buffer: one certified shard, the forward run once, no temp file left in the run."""
    from workers import faults
    from workers.extract import extract_batch

    run_store, batch = planned["run"].run_store, planned["batches"][0]
    _redo(run_store, batch)
    faults.reset()
    with _faults_env("store_full=1"):
        result = extract_batch(planned["run"].run_url, batch, planned["settings"])
    marker = Marker.read(run_store, batch)
    assert result["status"] == "done" and marker is not None and marker.forwards == 1
    assert batch_shards(run_store, batch) == [marker.shard.key]
    assert not [p for p in run_store.local_path("shards").iterdir() if p.name.startswith(".hsx-tmp-")]
    _certified(run_store, marker)


def test_a_run_asking_for_the_last_layer_and_both_finals_stores_them_as_the_reference_forward_gives_them(
        tmp_path, tiny_cache):
    """Layer id N-1 (the last layer's raw output) and --final both: the stored slot N-1 and final_prenorm
    equal the last layer's output in the reference forward, final_postnorm equals HF hidden_states[N]
    (after the norm), and verify's recompute passes on the same shard. The two finals differ by O(1), so
    a reference reading id N-1 as hidden_states[N] (the post-norm state) would fail here."""
    from hsx.reference import reference_states
    from producer.planner import PlanOptions, plan_run
    from producer.verify import recompute_samples
    from workers.extract import extract_batch
    from workers.target import get_target

    settings = Settings(_env_file=None, cache_dir=tiny_cache, spool_dir=tmp_path / "spool", device="cpu",
                        store_url=str(tmp_path / "out"))
    num_layers = 8  # tiny-qwen3.5
    layer_ids = [2, num_layers - 1]
    run = plan_run(PlanOptions(dataset="sharegpt", model="tiny-qwen3.5", output=str(tmp_path / "out"), limit=4,
                               max_length=128, batch_tokens=1024, layers="2,7", final="both", store_dtype="float32"),
                   settings)
    assert list(run.config.layers.layer_ids) == layer_ids and run.config.layers.num_layers == num_layers
    batch = run.batches[0].batch
    assert extract_batch(run.run_url, batch, settings)["status"] == "done"

    stored = {s: v for s, v in read_samples(run.run_store).items() if v["batch"] == batch}
    assert stored, "the batch's samples must have been read back"
    model = get_target("tiny-qwen3.5", settings).model
    compared = assert_matches_reference(model, stored, layer_ids, atol=1e-4, rtol=1e-4, final="both")
    assert compared == sum(s["input_ids"].shape[0] for s in stored.values()) * 64 * (len(layer_ids) + 2)
    for sample, s in stored.items():
        assert torch.equal(s["hidden_states"][:, 1], s["final_prenorm"]), f"sample {sample}: slot N-1 != final_prenorm"
        ref = reference_states(model, s["input_ids"], [num_layers - 1], "postnorm")
        gap = (ref["hidden_states"][:, 0] - ref["final_postnorm"]).abs().max().item()
        assert gap > 0.1, f"sample {sample}: the last layer's output and the post-norm state differ by only {gap:.3g}"

    marker, plan = Marker.read(run.run_store, batch), read_batch(run.run_store, batch)
    assert marker.quarantined == []  # so the shard's rows are the plan's
    cu = plan.cu_seqlens_N1.tolist()
    picks = [(batch, marker, int(sample), cu[j], cu[j + 1]) for j, sample in enumerate(plan.sample_index_N.tolist())]
    summary, problems = recompute_samples(run.run_store, run.config, picks, settings)
    assert problems == [] and len(summary["samples"]) == len(picks), (summary, problems)
    assert summary["values_compared"] == compared, summary
