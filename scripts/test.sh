#!/usr/bin/env bash
# Run the test suite: unit, integration, faults, slurm (real local cluster) and gpu (skipped without CUDA).
#   bash scripts/test.sh              # everything; starts the local Slurm when run as root
#   bash scripts/test.sh -m unit      # one tier (extra arguments go to pytest, in one process)
#
# Without arguments the suite runs as three pytest processes side by side, because much of it waits
# rather than computes: the slurm tier on the scheduler (job starts, requeues), the tests that launch
# whole demo jobs on their roles' start-up. On two cores that ends the suite minutes sooner. Each
# process's output is printed as it finishes; the exit code fails if any of them failed.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
slurm=0
if [ "$(id -u)" = 0 ]; then
    bash scripts/local-slurm.sh start
    export RLTOOLS_REQUIRE_SLURM=${RLTOOLS_REQUIRE_SLURM:-1}
    slurm=1
else
    echo "test: not root, so no local Slurm; slurm-tier tests will be skipped" >&2
fi
export OMP_NUM_THREADS=1
pytest=(.venv/bin/python -m pytest -p no:cacheprovider)
if [ $# -gt 0 ] || [ "$slurm" = 0 ]; then
    exec "${pytest[@]}" "$@"
fi

# Most of the tests that launch whole demo jobs (the rest balances the three: ~equal minutes each).
launches=(tests/faults tests/integration/test_eval.py tests/integration/test_megatron_run.py tests/integration/test_tool_demo.py
          tests/integration/test_trackers.py tests/integration/test_judge.py)
ignore=()
for path in "${launches[@]}"; do ignore+=("--ignore=$path"); done
work=$(mktemp -d "${TMPDIR:-/tmp}/rltools-tests.XXXXXX")
trap 'rm -rf "$work"' EXIT
declare -A pids

start() {  # start NAME PYTEST_ARGS...: one pytest process in the background, its output in a file
    local name=$1
    shift
    "${pytest[@]}" "$@" --durations=15 --basetemp="$work/$name" > "$work/$name.log" 2>&1 &
    pids[$name]=$!
    echo "test: $name tests started" >&2
}

start slurm -m slurm
start launches -m "not slurm" "${launches[@]}"
start rest -m "not slurm" "${ignore[@]}"
failed=()
while [ ${#pids[@]} -gt 0 ]; do
    wait -n "${pids[@]}" || true
    for name in "${!pids[@]}"; do
        kill -0 "${pids[$name]}" 2>/dev/null && continue
        rc=0
        wait "${pids[$name]}" || rc=$?
        unset "pids[$name]"
        echo "==================== $name tests (exit $rc) ===================="
        cat "$work/$name.log"
        [ "$rc" = 0 ] || failed+=("$name")
    done
done
if [ ${#failed[@]} -gt 0 ]; then
    echo "test: FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "test: all passed" >&2
