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


def row_amax(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` over the last dim, float32 [...] from ``x`` [..., H] (any float dtype, any
    device): one reduction, no ``|x|`` tensor. NaN where a row holds a NaN, inf where it holds an
    Inf and no NaN (torch's inf-norm propagates NaN), so ``isfinite(row_amax(x))`` says whether a
    row is finite: the capture path takes its NaN/Inf flags and its fp8 scales from this one pass."""
    return torch.linalg.vector_norm(x, float("inf"), dim=-1).to(SCALE_DTYPE)


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """The fp8 scale of each row from its :func:`row_amax` (float32 [...]): ``amax / 448``, 1 where
    that is 0 (a zero row, or an amax so small that the division underflows: the row stores
    (near-)zeros, no division by zero)."""
    scale = amax.to(SCALE_DTYPE) / E4M3_MAX
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_fp8(x: torch.Tensor, amax: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` [..., H] (any float dtype, any device) row by row over its last dim.

    Returns ``(q, scale)``: ``q`` float8_e4m3fn [..., H] and ``scale`` float32 [...], on ``x``'s
    device, with ``x ~= q.float() * scale[..., None]`` within :func:`error_bound`. ``scale`` is
    ``amax(|x|) / 448`` per row, 1 for a row of zeros (so it stores exact zeros). The division runs
    in float32 and is cast to e4m3fn as it is stored (one pass over ``x``, no float32 copy of it).
    ``amax``: the rows' :func:`row_amax` when the caller has it already; ``out``: a float8_e4m3fn
    tensor (or strided view) of ``x``'s shape to write ``q`` into. Rows holding NaN or Inf give NaN
    or garbage: check finiteness before (the module docstring says why).
    """
    scale = scale_from_amax(row_amax(x) if amax is None else amax)
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device) if out is None else out
    # |x / scale| <= 448 (1 + 2**-23) by construction: float32 rounding of amax / 448 and of the
    # quotient; e4m3fn's cast rounds that to 448 (only values from 464 up round past it), so no clamp.
    torch.div(x, scale.unsqueeze(-1), out=q)
    return q, scale


def quantize_states(states: dict[str, torch.Tensor],
                    amax: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The fp8 step after capture: each captured state quantised as :func:`quantize_fp8` does.

    ``states`` maps ``hidden_states`` [T, K, H] and ``final_*`` [T, H] (any float dtype, one
    device) to their values; ``amax`` (optional) the same names to their :func:`row_amax` ([T, K]
    or [T]), as the capture path computed them for its NaN/Inf flags. Returns, in the same order,
    each ``name`` as float8_e4m3fn of the same shape followed by ``<name>_scale`` float32 [T, K] or
    [T], on the same device: one division kernel per state, written straight into the fp8 tensor.
    Take NaN/Inf flags before calling (the module docstring says why).
    """
    out: dict[str, torch.Tensor] = {}
    for name, x in states.items():
        out[name], out[scale_name(name)] = quantize_fp8(x, None if amax is None else amax.get(name))
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
