"""fp8 storage of hidden states (``--store-dtype fp8``): float8 e4m3 with one float32 scale per
token and captured part.

Legend: T = tokens, K = captured layers, H = hidden size; ``...`` = any leading dims ([T] or [T, K]).

Convention (per-token absmax scaling). For each row ``x`` [H] (one token of one captured part:
layer slot k of ``hidden_states`` [T, K, H], or one token of a ``final_*`` [T, H])::

    scale = amax(|x|) / 448            float32; 448 = the largest finite e4m3fn value
    scale = 1          where amax == 0 (a zero row: no division by zero, it stores zeros)
    q     = (x / scale).to(torch.float8_e4m3fn)          |x / scale| <= 448 by construction
    x    ~= q.float() * scale                             (dequantisation)

This is the activation recipe of DeepSeek-V3's FP8 inference kernels (``act_quant`` in
``deepseek-ai/DeepSeek-V3`` ``inference/kernel.py``: ``s = max(|x|) / 448``, ``y = x / s`` cast to
``float8_e4m3fn``, ``s`` float32), with the block being the whole H-row of one token instead of
1x128 channels; a scale per token (row) is vLLM's dynamic per-token fp8 activation quantisation
(``scaled_fp8_quant(x, use_per_token_if_dynamic=True)``). Transformer Engine's fp8 recipes map
amax to 448 the same way, per tensor or per 1x128 block. Per token rather than per tensor, so that
one token's outlier (a BOS "massive activation" can be 1000x the rest) costs precision in that
token only; whole rows rather than 128-channel blocks, so the scales cost 4 bytes per token and
part: bytes per token and part are ``H + 4`` instead of bf16's ``2 H`` (0.5004x at H = 5120).

Error bound. e4m3 keeps 3 mantissa bits: a normal value ``v`` (``|v| >= 2**-6``) rounds to within
``2**-4 |v|`` (half a unit in the last place), and a subnormal one to within ``2**-10`` (half the
subnormal spacing ``2**-9``). Scaled back, every element satisfies (:func:`error_bound`)::

    |dequantize(q, scale) - x|  <=  2**-4 |x|  +  2**-10 scale          (dequantised in float32)

and, because the largest binade in use is [256, 448] with spacing 32, the per-token max-abs error
is at most 16 scale: ``max|dq - x| / max|x| <= 16 / 448 = 1/28`` (3.6 %) for every token
(:data:`TOKEN_MAX_REL_ERR`). The global relative Frobenius error ``||dq - x|| / ||x||`` is below
``2**-4`` plus the subnormal term (measured on ShareGPT activations: ``BENCHMARKS.md``).
Dequantising to bf16 adds bf16's own rounding, up to ``2**-8 |dq|`` (8 significant bits).

Not representable: e4m3fn has no Inf. NaN/Inf must be detected on the unquantised values (the
capture path computes its NaN/Inf flags before it quantises, ``workers/capture.py``): a row with
an Inf gets ``scale = inf`` and stores NaN / 0, and, depending on the torch version, an Inf or an
overflowing value cast to e4m3fn either saturates to 448 or becomes NaN.
"""

from __future__ import annotations

import torch

from hsx.shard import SCALE_SUFFIX, StoreDtype, scale_name  # noqa: F401  (scale_name: used by the readers)

#: the stored dtype of fp8 shards (safetensors ``F8_E4M3``).
FP8_DTYPE = torch.float8_e4m3fn
#: the dtype of the scales (safetensors ``F32``).
SCALE_DTYPE = torch.float32
#: bytes of one scale (per token and part).
SCALE_BYTES = 4
#: the largest finite float8_e4m3fn value.
E4M3_MAX = 448.0
#: relative rounding error of a normal e4m3 value (half ulp: 3 mantissa bits).
E4M3_REL_ERR = 2.0**-4
#: absolute rounding error of a subnormal e4m3 value, in scaled units (half of the spacing 2**-9).
E4M3_SUBNORMAL_ERR = 2.0**-10
#: bound of ``max|dq - x| / max|x|`` per token and part (half the spacing 32 of [256, 448], over 448).
TOKEN_MAX_REL_ERR = 16.0 / E4M3_MAX


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` [..., H] (any float dtype, any device) row by row over its last dim.

    Returns ``(q, scale)``: ``q`` float8_e4m3fn [..., H] and ``scale`` float32 [...], on ``x``'s
    device, with ``x ~= q.float() * scale[..., None]`` within :func:`error_bound`. ``scale`` is
    ``amax(|x|) / 448`` per row, 1 for a row of zeros (so it stores exact zeros). The division runs
    in float32. Rows holding NaN or Inf give NaN or garbage: check finiteness before (the module
    docstring says why).
    """
    amax = x.abs().amax(dim=-1).to(SCALE_DTYPE)
    scale = amax / E4M3_MAX
    # amax == 0 (or so small that amax / 448 underflows to 0): scale 1, the row stores (near-)zeros.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scaled = torch.div(x, scale.unsqueeze(-1))  # a new float32 tensor (x itself is never written)
    # |scaled| <= 448 up to float32 rounding; clamp so that no cast can overflow to NaN.
    q = scaled.clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_states(states: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fp8 step after capture: each captured state quantised as :func:`quantize_fp8` does.

    ``states`` maps ``hidden_states`` [T, K, H] and ``final_*`` [T, H] (any float dtype, one
    device) to their values. Returns, in the same order, each ``name`` as float8_e4m3fn of the same
    shape followed by ``<name>_scale`` float32 [T, K] or [T], on the same device. ``hidden_states``
    is quantised one layer slot at a time, so the float32 intermediate is [T, H], never [T, K, H].
    Take NaN/Inf flags before calling (the module docstring says why).
    """
    out: dict[str, torch.Tensor] = {}
    for name, x in states.items():
        if x.dim() == 3:
            q_TKH = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
            scale_TK = torch.empty(x.shape[:2], dtype=SCALE_DTYPE, device=x.device)
            for k in range(x.shape[1]):
                q_TKH[:, k], scale_TK[:, k] = quantize_fp8(x[:, k])
            out[name], out[scale_name(name)] = q_TKH, scale_TK
        else:
            out[name], out[scale_name(name)] = quantize_fp8(x)
    return out


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``q.float() * scale[..., None]`` cast to ``dtype`` (default bf16): [..., H] from ``q``
    float8_e4m3fn [..., H] and ``scale`` float32 [...]. The product is taken in float32; a bf16
    result adds bf16's rounding (up to ``2**-8`` relative) to :func:`error_bound`."""
    if q.shape[:-1] != scale.shape:
        raise ValueError(f"fp8 tensor of shape {tuple(q.shape)} needs a scale of shape {tuple(q.shape[:-1])}, "
                         f"got {tuple(scale.shape)}")
    out = q.to(torch.float32) * scale.to(torch.float32).unsqueeze(-1)
    return out if dtype == torch.float32 else out.to(dtype)


def error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Elementwise bound of ``|dequantize_fp8(*quantize_fp8(x), torch.float32) - x|``, float32 [..., H]:
    ``2**-4 |x| + 2**-10 scale`` (``scale`` [...] as returned by :func:`quantize_fp8`)."""
    return E4M3_REL_ERR * x.abs().to(torch.float32) + E4M3_SUBNORMAL_ERR * scale.to(torch.float32).unsqueeze(-1)


def bytes_per_token(num_parts: int, hidden_size: int, store_dtype: str) -> int:
    """Bytes of hidden states one token costs in a shard: ``num_parts`` parts (K layers + finals)
    of ``hidden_size`` values in ``store_dtype`` (a :class:`hsx.shard.StoreDtype` value; ``fp8``:
    1 byte each plus a 4-byte scale)."""
    dtype = StoreDtype(store_dtype)
    return num_parts * (hidden_size * dtype.itemsize + (SCALE_BYTES if dtype.scaled else 0))
