"""The Megatron backend on CUDA, without the CPU shim (skipped without a GPU).

Not run on the CPU machines this project is developed on: whether it passes is unverified until a
GPU runs it. One GPU, TP=1 PP=1: logits against the HF model, one GRPO step through megatron's
schedule, the weight export.
"""

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("megatron.core", reason="megatron-core is not installed (the gpu extra: RLTOOLS_EXTRAS=gpu,test bash scripts/setup.sh)")

TINY = Path(__file__).resolve().parents[2] / "rltools" / "assets" / "tiny-arith"


def test_megatron_policy_on_cuda_matches_hf_and_trains(record_property):
    from rltools.config.schema import AlgorithmConfig, LoraConfig, ModelConfig
    from rltools.train.megatron.model import export_weights, load_megatron_policy
    from rltools.train.megatron.parallel import init_parallel
    from rltools.train.megatron.trainer import MegatronTrainer
    from rltools.train.model import load_policy
    from tests.integration.test_trainer import LORA, synthetic_batch

    torch.cuda.set_device(0)
    init_parallel(1, 1, seed=0)
    model_cfg = ModelConfig(path=str(TINY), dtype="float32")
    policy = load_megatron_policy(model_cfg, LORA).cuda()
    hf = load_policy(model_cfg, LoraConfig(enabled=False)).cuda()
    ids = torch.randint(3, 40, (3, 11), device="cuda")
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ours = policy(ids, mask)
        theirs = hf(input_ids=ids, attention_mask=mask).logits
    gap = (ours - theirs).abs().max().item()
    record_property("max_logit_gap_to_hf", gap)
    assert gap < 1e-3  # TF32 matmuls may be on
    trainer = MegatronTrainer(policy, AlgorithmConfig(learning_rate=1e-2), micro_batch_size=4, max_new_tokens=6,
                              pad_id=0, device=torch.device("cuda"))
    metrics = trainer.step(synthetic_batch(seed=0))
    record_property("loss", metrics["loss"])
    record_property("grad_norm", metrics["grad_norm"])
    assert metrics["grad_norm"] > 0
    exported = dict(export_weights(policy))
    assert exported.keys() == hf.state_dict().keys()


def test_megatron_moe_on_cuda_matches_hf_and_trains_over_packed_experts(record_property, tmp_path):
    """The DeepSeek-V3 class on one GPU (EP 1): megatron's MLA and MoE layers against transformers, then
    one GRPO step over the mixed NVFP4 checkpoint (packed routed experts, dequantised per projection)."""
    from rltools.config.schema import AlgorithmConfig, LoraConfig, ModelConfig
    from rltools.quant.nvfp4_checkpoint import quantize_checkpoint
    from rltools.train.megatron.model import load_megatron_policy
    from rltools.train.megatron.parallel import init_parallel
    from rltools.train.megatron.trainer import MegatronTrainer
    from rltools.train.model import load_policy
    from tests.integration.test_megatron_moe import LORA
    from tests.integration.test_trainer import synthetic_batch

    moe = TINY.parent / "tiny-moe-arith"
    torch.cuda.set_device(0)
    init_parallel(1, 1, seed=0, expert_parallel=1)
    policy = load_megatron_policy(ModelConfig(path=str(moe), dtype="float32"), LORA).cuda()
    hf = load_policy(ModelConfig(path=str(moe), dtype="float32"), LoraConfig(enabled=False)).cuda()
    ids = torch.randint(3, 100, (3, 11), device="cuda")
    mask = torch.ones_like(ids)
    with torch.no_grad():
        gap = (policy(ids, mask) - hf(input_ids=ids, attention_mask=mask).logits).abs().max().item()
    record_property("moe_max_logit_gap_to_hf", gap)
    assert gap < 1e-3
    quantize_checkpoint(moe, tmp_path / "mixed", progress=False, fp8_outside_experts=True)
    packed = load_megatron_policy(ModelConfig(path=str(tmp_path / "mixed"), dtype="float32", quantization="nvfp4"),
                                  LORA).cuda()
    trainer = MegatronTrainer(packed, AlgorithmConfig(learning_rate=1e-2), micro_batch_size=4, max_new_tokens=6,
                              pad_id=0, device=torch.device("cuda"))
    metrics = trainer.step(synthetic_batch(seed=0))
    record_property("moe_nvfp4_grad_norm", metrics["grad_norm"])
    assert metrics["grad_norm"] > 0
