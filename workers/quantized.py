"""Quantised targets: fine-grained FP8 checkpoints as released (Qwen3-*-FP8, Qwen3-Next-*-FP8).

Such a checkpoint's ``config.json`` has ``quantization_config`` (``quant_method: fp8``, ``fmt:
e4m3``, ``weight_block_size: [128, 128]``, maybe ``modules_to_not_convert``), and each quantised
linear layer stores ``weight`` as float8_e4m3fn [N, K] with ``weight_scale_inv`` [ceil(N/128),
ceil(K/128)] (bf16 in the Qwen releases): the real weight of block (i, j) is ``weight[block] *
weight_scale_inv[i, j]``. transformers loads it through its fine-grained FP8 integration
(transformers 5.24, read in ``.venv``):

- ``quantizers/quantizer_finegrained_fp8.py`` l.31-58 ``validate_environment``: it needs
  ``accelerate`` (l.32); with no CUDA (or XPU) device visible it sets ``dequantize=True`` for a
  pre-quantised checkpoint (l.38-44), and on a GPU of compute capability below 8.9 too (l.48-58);
- with ``dequantize``, ``integrations/finegrained_fp8.py`` l.952 leaves every ``nn.Linear`` as
  it is and ``Fp8Dequantize`` (l.1095-1200) multiplies each weight by its block scales while
  loading, into the parameter's dtype: the model is an ordinary one (fp32 on our CPU);
- without it, the linear layers become ``FP8Linear`` (l.388-446: the weight stays float8, the
  matmul quantises the activations per token-group and returns the input's dtype, bf16) and
  ``FP8Experts`` for MoE experts, whose kernels come from the ``kernels`` package
  (``kernels>=0.18.2,<0.19``): ``kernels-community/finegrained-fp8`` (version 4) fetched from the
  hub, or its local cache, at the first forward (l.87-138; ``integrations/hub_kernels.py`` l.802).

What a worker does (:func:`load_kwargs`, :func:`check_fp8_kernels`): on CUDA it loads the
checkpoint as released (its own ``quantization_config``; float8 weights on the GPU, half the bytes
of bf16) and the captured states are bf16, like an unquantised target's; the kernels are loaded at
the worker's load; where they cannot be (a missing ``kernels`` package, an unreachable kernel
repository) the worker runs transformers' FP8 layers with the plain-torch matmuls at the end of
this module, with a warning. On the CPU it asks for ``dequantize=True`` itself (transformers
only does so when no GPU is visible: a CPU worker on a GPU host would otherwise keep float8
weights that no CPU kernel multiplies) and runs the dequantised weights in fp32.
"""

from __future__ import annotations

import logging

import torch


log = logging.getLogger(__name__)

#: Compute capability from which transformers runs the FP8 matmuls instead of dequantising
#: (``quantizer_finegrained_fp8.py`` l.48-58).
FP8_MIN_CAPABILITY = (8, 9)


def is_fp8(info) -> bool:
    """True when ``info`` (:class:`hsx.models.ModelInfo`) is a fine-grained FP8 checkpoint."""
    return bool(info.quantization) and info.quantization.get("quant_method") == "fp8"


def fp8_mode(info, device: torch.device) -> str | None:
    """How the FP8 checkpoint ``info`` runs on ``device``; None when it is not one.

    ``fp8``: float8 weights, FP8 matmuls (CUDA, compute capability >= 8.9); ``dequantized-bf16``:
    transformers dequantises on an older GPU; ``dequantized-fp32``: our CPU path.
    """
    if not is_fp8(info):
        return None
    if device.type != "cuda":
        return "dequantized-fp32"
    return "fp8" if torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY else "dequantized-bf16"


def load_kwargs(info, device: torch.device, path: str) -> dict:
    """Extra ``from_pretrained`` arguments for the checkpoint ``info`` on ``device``: none, except
    ``quantization_config`` with ``dequantize=True`` for an FP8 checkpoint on the CPU (module
    docstring). The checkpoint's own skip list is passed with it: transformers overwrites the
    checkpoint's ``dequantize`` and ``modules_to_not_convert`` with the ones given
    (``quantizers/auto.py`` l.268-273, ``FineGrainedFP8Config.get_loading_attributes``).
    """
    if fp8_mode(info, device) != "dequantized-fp32":
        return {}
    from transformers import AutoConfig, FineGrainedFP8Config

    from hsx.models import hub_kwargs

    qc = getattr(AutoConfig.from_pretrained(path, **hub_kwargs(path)), "quantization_config", None) or {}
    if not isinstance(qc, dict):
        qc = qc.to_dict()
    log.info("target %s is an FP8 checkpoint (%s): on the CPU its weights are dequantised to fp32 while loading",
             info.name, info.quantization)
    # only these two of the config passed are used; the rest is the checkpoint's (quantizers/auto.py l.268-273)
    return {"quantization_config": FineGrainedFP8Config(modules_to_not_convert=qc.get("modules_to_not_convert"),
                                                        dequantize=True)}


def check_fp8_kernels(info, device: torch.device) -> str | None:
    """On CUDA with FP8 matmuls (:func:`fp8_mode` ``fp8``), load transformers' FP8 kernels now, so
    that a worker learns at its load, not at its first batch, how its FP8 layers will run.

    Returns:
        how the FP8 weights run, for the shard metadata: ``fp8`` (transformers' kernel),
        ``fp8-torch-dequant`` (its kernel could not be loaded: the ``kernels`` package is missing or
        ``kernels-community/finegrained-fp8`` cannot be fetched, so :func:`use_torch_fp8_kernel`
        installs the plain-torch matmuls of this module, with a warning naming the cause and the
        fix), what :func:`fp8_mode` says otherwise; None for a checkpoint that is not FP8.
    """
    mode = fp8_mode(info, device)
    if mode == "dequantized-bf16":
        major, minor = torch.cuda.get_device_capability(device)
        log.warning("target %s is an FP8 checkpoint, but this GPU's compute capability is %d.%d (< %d.%d): "
                    "transformers dequantises it to bf16 (twice the weights' bytes on the GPU)",
                    info.name, major, minor, *FP8_MIN_CAPABILITY)
    if mode != "fp8":
        return mode
    try:
        from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel

        load_finegrained_fp8_kernel()
        return mode
    except Exception as exc:  # ImportError from transformers; hub / OSError from kernels' download
        use_torch_fp8_kernel()
        log.warning(
            "target %s: its checkpoint is FP8 (%s), and transformers' FP8 matmul kernel cannot be loaded (%s: %s). "
            "transformers runs FP8 weights on CUDA with the `kernels` package (>=0.18.2,<0.19) and the hub kernel "
            "kernels-community/finegrained-fp8 (transformers/integrations/finegrained_fp8.py l.87-138). The weights "
            "stay float8 and each matmul dequantises them in plain torch (workers/quantized.py): correct, slower. "
            "Fix: `pip install 'kernels>=0.18.2,<0.19'` and fetch the kernel once where the hub is reachable (into "
            "HF_HOME, then HF_HUB_OFFLINE=1)", info.name, info.quantization, type(exc).__name__, str(exc)[:300])
        return "fp8-torch-dequant"


# --- FP8 matmuls in plain torch: when transformers' kernel cannot be fetched --------------------------
#
# transformers' FP8Linear and FP8Experts call three entry points of the hub kernel
# kernels-community/finegrained-fp8 (integrations/finegrained_fp8.py, ``FineGrainedFP8``: ``matmul``,
# ``batched_matmul``, ``grouped_matmul``; their call sites give the signatures below). A cluster that
# cannot reach the hub (or lacks the ``kernels`` package) gets these instead: each call dequantises
# the weights it multiplies (float8 x its block's scale, in the activations' dtype) and runs a bf16
# matmul. The weights stay float8 on the GPU (the memory of an FP8 release); a forward pays one
# dequantising pass over the weights it uses, and the activations are not quantised (the kernel
# quantises them per 128-column group: W8A8), so the states are, if anything, closer to the
# model's bf16 weights.

#: Most bytes of experts dequantised at once (more experts are taken in chunks), on the CPU and at
#: least on a GPU; a GPU allows up to 1/32 of its memory, at most :data:`DEQUANT_GPU_MAX_BYTES`
#: (:func:`_dequant_budget`).
DEQUANT_BUDGET_BYTES = 1 << 30
#: The GPU budget's ceiling: 4 GiB holds a Qwen3-Next-80B-A3B layer's fused ``gate_up_proj`` (512
#: experts x 1024 x 2048, 2 GiB in bf16) whole on an 80 GB GPU (2.5 GiB), so it takes no chunks:
#: the chunked path reads the experts' row offsets on the host (one sync per layer's call, which
#: stops the launching thread from running ahead of the GPU).
DEQUANT_GPU_MAX_BYTES = 4 << 30


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block_size, dtype: torch.dtype) -> torch.Tensor:
    """The real weight of a fine-grained FP8 weight: ``weight`` [..., N, K] float8 times its block's
    scale, ``scale_inv`` [..., ceil(N/bn), ceil(K/bk)] for ``block_size`` (bn, bk), or a per-tensor
    scale when ``block_size`` is None. Returns a new [..., N, K] tensor of ``dtype``."""
    out = weight.to(dtype)
    scale = scale_inv.to(dtype)
    if block_size is None:
        return out.mul_(scale)
    bn, bk = block_size
    n, k = out.shape[-2:]
    # fused weights (an MoE's gate_up from gate and up) keep each source's blocks: with sources of
    # fewer than bn rows the scales have more rows than ceil(N / bn), one per source block
    if scale.shape[-2] != -(-n // bn):
        bn = -(-n // scale.shape[-2])
    if scale.shape[-1] != -(-k // bk):
        bk = -(-k // scale.shape[-1])
    rows = scale.repeat_interleave(bn, dim=-2)[..., :n, :]  # [..., N, ceil(K/bk)]: rows expanded, columns broadcast
    full, rem = divmod(k, bk)
    out[..., :full * bk].unflatten(-1, (full, bk)).mul_(rows[..., :full, None])
    if rem:
        out[..., full * bk:].mul_(rows[..., full:])
    return out


def _grouped_mm(x_SK: torch.Tensor, w_EKN: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows ``ends[e-1]:ends[e]`` of ``x_SK`` times ``w_EKN[e]``; rows past ``ends[-1]`` are zero."""
    if x_SK.is_cuda and x_SK.dtype == torch.bfloat16:
        grouped = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
        if grouped is not None:
            out = grouped(x_SK, w_EKN, offs=ends.to(torch.int32))
            return out.masked_fill_(torch.arange(out.size(0), device=out.device)[:, None] >= ends[-1], 0)
    out = x_SK.new_zeros(x_SK.size(0), w_EKN.size(-1))
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            torch.mm(x_SK[start:end], w_EKN[e], out=out[start:end])
        start = end
    return out


def _dequant_budget(device: torch.device) -> int:
    """Bytes of dequantised experts one call may hold at once on ``device`` (:data:`DEQUANT_BUDGET_BYTES`)."""
    if device.type != "cuda":
        return DEQUANT_BUDGET_BYTES
    total = torch.cuda.get_device_properties(device).total_memory
    return max(DEQUANT_BUDGET_BYTES, min(DEQUANT_GPU_MAX_BYTES, total // 32))


def _expert_chunks(weight: torch.Tensor, dtype: torch.dtype) -> int:
    return max(1, _dequant_budget(weight.device) // max(1, weight[0].numel() * torch.empty((), dtype=dtype).element_size()))


def fp8_matmul(input, weight, weight_scale_inv, block_size=None, output_dtype=None, activation_scale=None):
    """``input`` [..., K] @ the dequantised ``weight`` [N, K] transposed: [..., N] in ``output_dtype``
    (the input's by default). ``activation_scale`` (static activation quantisation) is ignored: the
    activations are not quantised."""
    w = dequantize_fp8(weight, weight_scale_inv, block_size, input.dtype)
    return torch.nn.functional.linear(input, w).to(output_dtype or input.dtype)


def fp8_grouped_matmul(input, weight, weight_scale_inv, offsets=None, tokens_per_expert=None, block_size=None):
    """Rows of ``input`` [S, K] sorted by expert, ``offsets`` [E] their cumulative counts (int32):
    rows of expert e times its dequantised ``weight[e]`` [N, K] transposed; [S, N], rows past
    ``offsets[-1]`` zero."""
    chunk = _expert_chunks(weight, input.dtype)
    num_experts = weight.size(0)
    if chunk >= num_experts:
        w = dequantize_fp8(weight, weight_scale_inv, block_size, input.dtype)
        return _grouped_mm(input, w.transpose(-1, -2), offsets)
    out = input.new_zeros(input.size(0), weight.size(-2))
    ends = offsets.tolist()
    for a in range(0, num_experts, chunk):
        b = min(a + chunk, num_experts)
        lo, hi = (ends[a - 1] if a else 0), ends[b - 1]
        if hi > lo:
            w = dequantize_fp8(weight[a:b], weight_scale_inv[a:b], block_size, input.dtype)
            out[lo:hi] = _grouped_mm(input[lo:hi], w.transpose(-1, -2), offsets[a:b] - lo)
            del w
    return out


def fp8_batched_matmul(input, weight, weight_scale_inv, block_size=None, expert_ids=None):
    """Row i of ``input`` [S, K] times the dequantised ``weight[expert_ids[i]]`` [N, K] transposed:
    [S, N]; rows with an expert id past the last expert are zero (transformers' expert-parallel
    sentinel)."""
    num_experts = weight.size(0)
    order = torch.argsort(expert_ids, stable=True)
    # index_add_, not bincount: CUDA's bincount reads the largest id back to the host (a sync per layer)
    ids = expert_ids.clamp(max=num_experts).long()
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device).index_add_(
        0, ids, torch.ones_like(ids))[:num_experts]
    ends = torch.cumsum(counts, 0)
    out_sorted = fp8_grouped_matmul(input[order], weight, weight_scale_inv, offsets=ends, block_size=block_size)
    out = torch.empty_like(out_sorted)
    out[order] = out_sorted
    return out


def torch_fp8_kernel():
    """The torch entry points above as transformers' ``FineGrainedFP8`` record."""
    from transformers.integrations.finegrained_fp8 import FineGrainedFP8

    return FineGrainedFP8(matmul=fp8_matmul, batched_matmul=fp8_batched_matmul, grouped_matmul=fp8_grouped_matmul)


def use_torch_fp8_kernel() -> None:
    """Make transformers' FP8 layers call :func:`torch_fp8_kernel` (its loader keeps the kernel it
    loaded in the module global ``_FINEGRAINED_FP8`` and returns it from then on)."""
    import transformers.integrations.finegrained_fp8 as upstream

    upstream._FINEGRAINED_FP8 = torch_fp8_kernel()
