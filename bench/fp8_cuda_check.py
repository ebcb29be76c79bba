"""On a GPU: the one-pass fp8 quantisation and the NaN/Inf flags of the capture path
(``hsx.fp8.quantize_fp8``, ``row_amax``) give on CUDA the bytes the step-by-step recipe gives on
the CPU (tests/test_fp8.py checks the same on the CPU). Prints one line; exit code 1 on a mismatch.

    python bench/fp8_cuda_check.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hsx.fp8 import E4M3_MAX, FP8_DTYPE, quantize_fp8, row_amax  # noqa: E402


def main() -> int:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 5, 2048, generator=g)
    x[:, :, [7, 100, 301]] *= 50.0
    x[0] *= 1e4
    x[50:60] *= 1e-20
    x[70] = 0
    x = x.to(torch.bfloat16)
    scale = x.abs().amax(dim=-1).to(torch.float32) / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    want = torch.div(x, scale.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    q, s = quantize_fp8(x.cuda())
    same = torch.equal(q.cpu().view(torch.uint8), want.view(torch.uint8)) and torch.equal(s.cpu(), scale)
    y = x[:64].clone()
    y[0, 1, 3], y[1, 0, 0], y[2, 3, 5], y[3, 2, 4], y[3, 2, 5] = float("nan"), float("inf"), float("-inf"), float("inf"), float("nan")
    flags = torch.equal(torch.isfinite(row_amax(y.cuda())).cpu(), torch.isfinite(y).all(dim=-1))
    print(f"fp8 on {torch.cuda.get_device_name()}: bytes and scales equal to the CPU recipe: {same}; "
          f"NaN/Inf flags from row_amax equal to isfinite().all(): {flags}")
    return 0 if same and flags else 1


if __name__ == "__main__":
    sys.exit(main())
