"""Tiny random target models built from the real configs, and per-sample reference forwards.

The configs are the real ``config.json`` files in ``tests/data/configs/`` (byte copies of the
upstream files that its SOURCE.md names). A tiny model keeps each architecture's code path (attention
kind, ``layer_types`` pattern, Gated DeltaNet, MoE routing, zero-centred norms, rope variant) and
shrinks the sizes: hidden 64, 6 layers, 4 heads, a 512-token vocab, 4 experts (2 per token) for the MoE models,
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
    "qwen3-moe": "qwen3-30b-a3b.json",  # MoE, every layer
    "gpt-oss": "gpt-oss-20b.json",  # sliding-window / full layers, attention sinks, clamped SwiGLU experts
    "deepseek-v3": "deepseek-v3.json",  # multi-head latent attention, dense first layers, grouped sigmoid routing
    "mixtral": "mixtral-8x7b.json",  # MoE, softmax top-2 routing
    "minimax-m2": "minimax-m2.5.json",  # MoE, partial rotary, per-layer q/k norms
    "glm-5": "glm-5.json",  # DeepSeek sparse attention (a top-k indexer) + latent attention + MoE
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


def tiny_config(name: str, num_layers: int = TINY_LAYERS, vocab_size: int = TINY_VOCAB):
    """The real config of ``name`` shrunk as the module docstring says, as a transformers config
    (``vocab_size``: :data:`TINY_VOCAB`, or the real tokenizer's for a checkpoint a run reads)."""
    from transformers import AutoConfig

    cfg = real_config(name)
    # a released checkpoint's quantisation (gpt-oss MXFP4, DeepSeek FP8) is not the tiny model's: random full-precision weights
    for key in ("torch_dtype", "dtype", "transformers_version", "architectures", "quantization_config", "auto_map"):
        cfg.pop(key, None)
    cfg.update(
        hidden_size=64, num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=vocab_size, initializer_range=0.1, tie_word_embeddings=False,
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
    # the MoE families: 4 experts, 2 per token, each a quarter of the dense MLP
    moe = {"num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
           "experts_per_token": 2, "moe_intermediate_size": 32}
    cfg.update({k: v for k, v in moe.items() if k in cfg})
    if model_type in ("qwen3_moe", "gpt_oss", "minimax_m2"):
        cfg["head_dim"] = 16
    if model_type == "gpt_oss":
        cfg["layer_types"] = cfg["layer_types"][:num_layers]  # sliding_window stays 128: rows up to 700 cross it
    if model_type == "minimax_m2":
        cfg["rotary_dim"] = 8  # half the head, as the real 64 of 128
    if model_type in ("deepseek_v3", "glm_moe_dsa"):
        # latent attention: as many KV heads as query heads (the released configs'); a dense first layer, then MoE
        cfg.update(num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                   v_head_dim=16, first_k_dense_replace=1, n_group=1, topk_group=1)
    if model_type == "glm_moe_dsa":
        # The indexer keeps each query's top-k keys by score; keys tied at the k-th score are kept by
        # torch.topk's order, which depends on the row's length (seen: scores tied at 0.0 after its ReLU),
        # so a padded row may keep other tied keys than the sample alone. A top-k above the longest row
        # keeps every key: the comparison then checks the rest of the path exactly.
        cfg.update(head_dim=8, qk_head_dim=16, index_head_dim=16, index_n_heads=2, index_topk=1024)
    return AutoConfig.for_model(model_type, **cfg)


def tiny_model(name: str, num_layers: int = TINY_LAYERS, vocab_size: int = TINY_VOCAB) -> torch.nn.Module:
    """A ``*ForCausalLM`` with random fp32 weights from :data:`SEED`, in eval mode on the CPU."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(tiny_config(name, num_layers, vocab_size), dtype=torch.float32)
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


def tiny_checkpoint(name: str, dest: Path, num_layers: int = TINY_LAYERS) -> Path:
    """The tiny model of ``name`` as a checkpoint directory a run reads with ``--model``: its weights
    (fp32 safetensors, the real Qwen3 vocabulary) and the real Qwen3 tokenizer and chat template
    (``hsx/assets/qwen3-tokenizer``), whatever the family's own tokenizer is. Returns ``dest``."""
    import shutil

    from hsx.models import TOKENIZER_DIR

    model = tiny_model(name, num_layers, vocab_size=QWEN3_VOCAB)
    model.save_pretrained(dest, safe_serialization=True)
    for f in TOKENIZER_DIR.iterdir():
        if f.is_file():
            shutil.copy(f, dest / f.name)
    return Path(dest)


#: Rows of the Qwen3 checkpoints' embedding (the tokenizer's 151,669 ids, padded as Qwen pads them).
QWEN3_VOCAB = 151936
