#!/usr/bin/env bash
# Install into .venv with the dev extras (real S3 server, ShareGPT data, pytest), then run the tests.
# Arguments go to pytest, e.g. scripts/test.sh -k end_to_end. Four pytest-xdist processes, one test file
# each at a time (--dist loadfile: a file's module fixtures stay in one process): most tests wait on
# worker processes, brokers and S3 servers, so four overlap well even on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh dev
. .venv/bin/activate
exec python -m pytest -q -n "${HSX_TEST_PROCESSES:-4}" --dist loadfile --durations=15 "$@"  # the 15 slowest: where the suite's time goes
