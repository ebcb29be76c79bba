"""Fine-grained FP8 checkpoints as released (issue 20 item 5; workers/quantized.py).

A tiny FP8 checkpoint is written in the Qwen ``-FP8`` layout (float8_e4m3fn weights, bf16
``weight_scale_inv`` per 128x128 block, ``quantization_config`` in config.json:
``tests/tinymodels.py`` ``quantize_checkpoint_fp8``). transformers dequantises such a checkpoint
on the CPU (``quantizer_finegrained_fp8.py`` l.38-44), so on the CPU it runs: its states are the
ones of the model whose weights are the dequantised values. Its quantisation is part of the
model's identity: an FP8 and a bf16 checkpoint of one model never share a run id, and the run ids
of unquantised models are what they were.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from jobfixtures import assert_matches_reference, clean_env, cli_json, read_samples, run_cli
from tinymodels import FP8_QUANTIZATION_CONFIG, fp8_block_quantize, fp8_dequantize, quantize_checkpoint_fp8, tiny_fp8_checkpoint

from hsx.models import ModelInfo, model_info, resolve_model_path
from hsx.runconfig import LayersConfig, ModelConfig, RunConfig, TokenizerConfig, load_run
from hsx.store import open_store

JOB = ["sharegpt", "--limit", "8", "--max-length", "256", "--batch-tokens", "1024", "--store-dtype", "float32"]


def _config(model: dict) -> RunConfig:
    """A run config of ``model`` (run.json's ``model`` object); the rest fixed."""
    layers = LayersConfig(layer_ids=(1,), final="none", num_layers=2, convention="output of decoder layer i",
                          hf_hidden_states_indices=(2,), vllm_ids=(2,))
    tokenizer = TokenizerConfig(tokenizer_class="Qwen2Tokenizer", vocab_size=151669, chat_template_sha256="0" * 64,
                                end_of_turn_ids=[151645])
    return RunConfig(model=ModelConfig.model_validate(model), model_name=model["name"], layers=layers, max_length=256,
                     batch_tokens=1024, max_batch_samples=64, store_dtype="float32", tokenizer=tokenizer,
                     dataset_fingerprint="x" * 64, dataset_source="chats.jsonl", limit=None)


@pytest.fixture(scope="module")
def fp8_qwen35(tmp_path_factory, tiny_cache) -> Path:
    """tiny-qwen3.5 (its real vocabulary and tokenizer) quantised to fine-grained FP8."""
    dest = tmp_path_factory.mktemp("fp8") / "tiny-qwen3.5-fp8"
    quantize_checkpoint_fp8(Path(resolve_model_path("tiny-qwen3.5", tiny_cache)), dest)
    return dest


def test_block_quantisation_keeps_each_block_within_fp8_precision():
    w = torch.randn(256, 384) * torch.linspace(0.01, 3, 384)  # blocks of very different magnitudes
    q, scale = fp8_block_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (256, 384)
    assert scale.dtype == torch.bfloat16 and scale.shape == (2, 3)
    back = fp8_dequantize(q, scale)
    # e4m3 has 3 mantissa bits: each value within 2^-4 of itself, relative to its block's max
    block_max = w.abs().reshape(2, 128, 3, 128).amax(dim=(1, 3)).repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert ((back - w).abs() <= block_max * 2 ** -4 + 1e-6).all()
    with pytest.raises(ValueError, match="not a multiple"):
        fp8_block_quantize(torch.randn(200, 64))


def test_the_builder_writes_the_layout_of_the_qwen_fp8_releases(fp8_qwen35):
    config = json.loads((fp8_qwen35 / "config.json").read_text())
    qc = config["quantization_config"]
    assert {k: qc[k] for k in FP8_QUANTIZATION_CONFIG} == FP8_QUANTIZATION_CONFIG
    assert "model.layers.0.linear_attn.in_proj_a" in qc["modules_to_not_convert"]  # as Qwen3.5/3.6-FP8 keep it
    with safe_open(fp8_qwen35 / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        q = f.get_tensor("model.layers.3.self_attn.q_proj.weight")
        s = f.get_tensor("model.layers.3.self_attn.q_proj.weight_scale_inv")
        assert f.get_tensor("model.layers.0.linear_attn.in_proj_a.weight").dtype != torch.float8_e4m3fn
        assert f.get_tensor("model.embed_tokens.weight").dtype != torch.float8_e4m3fn
        assert f.get_tensor("model.layers.0.linear_attn.in_proj_qkv.weight").dtype == torch.float8_e4m3fn
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.bfloat16
    assert s.shape == (-(-q.shape[0] // 128), -(-q.shape[1] // 128))
    assert "lm_head.weight_scale_inv" not in keys and "model.layers.0.mlp.down_proj.weight_scale_inv" in keys
    # transformers recognises it as its fine-grained FP8 format
    from transformers import AutoConfig
    from transformers.quantizers.auto import AutoQuantizationConfig
    from transformers.utils.quantization_config import FineGrainedFP8Config

    parsed = AutoQuantizationConfig.from_dict(AutoConfig.from_pretrained(fp8_qwen35).quantization_config)
    assert isinstance(parsed, FineGrainedFP8Config) and list(parsed.weight_block_size) == [128, 128]


def test_the_quantisation_is_part_of_the_identity_and_unquantised_run_ids_are_unchanged(tmp_path, tiny_cache):
    bf16, fp8 = tiny_fp8_checkpoint("qwen3", tmp_path, num_layers=2)
    plain, quantised = model_info(str(bf16), tiny_cache), model_info(str(fp8), tiny_cache)
    assert plain.quantization is None
    assert {k: quantised.quantization[k] for k in FP8_QUANTIZATION_CONFIG} == FP8_QUANTIZATION_CONFIG
    assert quantised.as_dict()["quantization"] == quantised.quantization
    # an unquantised model's record is what it was before the field existed: the same keys, the same run id
    # (files_revision: a local checkpoint directory's other files, hsx.models.files_revision)
    assert set(plain.as_dict()) == {"name", "model_type", "num_layers", "hidden_size", "revision", "files_revision"}
    before = ModelInfo(**{k: getattr(plain, k) for k in ("name", "path", "model_type", "num_layers", "hidden_size",
                                                         "revision", "files_revision")})
    assert _config(plain.as_dict()).default_run_id("chats") == _config(before.as_dict()).default_run_id("chats")
    # same model, same recorded name and revision: the quantisation alone tells the two runs apart
    same_bytes = dict(quantised.as_dict(), name=plain.name, revision=plain.revision)
    assert _config(same_bytes).default_run_id("chats") != _config(plain.as_dict()).default_run_id("chats")
    assert any("quantization" in d for d in plain.differences(ModelConfig.of(quantised)))


def test_the_cpu_worker_dequantises_an_fp8_checkpoint_and_runs_it(tmp_path, tiny_cache):
    """Loaded the way a worker loads it (workers.target.load_target): every weight is the block
    dequantisation of the file's float8 values, the model is fp32, and the engine says how."""
    from settings import Settings
    from workers.target import load_target

    bf16, fp8 = tiny_fp8_checkpoint("qwen3-next", tmp_path, num_layers=4)  # MoE experts, DeltaNet, attention
    target = load_target(str(fp8), Settings(_env_file=None, cache_dir=tiny_cache, device="cpu", max_batch_samples=4))
    assert target.engine["weights"] == "dequantized-fp32"
    assert {p.dtype for p in target.model.parameters()} == {torch.float32}
    with safe_open(fp8 / "model.safetensors", framework="pt") as f:
        for key in ("model.layers.3.self_attn.q_proj.weight", "model.layers.0.linear_attn.out_proj.weight",
                    "model.layers.1.mlp.shared_expert.down_proj.weight"):
            want = fp8_dequantize(f.get_tensor(key), f.get_tensor(key + "_scale_inv"))
            assert torch.equal(target.model.get_parameter(key), want), key
        # the experts are fused by transformers' loader (gate and up of each expert in one tensor)
        gate_up = target.model.get_parameter("model.layers.2.mlp.experts.gate_up_proj")
        e = "model.layers.2.mlp.experts.1."
        want = torch.cat([fp8_dequantize(f.get_tensor(e + p + ".weight"), f.get_tensor(e + p + ".weight_scale_inv"))
                          for p in ("gate_proj", "up_proj")])
        assert torch.equal(gate_up[1], want)


def test_producer_run_extracts_an_fp8_checkpoint_on_the_cpu(tmp_path, tiny_cache, fp8_qwen35, tiny_qwen35):
    """The whole process stack (producer run, embedded broker, Celery worker) on the FP8 checkpoint:
    run.json records its quantisation, and the states are the per-sample forward of the model whose
    weights are the dequantised ones (not of the fp32 original: the quantisation is applied)."""
    env = clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state", spool_dir=tmp_path / "spool", device="cpu")
    report = cli_json(run_cli("producer", ["run", *JOB, "--model", str(fp8_qwen35), "--output", str(tmp_path / "out"),
                                           "--json"], env, timeout_s=600))
    assert report["batches_done"] == report["batches_total"] >= 1
    run_store = open_store(report["address"])
    recorded = load_run(run_store).model
    assert recorded.quantization["quant_method"] == "fp8" and recorded.quantization["weight_block_size"] == [128, 128]
    samples = read_samples(run_store)
    assert '"weights": "dequantized-fp32"' in next(iter(samples.values()))["meta"]["engine"]

    reference = _dequantised_copy(tiny_qwen35, fp8_qwen35)
    assert assert_matches_reference(reference, samples, [1, 3, 4], atol=1e-4, rtol=1e-4) > 10_000
    with pytest.raises(AssertionError, match="max \\|diff\\|"):
        assert_matches_reference(tiny_qwen35, samples, [1, 3, 4], atol=1e-4, rtol=1e-4)


def _dequantised_copy(model: torch.nn.Module, fp8_dir: Path) -> torch.nn.Module:
    """``model`` with each weight that ``fp8_dir`` quantised replaced by its dequantised value
    (computed here from the file, not by transformers)."""
    import copy

    out = copy.deepcopy(model)
    replaced = 0
    with safe_open(fp8_dir / "model.safetensors", framework="pt") as f, torch.no_grad():
        for key in f.keys():
            if key.endswith(".weight_scale_inv"):
                weight = key[: -len("_scale_inv")]
                out.get_parameter(weight).copy_(fp8_dequantize(f.get_tensor(weight), f.get_tensor(key)))
                replaced += 1
    assert replaced > 10
    return out.eval()


# --- FP8 matmuls in plain torch (workers/quantized.py), for a GPU whose transformers kernel cannot be fetched ---


@pytest.fixture(scope="module")
def fp8_next(tmp_path_factory):
    """The tiny Qwen3-Next (Gated DeltaNet + MoE) as an FP8 checkpoint; its float8 model (transformers'
    FP8Linear and FP8Experts, built on the CPU as on a GPU) and its dequantised fp32 model (the CPU
    worker's form)."""
    from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config
    from transformers.quantizers import quantizer_finegrained_fp8 as fp8_quantizer

    _, fp8 = tiny_fp8_checkpoint("qwen3-next", tmp_path_factory.mktemp("fp8-next"))
    block = AutoConfig.from_pretrained(fp8).quantization_config["weight_block_size"]
    dequantized = AutoModelForCausalLM.from_pretrained(
        fp8, dtype=torch.float32, quantization_config=FineGrainedFP8Config(dequantize=True, weight_block_size=block))
    # transformers dequantises whenever no GPU is visible; skipping its environment check builds the float8 layers
    check = fp8_quantizer.FineGrainedFP8HfQuantizer.validate_environment
    fp8_quantizer.FineGrainedFP8HfQuantizer.validate_environment = lambda self, *a, **k: None
    try:
        float8 = AutoModelForCausalLM.from_pretrained(fp8, dtype=torch.float32, device_map={"": "cpu"})
    finally:
        fp8_quantizer.FineGrainedFP8HfQuantizer.validate_environment = check
    kinds = {type(m).__name__ for m in float8.modules()}
    assert {"FP8Linear", "FP8Experts"} <= kinds and float8.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    return float8.eval(), dequantized.eval()


@pytest.mark.parametrize("experts", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("budget", [1 << 30, 1])
def test_the_torch_fp8_matmuls_give_the_dequantised_models_states_through_transformers_fp8_layers(
        fp8_next, experts, budget, monkeypatch):
    """Every hidden state of the float8 model, run through transformers' own FP8Linear and
    FP8Experts (both expert paths) with the plain-torch matmuls, equals the dequantised model's;
    ``budget`` 1 byte takes the experts one at a time."""
    from workers import quantized

    float8, dequantized = fp8_next
    monkeypatch.setattr(quantized, "DEQUANT_BUDGET_BYTES", budget)
    import transformers.integrations.finegrained_fp8 as upstream

    monkeypatch.setattr(upstream, "_FINEGRAINED_FP8", None)
    quantized.use_torch_fp8_kernel()
    float8.set_experts_implementation(experts)
    ids = torch.randint(0, 100, (3, 41), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = dequantized(ids, output_hidden_states=True).hidden_states
        got = float8(ids, output_hidden_states=True).hidden_states
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (i, float((a - b).abs().max()))


def test_a_gpu_worker_without_transformers_fp8_kernel_runs_the_torch_matmuls_and_says_so(monkeypatch, caplog):
    """Where ``kernels-community/finegrained-fp8`` cannot be loaded (no ``kernels`` package, no hub),
    the worker's check installs the plain-torch matmuls, warns with the cause and the fix, and names
    the mode for the shards' metadata. (No GPU here: the GPU's answer is given.)"""
    import transformers.integrations.finegrained_fp8 as upstream

    from workers import quantized

    def unreachable():
        raise ImportError("finegrained-fp8 kernel unavailable: the hub cannot be reached")

    monkeypatch.setattr(quantized, "fp8_mode", lambda info, device: "fp8")
    monkeypatch.setattr(upstream, "load_finegrained_fp8_kernel", unreachable)
    monkeypatch.setattr(upstream, "_FINEGRAINED_FP8", None)
    info = ModelInfo.__new__(ModelInfo)
    object.__setattr__(info, "name", "Qwen/Qwen3-Next-80B-A3B-Instruct-FP8")
    object.__setattr__(info, "quantization", {"quant_method": "fp8", "weight_block_size": [128, 128]})
    with caplog.at_level("WARNING"):
        assert quantized.check_fp8_kernels(info, torch.device("cuda", 0)) == "fp8-torch-dequant"
    assert upstream._FINEGRAINED_FP8.matmul is quantized.fp8_matmul
    assert "the hub cannot be reached" in caplog.text and "pip install 'kernels" in caplog.text


def _layout(path) -> dict:
    """{tensor name: (shape, dtype)} over a checkpoint's safetensors files."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as fh:
            out.update({k: (tuple(fh.get_slice(k).get_shape()), fh.get_slice(k).get_dtype()) for k in fh.keys()})
    return out


def test_the_streaming_fp8_builder_writes_the_released_layout_without_a_full_precision_model(tmp_path):
    """``bench/load.py --build --fp8`` (``write_random_fp8_checkpoint``) from a model on the meta
    device: the same tensor names, shapes and dtypes, and the same ``quantization_config``, as a bf16
    checkpoint quantised by ``quantize_checkpoint_fp8``; in several shards; it loads with no key
    missing or unexpected."""
    from transformers import AutoModelForCausalLM

    from bench.fp8_checkpoint import write_random_fp8_checkpoint
    from tinymodels import tiny_config

    _, released = tiny_fp8_checkpoint("qwen3-next", tmp_path / "released")
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(tiny_config("qwen3-next"), dtype=torch.bfloat16)
    done = write_random_fp8_checkpoint(meta, tmp_path / "streamed", shard_bytes=300_000)
    assert done["shards"] > 1 and done["quantized"] > 0

    assert _layout(tmp_path / "streamed") == _layout(released)
    qc = [json.loads((p / "config.json").read_text())["quantization_config"] for p in (released, tmp_path / "streamed")]
    assert qc[0] == qc[1]
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "streamed", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_the_streaming_builder_without_fp8_writes_the_bf16_checkpoint_save_pretrained_writes(tmp_path):
    """The same builder with ``fp8=False`` (the bench's bf16 targets too large to save from the GPU):
    the tensor names, shapes and dtypes of ``save_pretrained``'s checkpoint of the same model, no
    ``quantization_config``, and it loads with no key missing or unexpected."""
    from transformers import AutoModelForCausalLM

    from bench.fp8_checkpoint import write_random_fp8_checkpoint
    from tinymodels import tiny_config

    config = tiny_config("qwen3-next")
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(tmp_path / "saved")
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    done = write_random_fp8_checkpoint(meta, tmp_path / "streamed", shard_bytes=300_000, fp8=False)
    assert done["shards"] > 1 and done["quantized"] == 0

    assert _layout(tmp_path / "streamed") == _layout(tmp_path / "saved")
    assert "quantization_config" not in json.loads((tmp_path / "streamed" / "config.json").read_text())
    _, info = AutoModelForCausalLM.from_pretrained(tmp_path / "streamed", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
