"""How a worker loads its target (issue 20, item 2): straight from the safetensors files to its
device, without a second copy of the weights in host memory.

The memory figure is measured the way ``bench/load.py`` measures it on the GPU, in a process of its own
on a checkpoint of a few hundred MB (random weights from the real Qwen3-8B config, one layer):
the peak of the process's private memory (``RssAnon``) above its level before the load. A loader
that reads the files into host memory (transformers' own ``disable_mmap=True`` path) is measured
beside it, so the test shows that the figure sees a second copy when there is one.
"""

from __future__ import annotations

import json
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


def run_child(checkpoint: Path, loader: str, **kw) -> dict:
    """``load_bench.run_child``: one load in a process of its own (``bench/load.py child``), forked from
    the tests' fork server (``jobfixtures.run_python``: the same separate process, less the imports of
    torch and transformers; what it measures is taken from its own start, after them)."""
    from jobfixtures import clean_env, run_python

    proc = run_python(load_bench.child_command(checkpoint, loader, **kw)[1:], clean_env(), timeout_s=900)
    assert proc.returncode == 0, f"{loader} load of {checkpoint} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


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
    worker = run_child(checkpoint_840mb, "worker", cache_dir=cache, device="cpu")
    read = run_child(checkpoint_840mb, "read", cache_dir=cache, device="cpu")
    assert worker["params_on_device"] and worker["param_bytes"] >= size - 1e6
    assert worker["anon_peak_bytes"] < 0.3 * size, worker
    assert read["anon_peak_bytes"] > 1.0 * size, read  # the figure does see a full second copy


def test_the_switch_bench_loads_a_second_target_after_the_first_with_the_files_values(tmp_path, tiny_cache):
    """``bench/load.py --loader switch`` on the CPU (its GPU memory fields only come on CUDA): a worker
    serves one target, then another (a directory of hard links to the same files), and the model it
    holds at the end is the second, with every checked parameter equal to the files' tensors."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(resolve_model_path("tiny-qwen3.5", tiny_cache), ckpt)
    record = run_child(ckpt, "switch", cache_dir=tmp_path / "cache", device="cpu", check_every=1)
    assert record["first_load_s"] > 0 and record["load_s"] > 0 and record["allocator_warm_up"] is False
    assert record["held"] == str(tmp_path / "ckpt.switch")
    assert (tmp_path / "ckpt.switch" / "model.safetensors").stat().st_ino == (ckpt / "model.safetensors").stat().st_ino
    assert record["file_check"]["checked"] > 10 and record["file_check"]["mismatched"] == []
    assert record["params_on_device"]


def test_a_worker_switching_targets_has_let_go_of_the_first_model_before_it_loads_the_second(tmp_path, tiny_cache, monkeypatch):
    """One model per worker process: when a task asks for another target, nothing of the first is
    still referenced while the second loads (on a GPU the two together need twice the memory; a
    27B switch ran out of memory on an H100 while a list of the released targets was still held)."""
    import gc
    import weakref

    from workers import target as worker_target

    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    for d in (first_dir, second_dir):
        shutil.copytree(resolve_model_path("tiny-qwen3.5", tiny_cache), d)
    settings = Settings(_env_file=None, cache_dir=tmp_path / "cache", device="cpu")
    first = worker_target.get_target(str(first_dir), settings)
    first_model, first_param = weakref.ref(first.model), weakref.ref(next(first.model.parameters()))
    del first
    load = worker_target.load_target
    alive_at_load: list[bool] = []

    def observed_load(name, settings):
        gc.collect()
        alive_at_load.append(first_model() is not None or first_param() is not None)
        return load(name, settings)

    monkeypatch.setattr(worker_target, "load_target", observed_load)
    second = worker_target.get_target(str(second_dir), settings)
    assert alive_at_load == [False]
    assert [t.name for t in worker_target.loaded_targets()] == [str(second_dir)] and second.name == str(second_dir)


# --- the streamed loader (workers/loading.py): what the GPU worker runs, checked here on the CPU ---

sys.path.insert(0, str(ROOT / "tests"))
from tinymodels import MODELS, tiny_fp8_checkpoint, tiny_model  # noqa: E402


def _state(model) -> dict:
    return {k: v for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", list(MODELS))
def test_the_streamed_loader_gives_the_model_transformers_loads_from_a_sharded_checkpoint(name, tmp_path):
    """Dense, Gated DeltaNet and MoE shapes (the MoE experts fused by transformers' own converters),
    saved in several shards: every parameter and buffer equals ``from_pretrained``'s."""
    from transformers import AutoModelForCausalLM

    from workers.loading import checkpoint_files, load_streamed

    tiny_model(name).save_pretrained(tmp_path, max_shard_size="200KB")
    assert len(checkpoint_files(tmp_path)) > 3
    want = _state(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32))
    got = _state(load_streamed(str(tmp_path), device=torch.device("cpu"), dtype=torch.float32,
                               device_map={"": torch.device("cpu")}))
    assert got.keys() == want.keys()
    assert [k for k in want if not torch.equal(want[k], got[k])] == []


def test_transformers_loop_copies_a_converter_once_per_target_not_once_per_expert_tensor(tmp_path):
    """transformers deep-copies an MoE converter for every expert tensor and keeps one copy per fused
    parameter (``workers.loading.converters_reused``): the loader hands a dropped copy out again, so
    the copies made are one per fused target, and the model is the one made with a copy per tensor."""
    import copy

    import transformers.core_model_loading as cml

    from workers import loading

    tiny_model("qwen3-next").save_pretrained(tmp_path, max_shard_size="200KB")
    cpu = torch.device("cpu")
    plain = _state(loading.load_streamed(str(tmp_path), device=cpu, dtype=torch.float32, device_map={"": cpu},
                                         reuse_converters=False))
    assert loading.last_load["converter_copies"] is None
    reused = _state(loading.load_streamed(str(tmp_path), device=cpu, dtype=torch.float32, device_map={"": cpu}))
    counts = loading.last_load["converter_copies"]
    expert_tensors = [k for f in loading.checkpoint_files(tmp_path) for k in load_file(f) if ".experts." in k]
    fused = [k for k in reused if ".experts." in k]  # gate_up_proj and down_proj of each MoE layer
    assert counts["copies"] + counts["reused"] == len(expert_tensors)
    # one copy per fused parameter, plus one per converter (gate_up, down) dropped in the first layer
    assert len(fused) <= counts["copies"] <= len(fused) + 2
    assert reused.keys() == plain.keys() and [k for k in plain if not torch.equal(plain[k], reused[k])] == []
    assert cml.deepcopy is copy.deepcopy  # put back


def test_a_transformers_whose_loading_loop_differs_keeps_its_own_converter_copies(tmp_path, monkeypatch):
    import copy

    import transformers.core_model_loading as cml

    from workers import loading

    monkeypatch.setattr(loading, "_CONVERTER_COPY_LINES", loading._CONVERTER_COPY_LINES + ("a line it lacks",))
    tiny_model("qwen3-next").save_pretrained(tmp_path)
    seen = []
    monkeypatch.setattr(cml, "deepcopy", lambda obj, memo=None: seen.append(obj) or copy.deepcopy(obj, memo))
    cpu = torch.device("cpu")
    loading.load_streamed(str(tmp_path), device=cpu, dtype=torch.float32, device_map={"": cpu})
    assert loading.last_load["converter_copies"] is None
    expert_tensors = [k for f in loading.checkpoint_files(tmp_path) for k in load_file(f) if ".experts." in k]
    assert len(seen) == len(expert_tensors)  # one per expert tensor, as transformers does it


def test_the_streamed_loader_skips_transformers_one_segment_warm_up_unless_asked(tmp_path, monkeypatch):
    """transformers' ``caching_allocator_warmup`` reserves the whole model as one CUDA segment, which a
    small live tensor can keep after the model is released (``load_streamed``'s docstring): the
    worker's load leaves it out, the option puts it back, and transformers' function is restored after."""
    import transformers.modeling_utils as modeling_utils

    from workers.loading import load_streamed

    calls = []
    recorder = lambda *args, **kwargs: calls.append(args)  # noqa: E731
    monkeypatch.setattr(modeling_utils, "caching_allocator_warmup", recorder)
    tiny_model("qwen3").save_pretrained(tmp_path)
    cpu = torch.device("cpu")
    load_streamed(str(tmp_path), device=cpu, dtype=torch.float32, device_map={"": cpu})
    assert calls == [] and modeling_utils.caching_allocator_warmup is recorder
    load_streamed(str(tmp_path), device=cpu, dtype=torch.float32, device_map={"": cpu}, allocator_warm_up=True)
    assert len(calls) == 1 and modeling_utils.caching_allocator_warmup is recorder


def test_the_streamed_loader_reads_a_multimodal_qwen3_5_checkpoint_as_its_text_model(tmp_path):
    """A Qwen3.5 / 3.6 release is saved as ``Qwen3_5ForConditionalGeneration`` (its weights under
    ``model.language_model.``); the worker runs the text model, as ``AutoModelForCausalLM`` picks it."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3_5ForConditionalGeneration

    from workers.loading import load_streamed

    full = json.loads((ROOT / "tests" / "data" / "configs" / "qwen3.5-27b.json").read_text())
    text = tiny_model("qwen3.5").config.to_dict()
    full["text_config"] = {k: v for k, v in text.items() if k not in ("architectures", "transformers_version")}
    full["vision_config"].update(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
    full.pop("transformers_version", None)
    torch.manual_seed(0)
    Qwen3_5ForConditionalGeneration(AutoConfig.for_model(**full)).save_pretrained(tmp_path)
    want = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    got = load_streamed(str(tmp_path), device=torch.device("cpu"), dtype=torch.float32,
                        device_map={"": torch.device("cpu")})
    assert type(got) is type(want)
    a, b = _state(want), _state(got)
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []


def test_the_streamed_loader_dequantises_an_fp8_checkpoint_as_transformers_does(tmp_path):
    """A fine-grained FP8 checkpoint (float8 weights, block scales) with ``dequantize=True``, the CPU
    worker's form: the same fp32 weights as transformers' own loader makes."""
    from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config

    from workers.loading import load_streamed

    _, fp8 = tiny_fp8_checkpoint("qwen3-next", tmp_path)
    block = AutoConfig.from_pretrained(fp8).quantization_config["weight_block_size"]

    def qc():
        return FineGrainedFP8Config(dequantize=True, weight_block_size=block)

    a = _state(AutoModelForCausalLM.from_pretrained(fp8, dtype=torch.float32, quantization_config=qc()))
    b = _state(load_streamed(str(fp8), device=torch.device("cpu"), dtype=torch.float32,
                             device_map={"": torch.device("cpu")}, quantization_config=qc()))
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []


def test_a_truncated_checkpoint_file_is_refused_naming_the_file_and_the_tensor(tmp_path):
    from hsx.errors import BadConfig
    from workers.loading import StreamedCheckpoint, checkpoint_files

    tiny_model("qwen3").save_pretrained(tmp_path)
    (f,) = checkpoint_files(tmp_path)
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 10)
    with pytest.raises(BadConfig, match=r"model\.safetensors: tensor .* past the file's"):
        StreamedCheckpoint([f], torch.device("cpu"))


def test_the_worker_streams_only_local_safetensors_on_cuda(tmp_path):
    """The CPU keeps transformers' loader (a checkpoint in fp32 stays mapped from its file); remote
    code and a directory without safetensors go to transformers too."""
    from workers.loading import can_stream

    tiny_model("qwen3").save_pretrained(tmp_path / "ckpt")
    cuda = torch.device("cuda", 0)
    assert can_stream(str(tmp_path / "ckpt"), cuda, trust_remote_code=False)
    assert not can_stream(str(tmp_path / "ckpt"), torch.device("cpu"), trust_remote_code=False)
    assert not can_stream(str(tmp_path / "ckpt"), cuda, trust_remote_code=True)
    (tmp_path / "empty").mkdir()
    assert not can_stream(str(tmp_path / "empty"), cuda, trust_remote_code=False)


@pytest.mark.parametrize("read_ahead", ["none", "racing the askers", "done before they ask"])
def test_small_neighbouring_tensors_are_read_together_and_each_comes_back_once_in_any_order(tmp_path, read_ahead):
    """Odd sizes (a 1-byte dtype before a 2-byte one, so offsets not a multiple of the dtype's size),
    small tensors grouped in spans, a large one alone; 8 threads asking in a shuffled order, some
    names twice: every tensor equals safetensors' own read, in its own storage. With a read-ahead
    of the bf16, fp8 and fp32 tensors (``prefetch``, as ``load_streamed`` starts it before the
    model's code is imported) the same, whether the askers race it or come after it."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    from safetensors.torch import save_file

    from workers import loading

    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(40):
        tensors[f"a.{i}.u8"] = torch.randint(0, 255, (7 + i,), dtype=torch.uint8, generator=gen)
        tensors[f"a.{i}.bf16"] = torch.randn(3, 5 + i, generator=gen).to(torch.bfloat16)
        tensors[f"a.{i}.f8"] = torch.randn(11, generator=gen).to(torch.float8_e4m3fn)
    tensors["big"] = torch.randn(loading.SMALL_BYTES // 4 + 3, generator=gen)  # fp32, over SMALL_BYTES
    save_file(tensors, tmp_path / "model.safetensors")
    want = load_file(tmp_path / "model.safetensors")
    with loading.StreamedCheckpoint([tmp_path / "model.safetensors"], torch.device("cpu")) as ckpt:
        spans = {id(t.span) for t in ckpt.tensors.values() if t.span is not None}
        assert spans and ckpt.tensors["big"].span is None
        kept = {"BF16", "F8_E4M3", "F32"}
        if read_ahead != "none":
            ckpt.prefetch(3, kept)
        if read_ahead == "done before they ask":
            for thread in ckpt._prefetchers:
                thread.join()
            assert ckpt.prefetched_bytes == sum(t.nbytes for t in ckpt.tensors.values() if t.dtype in kept)
        names = list(want) + ["a.3.bf16", "a.17.f8"]
        random.Random(1).shuffle(names)
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda n: (n, ckpt.tensors[n][...]), names))
    for name, tensor in got:
        assert tensor.dtype == want[name].dtype and torch.equal(tensor.view(torch.uint8), want[name].view(torch.uint8)), name
    sizes = {name: t.untyped_storage().nbytes() for name, t in got}
    assert all(sizes[n] == want[n].numel() * want[n].element_size() for n in sizes), "each in its own storage"
    assert ckpt.prefetched_bytes <= sum(t.nbytes for t in ckpt.tensors.values() if t.dtype in kept)
    if read_ahead == "none":
        assert ckpt.prefetched_bytes == 0


def test_tensors_read_ahead_and_never_asked_for_are_freed_when_the_checkpoint_closes(tmp_path):
    """A read-ahead reads a release's extra weights (``mtp.*``) that the model never asks for:
    closing the checkpoint stops its threads and lets those tensors go."""
    from safetensors.torch import save_file

    from workers import loading

    save_file({"model.w": torch.ones(10), "mtp.w": torch.full((loading.SMALL_BYTES,), 2.0)}, tmp_path / "model.safetensors")
    with loading.StreamedCheckpoint([tmp_path / "model.safetensors"], torch.device("cpu")) as ckpt:
        ckpt.prefetch(2, {"F32"})
        assert torch.equal(ckpt.tensors["model.w"][...], torch.ones(10))
        for thread in ckpt._prefetchers:
            thread.join()
        assert list(ckpt._prefetched) == ["mtp.w"]
    assert ckpt._prefetched == {} and ckpt._prefetchers == []


def test_tensors_a_span_read_and_nobody_asked_for_are_freed_when_the_checkpoint_closes(tmp_path):
    """A checkpoint may hold tensors the model has no parameter for (a release's ``mtp.*`` weights):
    read with their span's neighbours, never asked for; closing the checkpoint lets them go."""
    from safetensors.torch import save_file

    from workers import loading

    save_file({f"t{i}": torch.full((1000,), float(i)) for i in range(4)}, tmp_path / "model.safetensors")
    with loading.StreamedCheckpoint([tmp_path / "model.safetensors"], torch.device("cpu")) as ckpt:
        span = ckpt.tensors["t0"].span
        assert span is not None and len(span.members) == 4
        assert torch.equal(ckpt.tensors["t0"][...], torch.zeros(1000))
        assert sorted(span.ready) == ["t1", "t2", "t3"]
    assert not span.ready


def test_the_read_ahead_lets_go_of_what_the_model_will_not_ask_for_and_never_leaves_an_asker_waiting(tmp_path):
    """Stopped when ``from_pretrained`` starts, the read-ahead drops the tensors whose names match the
    model's ignore patterns (a release's ``mtp.*`` layer: GBs of GPU memory held through the load for
    nothing), and they are read again if asked after all. A read-ahead thread whose read fails in any
    way (even a BaseException) hands the tensor back to its asker, who reads it."""
    from safetensors.torch import save_file

    from workers import loading

    tensors = {"model.a": torch.full((loading.SMALL_BYTES,), 1.0), "mtp.b": torch.full((loading.SMALL_BYTES,), 2.0),
               "model.c": torch.full((loading.SMALL_BYTES,), 3.0)}
    save_file(tensors, tmp_path / "model.safetensors")
    with loading.StreamedCheckpoint([tmp_path / "model.safetensors"], torch.device("cpu")) as ckpt:
        ckpt.prefetch(1, {"F32"})
        for thread in ckpt._prefetchers:
            thread.join()
        ckpt.stop_prefetch([r"^mtp\."])
        assert sorted(ckpt._prefetched) == ["model.a", "model.c"]
        assert ckpt.prefetched_bytes == 2 * tensors["model.a"].numel() * 4
        assert torch.equal(ckpt.tensors["mtp.b"][...], tensors["mtp.b"])  # asked after all: read again

    failed = []
    with loading.StreamedCheckpoint([tmp_path / "model.safetensors"], torch.device("cpu")) as ckpt:
        read = ckpt._read

        def failing_once(t):
            if t.name == "model.a" and not failed:
                failed.append(t.name)
                raise SystemExit("a read-ahead thread dies")
            return read(t)

        ckpt._read = failing_once
        ckpt.prefetch(1, {"F32"})
        assert torch.equal(ckpt.tensors["model.a"][...], tensors["model.a"])  # no hang: read by its asker
        assert torch.equal(ckpt.tensors["model.c"][...], tensors["model.c"])
    assert failed == ["model.a"]


def test_the_read_ahead_takes_only_tensors_kept_as_stored(tmp_path):
    """bf16 of a bf16 load; FP8 weights too only where they stay FP8 (CUDA, compute capability 8.9+,
    not dequantised); nothing for any other quantisation, or one made while loading."""
    import json

    from transformers import FineGrainedFP8Config

    from workers.loading import _kept_dtypes

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    cpu = torch.device("cpu")
    assert _kept_dtypes(str(tmp_path), torch.bfloat16, cpu, {}) == {"BF16"}
    assert _kept_dtypes(str(tmp_path), torch.bfloat16, cpu, {"quantization_config": object()}) == set()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128]}}))
    assert _kept_dtypes(str(tmp_path), torch.bfloat16, cpu, {}) == set()  # the CPU dequantises it
    dequantised = {"quantization_config": FineGrainedFP8Config(dequantize=True)}
    assert _kept_dtypes(str(tmp_path), torch.bfloat16, cpu, dequantised) == set()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "quantization_config": {
        "quant_method": "awq"}}))
    assert _kept_dtypes(str(tmp_path), torch.bfloat16, cpu, {}) == set()


def test_a_hub_id_streams_from_its_snapshot_in_the_hub_cache_at_the_commit_the_worker_read(tmp_path, monkeypatch):
    """The streamed loader reads files: a hub id becomes its snapshot directory in the hub cache (the
    commit given, not what ``main`` points at now), read without asking the hub when it is offline."""
    from workers.loading import checkpoint_files, local_dir

    old, new = "a" * 40, "b" * 40
    repo = tmp_path / "hub" / "models--org--tiny"
    for commit in (old, new):
        tiny_model("qwen3").save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(new)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    from hsx.models import hub_local_only

    hub_local_only.cache_clear()
    assert Path(local_dir("org/tiny", old)) == repo / "snapshots" / old
    assert Path(local_dir("org/tiny")) == repo / "snapshots" / new
    assert checkpoint_files(local_dir("org/tiny", old)) == [repo / "snapshots" / old / "model.safetensors"]
    hub_local_only.cache_clear()
