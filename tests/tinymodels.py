"""Tiny random target models built from the real configs, and per-sample reference forwards.

The configs are the real ``config.json`` files in ``tests/data/configs/`` (byte copies of the
upstream files that its SOURCE.md names). A tiny model keeps each architecture's code path (attention
kind, ``layer_types`` pattern, Gated DeltaNet, MoE routing, zero-centred norms, rope variant) and
shrinks the sizes: hidden 64, 6 layers, 4 heads, a 512-token vocab, 4 experts for Qwen3-Next,
``initializer_range=0.1`` so that contamination between samples shows, fp32, fixed seed
(docs/FACTS.md §2). Weights are random: the states are synthetic.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "data" / "configs"  # real HF config.json files (their upstream: its SOURCE.md)

#: short name -> config file in CONFIGS
MODELS = {
    "llama-3.1": "llama-3.1-8b.json",
    "qwen3": "qwen3-8b.json",
    "qwen3.5": "qwen3.5-27b.json",  # hybrid Gated DeltaNet + gated attention
    "qwen3-next": "qwen3-next-80b-a3b-thinking.json",  # Gated DeltaNet + gated attention + MoE
}
TINY_LAYERS = 6
TINY_VOCAB = 512
SEED = 1234


def real_config(name: str) -> dict:
    """The real model's text config as a dict (``text_config`` for multimodal checkpoints)."""
    path = CONFIGS / MODELS[name]
    assert path.exists(), f"{path} is missing: the tests read the real configs from tests/data/configs (see its SOURCE.md)"
    full = json.loads(path.read_text())
    return dict(full.get("text_config", full))


def tiny_config(name: str, num_layers: int = TINY_LAYERS):
    """The real config of ``name`` shrunk as the module docstring says, as a transformers config."""
    from transformers import AutoConfig

    cfg = real_config(name)
    for key in ("torch_dtype", "dtype", "transformers_version", "architectures"):
        cfg.pop(key, None)
    cfg.update(
        hidden_size=64, num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=TINY_VOCAB, initializer_range=0.1, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    model_type = cfg.pop("model_type")
    if model_type in ("llama", "qwen3"):
        cfg["head_dim"] = 16
    if model_type in ("qwen3_5_text", "qwen3_next"):
        cfg.update(head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)
        if "layer_types" in cfg:  # Qwen3.5 lists them; Qwen3-Next derives them from full_attention_interval
            cfg["layer_types"] = cfg["layer_types"][:num_layers]
    if model_type == "qwen3_5_text":
        # mrope sections must sum to rotary_dim / 2 = head_dim * partial_rotary_factor / 2 = 4
        cfg["rope_parameters"] = dict(cfg["rope_parameters"], mrope_section=[2, 1, 1])
    if model_type == "qwen3_next":
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    return AutoConfig.for_model(model_type, **cfg)


def tiny_model(name: str, num_layers: int = TINY_LAYERS) -> torch.nn.Module:
    """A ``*ForCausalLM`` with random fp32 weights from :data:`SEED`, in eval mode on the CPU."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(tiny_config(name, num_layers), dtype=torch.float32)
    model.requires_grad_(False)
    return model.eval()


def random_batch(lengths: list[int], *, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Random samples of the given lengths: (per-sample ids [S_j], ids_T concatenated, cu_seqlens_N1)."""
    gen = torch.Generator().manual_seed(seed)
    samples = [torch.randint(1, TINY_VOCAB, (n,), generator=gen) for n in lengths]
    cu_seqlens_N1 = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu_seqlens_N1[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return samples, torch.cat(samples), cu_seqlens_N1


@torch.inference_mode()
def reference_forward(model: torch.nn.Module, ids_S: torch.Tensor) -> dict:
    """One sample alone (no padding, no mask): the CausalLM forward with ``output_hidden_states``.

    Returns ``hidden_states`` (HF tuple: [0] embeddings, [i + 1] output of layer i for i < N-1,
    [-1] post-norm), ``last_layer_SH`` (the raw output of layer N-1, from a hook: HF overwrites
    ``hidden_states[-1]`` with the post-norm state) and ``logits_SV``.
    """
    raw = {}
    last = model.model.layers[-1]
    handle = last.register_forward_hook(lambda _m, _a, out: raw.__setitem__("out", out[0] if isinstance(out, tuple) else out))
    try:
        out = model(input_ids=ids_S[None], use_cache=False, output_hidden_states=True)
    finally:
        handle.remove()
    return {
        "hidden_states": [h[0] for h in out.hidden_states],
        "last_layer_SH": raw["out"][0],
        "logits_SV": out.logits[0],
    }


from bench.fp8_checkpoint import (  # noqa: E402,F401  (the tests' names for them)
    FP8_KEEP,
    FP8_MAX,
    FP8_QUANTIZATION_CONFIG,
    fp8_block_quantize,
    fp8_dequantize,
    quantize_checkpoint_fp8,
)


def tiny_fp8_checkpoint(name: str, dest: Path, num_layers: int = TINY_LAYERS) -> tuple[Path, Path]:
    """The tiny model of ``name`` saved twice under ``dest``: ``bf16/`` (its weights in bf16) and
    ``fp8/`` (:func:`quantize_checkpoint_fp8` of it). Returns (bf16 dir, fp8 dir)."""
    model = tiny_model(name, num_layers).to(torch.bfloat16)
    bf16, fp8 = Path(dest) / "bf16", Path(dest) / "fp8"
    model.save_pretrained(bf16, safe_serialization=True)
    quantize_checkpoint_fp8(bf16, fp8)
    return bf16, fp8
