#!/usr/bin/env bash
# Wheels for a GPU machine that has Python and torch but no network and not our other dependencies
# (the one-H200 machines lent to sessions here: Python 3.12, torch, transformers, peft, h5py, pytest;
# no vLLM, pydantic, submitit or megatron-core). Run on a machine with the package index:
#
#   bash scripts/gpu-wheels.sh            # into .whl/ (git-ignored); then carry .whl to the GPU machine
#   bash scripts/gpu-wheels.sh 3.11       # for another Python there
#
# scripts/gpu-check.sh installs what it finds in .whl/ (pip --no-index --no-deps --target) when the
# repo has no .venv. The versions are the ones the CPU tests run (.venv), so both sides agree; vLLM is
# not among them (its CUDA wheel and torch pin do not fit a machine whose torch is given): the vLLM
# GPU tests report themselves skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
python_version=${1:-3.12}
PY=.venv/bin/python
[ -x "$PY" ] || { echo "gpu-wheels: no .venv to read the tested versions from; run bash scripts/setup.sh" >&2; exit 2; }
pins=()
for name in pydantic pydantic_core annotated-types typing-inspection submitit tensorboardX megatron-core; do
    pins+=("$name==$("$PY" -c "from importlib.metadata import version; print(version('$name'))")")
done
mkdir -p .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${pins[@]}"
echo "gpu-wheels: $(ls .whl | wc -l) wheels in .whl ($(du -sh .whl | cut -f1)): ${pins[*]}" >&2
