"""A target split across two processes by tensor parallelism (workers/parallel.py) captures the
same states as the whole model in one process.

Two CPU processes form a gloo group; each loads the same tiny checkpoint (built from a real
config, tests/tinymodels.py, saved to a temporary directory) with transformers'
``tp_plan="auto"``, so each holds half of every sharded weight. Rank 0 leads batches with
:func:`workers.parallel.lead_capture`; rank 1 follows them with :func:`workers.parallel.follow`.
Rank 0's states are compared with ``capture_batch`` on the unsplit model, for a dense model
(Qwen3) and a Gated DeltaNet hybrid (Qwen3.5), with a selection that runs the whole decoder and
one that stops after layer 2.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from tinymodels import random_batch, tiny_config, tiny_model

from hsx.errors import BadConfig
from hsx.layers import select_layers
from workers.capture import capture_batch, right_padded_rows

WORLD = 2
LENGTHS = [3, 17, 64, 129]
#: (layer ids, final): the whole decoder and its norm; a cut that stops the forward after layer 2
SELECTIONS = [([1, 3], "both"), ([2], "none")]
#: fp32; rank 0's states differ from one process's only by the order of the row-wise all-reduce's
#: sums: an element may differ by RTOL of itself plus SCALE_TOL of the tensor's largest magnitude.
#: Measured max |diff|: ~3e-6 in the layers' states (magnitude ~4); 3.0e-5 in Qwen3.5's post-norm
#: state (28 of 13632 elements above 1e-5), whose norm scales the summation error up.
RTOL, SCALE_TOL = 1e-5, 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, path: str, out: str) -> None:
    import os

    import torch.distributed as dist

    from workers.parallel import follow, lead_capture, load_tensor_parallel, stop_followers

    torch.set_num_threads(1)  # two processes on a shared CPU
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = load_tensor_parallel(path, dtype=torch.float32)
        gate = model.model.layers[0].mlp.gate_proj.weight
        result = {"local_gate_shape": tuple(gate.to_local().shape), "full_gate_shape": tuple(gate.shape)}
        if rank == 0:
            _, ids_T, cu_N1 = random_batch(LENGTHS)
            result["captured"] = []
            for layer_ids, final in SELECTIONS:
                selection = select_layers(len(model.model.layers), layer_ids=layer_ids, final=final)
                rows = right_padded_rows(ids_T, cu_N1)
                result["captured"].append(lead_capture(model, rows, selection, store_dtype=torch.float32).wait().states)
            stop_followers()
        else:
            result["followed"] = follow(model)
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["qwen3", "qwen3.5"])
def test_two_rank_tensor_parallel_capture_equals_one_process(name, tmp_path):
    model = tiny_model(name)
    model.save_pretrained(tmp_path / "model")
    out = str(tmp_path / "result")
    mp.spawn(_rank_main, args=(WORLD, _free_port(), str(tmp_path / "model"), out), nprocs=WORLD)
    lead, follower = torch.load(f"{out}.0"), torch.load(f"{out}.1")

    # The weights really are split: each rank holds half of the MLP's gate projection.
    full = tuple(model.model.layers[0].mlp.gate_proj.weight.shape)
    assert lead["full_gate_shape"] == full
    assert lead["local_gate_shape"] == follower["local_gate_shape"] == (full[0] // WORLD, full[1])
    assert follower["followed"] == len(SELECTIONS)

    _, ids_T, cu_N1 = random_batch(LENGTHS)
    for (layer_ids, final), states in zip(SELECTIONS, lead["captured"]):
        selection = select_layers(len(model.model.layers), layer_ids=layer_ids, final=final)
        expected = capture_batch(model, ids_T, cu_N1, selection, store_dtype=torch.float32).states
        assert sorted(states) == sorted(expected)
        for key in expected:
            assert states[key].shape == expected[key].shape
            atol = SCALE_TOL * float(expected[key].abs().max())
            torch.testing.assert_close(states[key], expected[key], rtol=RTOL, atol=atol, msg=lambda m: f"{name} {key}: {m}")


def test_a_group_size_that_splits_a_kv_head_is_refused():
    from workers.parallel import check_group_size

    config = tiny_config("qwen3")  # 2 KV heads
    check_group_size(config, 2)
    with pytest.raises(BadConfig, match=r"num_key_value_heads=2 is not divisible by the group size 4.*HSX_GPUS_PER_WORKER=2"):
        check_group_size(config, 4)


def test_a_follower_keeps_nothing():
    model = tiny_model("qwen3")
    _, ids_T, cu_N1 = random_batch([5, 9])
    selection = select_layers(len(model.model.layers), layer_ids=[1, 3], final="both")
    from workers.capture import launch_capture

    captured = launch_capture(model, right_padded_rows(ids_T, cu_N1), selection, store_dtype=torch.float32,
                              keep_states=False).wait()
    assert captured.states == {} and captured.nonfinite == {}


# --- the launcher's groups (workers/launcher.py) ---------------------------------------------

def _slots(per_worker: int, visible: str, count: int | None = None):
    from settings import load_settings
    from workers.launcher import plan_slots

    settings = load_settings(gpus_per_worker=per_worker, device="cuda", workers_per_node=None)
    slots, _gpus = plan_slots(settings, {"CUDA_VISIBLE_DEVICES": visible}, count, "INFO")
    return [(s.name, s.env["CUDA_VISIBLE_DEVICES"], s.env["HSX_GPUS_PER_WORKER"]) for s in slots]


def test_eight_gpus_in_groups_of_two_make_four_workers_of_consecutive_gpus():
    assert _slots(2, "0,1,2,3,4,5,6,7") == [
        ("gpu0x2", "0,1", "2"), ("gpu2x2", "2,3", "2"), ("gpu4x2", "4,5", "2"), ("gpu6x2", "6,7", "2")]
    assert _slots(4, "3,2,1,0") == [("gpu3x4", "3,2,1,0", "4")]  # CUDA_VISIBLE_DEVICES's order is kept


def test_one_gpu_per_worker_is_todays_layout():
    assert _slots(1, "0,1") == [("gpu0", "0", "1"), ("gpu1", "1", "1")]


def test_a_group_size_that_does_not_divide_the_gpus_is_refused_with_the_sizes_that_do():
    with pytest.raises(BadConfig, match=r"HSX_GPUS_PER_WORKER=4 does not divide the 6 visible GPUs \(0,1,2,3,4,5\).*"
                                         r"fix: HSX_GPUS_PER_WORKER=1 or 2 or 3 or 6"):
        _slots(4, "0,1,2,3,4,5")


def test_a_group_without_gpus_is_refused_unless_the_cpu_is_asked_for():
    """No GPU visible and no HSX_DEVICE: K > 1 is a misconfigured GPU node, refused; HSX_DEVICE=cpu
    set explicitly asks for CPU workers of K gloo ranks each (workers/group.py)."""
    from settings import load_settings
    from workers.launcher import plan_slots

    with pytest.raises(BadConfig, match=r"HSX_GPUS_PER_WORKER=2: .* none is visible .*fix: HSX_GPUS_PER_WORKER=1, or set "
                                         r"HSX_DEVICE=cpu explicitly for a group of 2 gloo ranks"):
        plan_slots(load_settings(gpus_per_worker=2, device=None), {"CUDA_VISIBLE_DEVICES": ""}, None, "INFO")
    slots, gpus = plan_slots(load_settings(gpus_per_worker=2, device="cpu"), {}, None, "INFO")
    assert gpus == [] and [(s.name, s.env["HSX_GPUS_PER_WORKER"]) for s in slots] == [("cpu0x2", "2")]


def test_python_m_workers_refuses_a_group_size_its_model_cannot_split_before_the_broker(monkeypatch, tiny_cache):
    """tiny-qwen3.5 has 2 KV heads: 4 ranks would split one, refused before anything starts (the
    broker here does not answer: its check would fail with another message)."""
    from settings import get_settings
    from workers.launcher import main

    monkeypatch.setenv("HSX_BROKER_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("HSX_MODEL", "tiny-qwen3.5")
    monkeypatch.setenv("HSX_DEVICE", "cpu")
    monkeypatch.setenv("HSX_CACHE_DIR", str(tiny_cache))
    # main() sets os.environ's HSX_GPUS_PER_WORKER for its children: set here first, so that monkeypatch's undo
    # removes it (a delenv after main() would restore main's "4" at teardown, for every later test of this process)
    monkeypatch.setenv("HSX_GPUS_PER_WORKER", "1")
    get_settings.cache_clear()
    try:
        with pytest.raises(BadConfig, match=r"HSX_GPUS_PER_WORKER=4 \(--gpus-per-worker\) refused for model 'tiny-qwen3.5': "
                                             r".*num_key_value_heads=2 is not divisible by the group size 4.*"
                                             r"fix: --gpus-per-worker 2 \(HSX_GPUS_PER_WORKER=2.*Nothing was started"):
            main(["--gpus-per-worker", "4"])
    finally:
        get_settings.cache_clear()
