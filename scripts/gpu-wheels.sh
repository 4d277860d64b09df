#!/usr/bin/env bash
# Wheels for a GPU machine that has Python and torch but no network and not our other dependencies
# (the one-H200 machines lent to sessions here: Python 3.12, torch, transformers, peft, h5py, pytest;
# no vLLM, pydantic, submitit or megatron-core). Run on a machine with the package index:
#
#   bash scripts/gpu-wheels.sh            # into .whl/ (git-ignored); then carry .whl to the GPU machine
#   bash scripts/gpu-wheels.sh 3.11       # for another Python there
#
# scripts/gpu-check.sh installs what it finds in .whl/ (pip --no-index --no-deps --target) when the
# repo has no .venv, ahead of the machine's own packages on PYTHONPATH. The versions are the ones the
# CPU tests run (.venv), so both sides agree; vLLM is not among them (its CUDA wheel and torch pin do
# not fit a machine whose torch is given): the vLLM GPU tests report themselves skipped.
#
# Carried: what the machine lacks of rltools' light dependencies, and megatron-core, with every
# requirement of theirs except torch and numpy, which the machine has (tests/unit/test_packaging.py
# checks that the list is closed). Also what the machine has but perhaps too old: pydantic 2.14 and
# pydantic-core want typing-extensions >= 4.16, newer than a torch 2.11 machine may have, and
# megatron-core wants packaging >= 24.2; the carried copy shadows the machine's.
set -euo pipefail
cd "$(dirname "$0")/.."
python_version=${1:-3.12}
PY=.venv/bin/python
[ -x "$PY" ] || { echo "gpu-wheels: no .venv to read the tested versions from; run bash scripts/setup.sh" >&2; exit 2; }
pins=()
carried=(pydantic pydantic-core annotated-types typing-inspection typing-extensions submitit cloudpickle tensorboardX
         protobuf megatron-core packaging)
for name in "${carried[@]}"; do
    pins+=("$name==$("$PY" -c "from importlib.metadata import version; print(version('$name'))")")
done
mkdir -p .whl
rm -f .whl/*.whl  # another release's wheel left here would install beside this one's
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${pins[@]}"
echo "gpu-wheels: $(ls .whl | wc -l) wheels in .whl ($(du -sh .whl | cut -f1)): ${pins[*]}" >&2
