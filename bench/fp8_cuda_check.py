"""On a GPU: the one-pass fp8 quantisation and the NaN/Inf flags of the capture path
(``hsx.fp8.quantize_fp8``, ``row_amax``) against the step-by-step recipe on the same device
(tests/test_fp8.py checks the same on the CPU), and the recipe on CUDA against the CPU. Prints one
line; exit code 1 when the one-pass bytes or scales differ from the recipe's on CUDA.

    python bench/fp8_cuda_check.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hsx.fp8 import E4M3_MAX, FP8_DTYPE, quantize_fp8, row_amax  # noqa: E402


def recipe(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The step-by-step recipe (the implementation before the one-pass one), on ``x``'s device."""
    scale = x.abs().amax(dim=-1).to(torch.float32) / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.div(x, scale.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE), scale


def differ(a: torch.Tensor, b: torch.Tensor) -> str:
    """'equal', or how many bytes of two fp8 tensors differ and by how many e4m3 steps at most."""
    ua, ub = a.cpu().view(torch.uint8), b.cpu().view(torch.uint8)
    n = int((ua != ub).sum())
    if n == 0:
        return "equal"
    steps = (ua.to(torch.int16) - ub.to(torch.int16)).abs().max()
    return f"{n} of {ua.numel()} bytes differ (at most {int(steps)} e4m3 steps)"


def main() -> int:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 5, 2048, generator=g)
    x[:, :, [7, 100, 301]] *= 50.0
    x[0] *= 1e4
    x[50:60] *= 1e-20
    x[70] = 0
    x = x.to(torch.bfloat16)
    cpu_q, cpu_s = recipe(x)
    cuda_q, cuda_s = recipe(x.cuda())
    q, s = quantize_fp8(x.cuda())
    y = x[:64].clone()
    y[0, 1, 3], y[1, 0, 0], y[2, 3, 5], y[3, 2, 4], y[3, 2, 5] = float("nan"), float("inf"), float("-inf"), float("inf"), float("nan")
    flags = torch.equal(torch.isfinite(row_amax(y.cuda())).cpu(), torch.isfinite(y).all(dim=-1))
    one_pass_vs_recipe = differ(q, cuda_q)
    print(f"fp8 on {torch.cuda.get_device_name()}: one pass vs the recipe, both on CUDA: {one_pass_vs_recipe}, "
          f"scales {'equal' if torch.equal(s, cuda_s) else 'differ'}; the recipe on CUDA vs on the CPU: "
          f"{differ(cuda_q, cpu_q)}, scales {'equal' if torch.equal(cuda_s.cpu(), cpu_s) else 'differ'}; "
          f"NaN/Inf flags from row_amax equal to isfinite().all(): {flags}")
    return 0 if one_pass_vs_recipe == "equal" and torch.equal(s, cuda_s) and flags else 1


if __name__ == "__main__":
    sys.exit(main())
