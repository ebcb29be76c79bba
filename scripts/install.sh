#!/usr/bin/env bash
# Create .venv (if missing) and install the project into it. Usage: scripts/install.sh [extras]
#   extras: "" (default, to run jobs), "dev" (tests), "gpu" (CUDA kernels: fla, nvidia-ml-py; then causal-conv1d
#   if it can be had), "parquet", "sharegpt", or several joined by commas ("dev,gpu"). Safe to run again: it only
#   adds what is missing. HSX_NO_CAUSAL_CONV1D=1 skips causal-conv1d (optional: the torch path runs without it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q "torch>=2.4,<3"          # a CUDA build for GPU nodes
  else
    python -m pip install -q "torch==2.13.0"          # CPU build: no GPU here (never install triton on a CPU box)
  fi
fi
extras=${1:-}
# setuptools warns, at every editable install, that folders named like the packages may shadow them: they are them
export PYTHONWARNINGS="${PYTHONWARNINGS:+$PYTHONWARNINGS,}ignore:Editable installation"
if [ -n "$extras" ]; then
  python -m pip install -q -e ".[$extras]"
else
  python -m pip install -q -e .
fi
case ",$extras," in
  *,gpu,*)
    # optional, and apart from the gpu extra: a prebuilt wheel when one matches this torch/CUDA, else a source build
    # (nvcc, 18+ minutes for sm_90) that may fail; without it transformers runs the short convolution in torch
    if [ -z "${HSX_NO_CAUSAL_CONV1D:-}" ] && ! python -c "import causal_conv1d" 2>/dev/null; then
      echo "installing causal-conv1d (optional; a source build can take 20 minutes: HSX_NO_CAUSAL_CONV1D=1 skips it)"
      python -m pip install -q setuptools wheel packaging ninja
      python -m pip install -q --no-build-isolation "causal-conv1d>=1.5" \
        || echo "causal-conv1d not installed (no prebuilt wheel for this torch/CUDA, and no build): the workers run" \
                "the short convolution in torch (correct, a little slower) and say so at start"
    fi
    ;;
esac
