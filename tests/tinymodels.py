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


#: The ``quantization_config`` of the Qwen fine-grained FP8 releases (Qwen3-8B-FP8's config.json).
FP8_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                           "weight_block_size": [128, 128]}
FP8_MAX = 448.0  # largest finite float8_e4m3fn
#: Linear layers that the Qwen FP8 releases keep in bf16 (Qwen3-Next-80B-A3B-*-FP8's
#: ``modules_to_not_convert``: the router, the shared expert's gate, the DeltaNet's ``in_proj_ba``, which
#: Qwen3.5 / 3.6 split into ``in_proj_a`` and ``in_proj_b``);
#: ``lm_head`` and the embeddings are never quantised.
FP8_KEEP = ("lm_head", "mlp.gate", "shared_expert_gate", "linear_attn.in_proj_ba", "linear_attn.in_proj_a",
            "linear_attn.in_proj_b")


def fp8_block_quantize(w_NK: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] as the Qwen FP8 releases store it: ``weight`` float8_e4m3fn [N, K] and
    ``weight_scale_inv`` bf16 [ceil(N/block), ceil(K/block)], with ``weight * scale`` per block
    the dequantised weight (scale = the block's abs max / 448, rounded to bf16 first so that the
    stored scale is the one used). A last partial block has its own scale.

    Raises:
        ValueError: a side longer than ``block`` and not a multiple of it: transformers'
            dequantiser derives the block size from the scale grid (``integrations/finegrained_fp8.py``
            l.1149-1154) and would read such a grid wrongly; the released models have none.
    """
    N, K = w_NK.shape
    for side in (N, K):
        if side > block and side % block:
            raise ValueError(f"weight of shape {tuple(w_NK.shape)}: side {side} is longer than the block {block} and "
                             "not a multiple of it; choose tiny sizes below 128 or multiples of 128")
    bn, bk = -(-N // block), -(-K // block)
    rn, rk = min(N, block), min(K, block)  # a side shorter than a block is one partial block
    w = w_NK.float().reshape(bn, rn, bk, rk)
    scale_nk = (w.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12).to(torch.bfloat16)
    q = (w / scale_nk.float()[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(N, K).contiguous(), scale_nk.contiguous()


def fp8_dequantize(q_NK: torch.Tensor, scale_nk: torch.Tensor, block: int = 128) -> torch.Tensor:
    """The fp32 weight [N, K] that ``q_NK`` and its block scales stand for (the inverse of :func:`fp8_block_quantize`)."""
    N, K = q_NK.shape
    rn, rk = min(N, block), min(K, block)
    full = q_NK.float().reshape(N // rn, rn, K // rk, rk) * scale_nk.float()[:, None, :, None]
    return full.reshape(N, K)


def _fp8_quantised(key: str, tensor: torch.Tensor) -> bool:
    """Whether the Qwen FP8 releases store checkpoint tensor ``key`` in float8: the 2-D weight of a
    linear layer inside a decoder layer (attention, DeltaNet, MLP, each expert), not :data:`FP8_KEEP`."""
    if not (key.startswith("model.layers.") and key.endswith(".weight") and tensor.ndim == 2):
        return False
    module = key[: -len(".weight")]
    if any(module.endswith(keep) for keep in FP8_KEEP):
        return False
    return "proj" in module.rsplit(".", 1)[-1] or module.rsplit(".", 1)[-1] in ("fc1", "fc2")


def _blockable(tensor: torch.Tensor, block: int) -> bool:
    """Each side at most one block or a whole number of blocks (:func:`fp8_block_quantize`)."""
    return all(side <= block or side % block == 0 for side in tensor.shape)


def quantize_checkpoint_fp8(src: Path, dest: Path, block: int = 128) -> dict:
    """Write at ``dest`` the fine-grained FP8 version of the safetensors checkpoint at ``src``, in
    the layout of the Qwen ``-FP8`` releases: each linear weight of a decoder layer float8_e4m3fn
    with its ``<module>.weight_scale_inv`` (bf16, one per ``block`` x ``block`` block:
    :func:`fp8_block_quantize`), everything else as it was (bf16), and ``quantization_config``
    (:data:`FP8_QUANTIZATION_CONFIG`, ``modules_to_not_convert`` listing the kept linear layers)
    in ``config.json``. One shard at a time (the bench builds large ones). Other files are copied.
    A linear weight with a side longer than a block and not a multiple of it (only tiny models
    have one: 192 = Qwen3-Next's tiny ``in_proj_qkvz``) is kept in bf16 and listed as not
    converted, since transformers' dequantiser would read its scale grid wrongly.

    Returns {"quantized": number of weights quantised, "kept": linear layers kept in bf16}.
    """
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dest = Path(src), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    quantized, kept = 0, set()
    index = {}
    for shard in sorted(src.glob("*.safetensors")):
        out = {}
        with safe_open(shard, framework="pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                if _fp8_quantised(key, t) and _blockable(t, block):
                    out[key], out[key[: -len("weight")] + "weight_scale_inv"] = fp8_block_quantize(t, block)
                    quantized += 1
                else:
                    out[key] = t
                    module = key.rsplit(".", 1)[0]
                    if t.ndim == 2 and (any(module.endswith(k) for k in FP8_KEEP) or _fp8_quantised(key, t)):
                        kept.add(module)  # a released skip, or a tiny side no block grid describes
        save_file(out, dest / shard.name, metadata={"format": "pt"})
        index.update({k: shard.name for k in out})
        del out
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copyfile(f, dest / f.name)
    if (src / "model.safetensors.index.json").exists():
        meta = json.loads((src / "model.safetensors.index.json").read_text())
        meta["weight_map"] = dict(sorted(index.items()))
        meta.setdefault("metadata", {})["total_size"] = sum((dest / n).stat().st_size for n in set(index.values()))
        (dest / "model.safetensors.index.json").write_text(json.dumps(meta, indent=2))
    config = json.loads((src / "config.json").read_text())
    qc = dict(FP8_QUANTIZATION_CONFIG, weight_block_size=[block, block])
    if kept:
        qc["modules_to_not_convert"] = sorted(kept)
    config["quantization_config"] = qc
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return {"quantized": quantized, "kept": sorted(kept)}


def tiny_fp8_checkpoint(name: str, dest: Path, num_layers: int = TINY_LAYERS) -> tuple[Path, Path]:
    """The tiny model of ``name`` saved twice under ``dest``: ``bf16/`` (its weights in bf16) and
    ``fp8/`` (:func:`quantize_checkpoint_fp8` of it). Returns (bf16 dir, fp8 dir)."""
    model = tiny_model(name, num_layers).to(torch.bfloat16)
    bf16, fp8 = Path(dest) / "bf16", Path(dest) / "fp8"
    model.save_pretrained(bf16, safe_serialization=True)
    quantize_checkpoint_fp8(bf16, fp8)
    return bf16, fp8
