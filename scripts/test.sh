#!/usr/bin/env bash
# Run the test suite: unit, integration, slurm (real local cluster) and gpu (skipped without CUDA).
#   bash scripts/test.sh              # everything; starts the local Slurm when run as root
#   bash scripts/test.sh -m unit      # one tier (extra arguments go to pytest)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
if [ "$(id -u)" = 0 ]; then
    bash scripts/local-slurm.sh start
    export RLTOOLS_REQUIRE_SLURM=${RLTOOLS_REQUIRE_SLURM:-1}
else
    echo "test: not root, so no local Slurm; slurm-tier tests will be skipped" >&2
fi
export OMP_NUM_THREADS=1
exec .venv/bin/python -m pytest "$@"
