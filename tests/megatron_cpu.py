"""The smallest shim that runs megatron-core 0.16.1 on CPU — for tests only; the product is unshimmed.

megatron-core is GPU software: it creates tensors on `torch.cuda.current_device()` (RoPE frequencies,
all-gather buffers, attention masks) and seeds dropout through a CUDA RNG state tracker. The
rltools Megatron backend uses neither megatron's DDP, optimizer nor pipeline schedules (a plain
torch optimizer steps the LoRA weights) and passes its own attention mask, so on CPU only these two
calls need a CPU answer:

1. `torch.cuda.current_device()` returns "cpu": every tensor megatron places "on the current
   device" lands on the CPU.
2. `tensor_parallel.model_parallel_cuda_manual_seed` installs megatron's own inference tracker,
   whose `fork()` is a no-op, instead of seeding CUDA generators. Sound because the backend refuses
   dropout (`lora.dropout` and megatron's hidden/attention dropout are 0): the forks it skips
   would seed nothing.

`megatron_on_cpu()` applies them for a block (tests that spawn their own ranks); `SITE_DIR` holds a
`sitecustomize.py` that applies them in trainer processes the local launcher starts (put it first
on PYTHONPATH). `tests/gpu/test_megatron_gpu.py` runs the same model code without this shim, on CUDA.
"""

import contextlib
from pathlib import Path

import torch

SITE_DIR = Path(__file__).resolve().parent / "megatron_cpu_site"


def install() -> tuple:
    """Apply both patches; returns what they replaced (for `uninstall`)."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random

    def seed_without_cuda(seed: int, *args, **kwargs) -> None:
        random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

    saved = torch.cuda.current_device, tensor_parallel.model_parallel_cuda_manual_seed
    torch.cuda.current_device = lambda: "cpu"
    tensor_parallel.model_parallel_cuda_manual_seed = seed_without_cuda
    return saved


def uninstall(saved: tuple) -> None:
    from megatron.core import tensor_parallel

    torch.cuda.current_device, tensor_parallel.model_parallel_cuda_manual_seed = saved


@contextlib.contextmanager
def megatron_on_cpu():
    saved = install()
    try:
        yield
    finally:
        uninstall(saved)
