"""The smallest shim that runs megatron-core 0.16.1 on CPU — for tests only; the product is unshimmed.

megatron-core is GPU software: it creates tensors on `torch.cuda.current_device()` (RoPE frequencies,
all-gather buffers, attention masks, pipeline receive buffers), seeds dropout through a CUDA RNG
state tracker, and its schedules synchronise CUDA streams. The rltools Megatron backend uses
megatron's model and pipeline schedules but neither its DDP nor its optimizer (a plain torch
optimizer steps the LoRA weights), and its own core attention (causal in the kernel, no mask), so on CPU only these calls
need a CPU answer:

1. `torch.cuda.current_device()` returns "cpu": every tensor megatron places "on the current
   device" lands on the CPU.
2. `tensor_parallel.model_parallel_cuda_manual_seed` installs megatron's own inference tracker,
   whose `fork()` is a no-op, instead of seeding CUDA generators. Sound because the backend refuses
   dropout (`lora.dropout` and megatron's hidden/attention dropout are 0): the forks it skips
   would seed nothing.
3. `torch.cuda.synchronize()` does nothing (the pipeline's send/receive waits for its requests
   anyway; CPU work has no stream to wait for).
4. The schedules' token counter, `torch.zeros(..., device="cuda")`, is made on the CPU: the
   schedules module sees a `torch` whose `zeros` maps "cuda" to "cpu" (only that module).
5. The MoE all-to-all token dispatcher copies its split sizes to the host on a side CUDA stream
   and waits on an event: its module sees a `torch.cuda` whose one stream is the current one and
   whose events are complete (CPU work is in order already), and its `maybe_move_tensor_to_cpu`
   turns the split sizes into numpy arrays as it does for GPU tensors (`all_to_all_single` takes
   lists or arrays of ints, not tensors).
6. Activation recompute (`tensor_parallel.checkpoint`, trainer.gradient_checkpointing) saves and
   restores the CUDA RNG state around each recomputed layer: on CPU there is none to save, and the
   CPU generator (which it saves too) is the one CPU work draws from.

`megatron_on_cpu()` applies them for a block (tests that spawn their own ranks); `SITE_DIR` holds a
`sitecustomize.py` that applies them in trainer processes the local launcher starts (put it first
on PYTHONPATH). `tests/gpu/test_megatron_gpu.py` runs the same model code without this shim, on CUDA.
"""

import contextlib
import types
from pathlib import Path

import torch

SITE_DIR = Path(__file__).resolve().parent / "megatron_cpu_site"


def install() -> tuple:
    """Apply the patches; returns what they replaced (for `uninstall`)."""
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer.moe import token_dispatcher

    def seed_without_cuda(seed: int, *args, **kwargs) -> None:
        random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

    saved = (torch.cuda.current_device, tensor_parallel.model_parallel_cuda_manual_seed, torch.cuda.synchronize,
             schedules.torch, token_dispatcher.torch, token_dispatcher.maybe_move_tensor_to_cpu,
             random._get_cuda_rng_state, random._set_cuda_rng_state)
    torch.cuda.current_device = lambda: "cpu"
    tensor_parallel.model_parallel_cuda_manual_seed = seed_without_cuda
    torch.cuda.synchronize = lambda device=None: None
    schedules.torch = _TorchOnCpu("torch")
    token_dispatcher.torch = _TorchOnCpu("torch")
    token_dispatcher.maybe_move_tensor_to_cpu = _on_host
    random._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    random._set_cuda_rng_state = lambda *args, **kwargs: None
    return saved


def uninstall(saved: tuple) -> None:
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer.moe import token_dispatcher

    (torch.cuda.current_device, tensor_parallel.model_parallel_cuda_manual_seed, torch.cuda.synchronize,
     schedules.torch, token_dispatcher.torch, token_dispatcher.maybe_move_tensor_to_cpu,
     random._get_cuda_rng_state, random._set_cuda_rng_state) = saved


def _on_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron's `maybe_move_tensor_to_cpu` for tensors already on the CPU (item 5)."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


class _CpuStream:
    """The one "stream" of CPU work: waiting on it, or on its events, returns at once."""

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(synchronize=lambda: None, wait=lambda stream=None: None)


class _CudaOnCpu(types.ModuleType):
    """`torch.cuda` as the token dispatcher sees it under the shim (item 5)."""

    stream_of_cpu = _CpuStream()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    def Stream(self, *args, **kwargs) -> _CpuStream:  # noqa: N802 (torch's name)
        return self.stream_of_cpu

    def current_stream(self, device=None) -> _CpuStream:
        return self.stream_of_cpu

    @staticmethod
    def stream(stream):
        return contextlib.nullcontext()


class _TorchOnCpu(types.ModuleType):
    """`torch` as megatron's schedules and token dispatcher modules see it under the shim: `zeros`
    on "cuda" is on the CPU, CUDA streams are `_CpuStream`."""

    cuda = _CudaOnCpu("torch.cuda")

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*size, device=None, **kwargs):
        return torch.zeros(*size, device="cpu" if device == "cuda" else device, **kwargs)


@contextlib.contextmanager
def megatron_on_cpu():
    saved = install()
    try:
        yield
    finally:
        uninstall(saved)
