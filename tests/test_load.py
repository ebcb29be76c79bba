"""How a worker loads its target (issue 20, item 2): straight from the safetensors files to its
device, without a second copy of the weights in host memory.

The memory figure is measured the way ``bench/load.py`` measures it on the GPU, in a fresh process
on a checkpoint of a few hundred MB (random weights from the real Qwen3-8B config, one layer):
the peak of the process's private memory (``RssAnon``) above its level before the load. A loader
that reads the files into host memory (transformers' own ``disable_mmap=True`` path) is measured
beside it, so the test shows that the figure sees a second copy when there is one.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hsx.models import resolve_model_path
from settings import Settings

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import load as load_bench  # noqa: E402  (bench/load.py)


def test_the_loaded_parameters_are_on_the_workers_device_and_equal_the_files_tensors(tmp_path, tiny_cache):
    """``load_target`` through its device map: every tensor of the checkpoint is a parameter of the
    model, on the worker's device, in the compute dtype, with the file's values."""
    from workers.target import load_device_map, load_target

    ckpt = tmp_path / "ckpt"
    shutil.copytree(resolve_model_path("tiny-qwen3.5", tiny_cache), ckpt)
    target = load_target(str(ckpt), Settings(_env_file=None, cache_dir=tmp_path / "cache", device="cpu"))
    params = dict(target.model.named_parameters())
    weights = load_file(ckpt / "model.safetensors")
    assert set(weights) == set(params)
    for name, tensor in weights.items():
        assert params[name].device == target.device and params[name].dtype == torch.float32, name
        assert torch.equal(params[name], tensor.to(torch.float32)), name
    assert load_device_map(torch.device("cpu")) == {"": torch.device("cpu")}


@pytest.fixture(scope="module")
def checkpoint_840mb(tmp_path_factory) -> Path:
    """Random weights from the real Qwen3-8B config, one decoder layer and a 2,048-token
    vocabulary, fp32 (the CPU worker's compute dtype, so that no cast makes a copy): 839 MB."""
    dest = tmp_path_factory.mktemp("load") / "qwen3-8b-1-layer"
    load_bench.build(ROOT / "tests" / "data" / "configs" / "qwen3-8b.json", dest, layers=1, vocab=2048,
                     dtype="float32", device="cpu")
    return dest


def test_a_loading_worker_holds_no_second_copy_of_the_weights_in_host_memory(checkpoint_840mb, tmp_path):
    """The worker's load (hash from the cache, load, warm-up) adds less private memory than 30% of
    the checkpoint; a loader that reads the files into memory adds more than the whole checkpoint."""
    size = load_bench.checkpoint_bytes(checkpoint_840mb)
    assert size > 800e6
    cache = tmp_path / "cache"
    worker = load_bench.run_child(checkpoint_840mb, "worker", cache_dir=cache, device="cpu")
    read = load_bench.run_child(checkpoint_840mb, "read", cache_dir=cache, device="cpu")
    assert worker["params_on_device"] and worker["param_bytes"] >= size - 1e6
    assert worker["anon_peak_bytes"] < 0.3 * size, worker
    assert read["anon_peak_bytes"] > 1.0 * size, read  # the figure does see a full second copy
