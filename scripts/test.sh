#!/usr/bin/env bash
# Install into .venv with the dev extras (real S3 server, ShareGPT data, pytest), then run the tests.
# Arguments go to pytest, e.g. scripts/test.sh -k end_to_end
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh dev
. .venv/bin/activate
exec python -m pytest -q "$@"
