"""Checkpoints in the layout of the Qwen fine-grained FP8 releases, from a bf16 checkpoint.

Used by ``bench/load.py --build --fp8`` (the H200 rows) and by the tests' tiny FP8 targets
(``tests/tinymodels.py``). The layout is the released one (Qwen3-8B-FP8, Qwen3-Next-80B-A3B-*-FP8):
float8_e4m3fn linear weights of the decoder layers with bf16 128x128 ``weight_scale_inv``, and
``quantization_config`` in ``config.json``, which transformers reads as its ``FineGrainedFP8Config``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


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


def too_big_to_save(model, device) -> bool:
    """Whether ``model``'s weights (on any device, the meta device included) take more than 40% of
    the CUDA ``device``'s memory: ``save_pretrained`` of it then runs out of GPU memory (it unfuses
    MoE experts with copies) and of host memory (the 16-layer Qwen3-Next shape, 54 GB, on an 80 GB
    H100 was SIGKILLed, 2026-12-06), so it is written one tensor at a time
    (:func:`write_random_fp8_checkpoint` with ``fp8=False``). False off CUDA."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return False
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return weight_bytes > 0.4 * torch.cuda.get_device_properties(device).total_memory


def write_random_fp8_checkpoint(model, dest: Path, *, device: str = "cpu", block: int = 128, seed: int = 0,
                                shard_bytes: int = 5_000_000_000, fp8: bool = True) -> dict:
    """Write at ``dest`` a checkpoint of ``model``'s shapes in the layout :func:`quantize_checkpoint_fp8`
    gives, with random weights (normal, std 0.02) made and quantised one tensor at a time on ``device``:
    no full-precision copy of the model exists anywhere, so a shape larger than one GPU (or the disk,
    in bf16) can be written. ``model`` may be on the meta device (only its shapes are read). The
    tensor names and shapes are the saved ones (``transformers.core_model_loading.revert_weight_conversion``,
    what ``save_pretrained`` writes: per-expert weights, not the fused parameters). With ``fp8``
    False the same checkpoint in the model's own dtype (bf16), no ``quantization_config``: a bf16
    target written with at most one shard in host memory (``save_pretrained`` of a model on an 80 GB
    GPU unfuses its MoE experts with copies, runs out of GPU memory, and from host memory a 54 GB
    model beside its 54 GB of files on tmpfs is more than a 128 GB host holds: SIGKILL, H100, 2026-12-06).

    Returns {"quantized": weights quantised, "kept": linear layers kept in bf16, "shards": files}.
    """
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    saved = revert_weight_conversion(model, dict(model.state_dict()))
    tied = set(getattr(model, "all_tied_weights_keys", None) or {}) if getattr(model.config, "tie_word_embeddings", False) else set()
    names = [k for k in saved if k not in tied]

    def quantised(name, t) -> bool:
        return fp8 and _fp8_quantised(name, t) and _blockable(t, block)

    def out_bytes(name):
        t = saved[name]
        return t.numel() * (1 if quantised(name, t) else t.element_size())

    shards, current, size = [], [], 0
    for name in names:
        if current and size + out_bytes(name) > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += out_bytes(name)
    shards.append(current)
    gen = torch.Generator(device=device).manual_seed(seed)
    quantized, kept, index, total = 0, set(), {}, 0
    for i, shard in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        out = {}
        for name in shard:
            meta = saved[name]
            if meta.is_floating_point():
                t = torch.empty(meta.shape, dtype=meta.dtype, device=device).normal_(0.0, 0.02, generator=gen)
            else:
                t = torch.zeros(meta.shape, dtype=meta.dtype, device=device)
            if quantised(name, t):
                q, s = fp8_block_quantize(t, block)
                out[name], out[name[: -len("weight")] + "weight_scale_inv"] = q.cpu(), s.cpu()
                quantized += 1
            else:
                out[name] = t.cpu()
                module = name.rsplit(".", 1)[0]
                if fp8 and t.ndim == 2 and (any(module.endswith(k) for k in FP8_KEEP) or _fp8_quantised(name, t)):
                    kept.add(module)
            del t
        save_file(out, dest / file, metadata={"format": "pt"})
        total += (dest / file).stat().st_size
        index.update({k: file for k in out})
        del out
    if len(shards) > 1:
        (dest / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(index.items()))}, indent=2))
    model.config.save_pretrained(dest)
    if not fp8:
        return {"quantized": 0, "kept": [], "shards": len(shards)}
    config = json.loads((dest / "config.json").read_text())
    qc = dict(FP8_QUANTIZATION_CONFIG, weight_block_size=[block, block])
    if kept:
        qc["modules_to_not_convert"] = sorted(kept)
    config["quantization_config"] = qc
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return {"quantized": quantized, "kept": sorted(kept), "shards": len(shards)}
