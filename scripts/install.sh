#!/usr/bin/env bash
# Create .venv (if missing) and install the project into it. Usage: scripts/install.sh [extras]
#   extras: "" (default, to run jobs), "dev" (tests), "gpu" (CUDA kernels: fla, causal-conv1d, nvidia-ml-py),
#   "parquet", "sharegpt", or several joined by commas ("dev,gpu"). Safe to run again: it only adds what is missing.
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
if [ -n "$extras" ]; then
  python -m pip install -q -e ".[$extras]"
else
  python -m pip install -q -e .
fi
