"""Megatron's activation recompute (`trainer.gradient_checkpointing`) on CUDA (skipped without a GPU).

Not run on CPU: megatron's recompute (`tensor_parallel.checkpoint`) saves and restores the CUDA RNG
state, which the CPU shim (tests/megatron_cpu.py) does not answer. Unverified until a GPU runs it.
(With those two RNG calls also answered on the CPU, the same comparison gave bitwise-equal losses,
gradient norms and adapters at TP=1, TP=2 and PP=2 — a one-off check, not a test.)
"""

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("megatron.core", reason="megatron-core is not installed (the gpu extra: RLTOOLS_EXTRAS=gpu,test bash scripts/setup.sh)")

TINY = Path(__file__).resolve().parents[2] / "rltools" / "assets" / "tiny-arith"


def _step(recompute: bool) -> tuple[dict, dict, int]:
    """One GRPO step: its metrics, the adapters after it, and how often layer 0's MLP ran."""
    from rltools.config.schema import AlgorithmConfig, ModelConfig
    from rltools.train.megatron.model import export_adapter, load_megatron_policy
    from rltools.train.megatron.trainer import MegatronTrainer
    from tests.integration.test_trainer import LORA, synthetic_batch

    torch.manual_seed(0)  # the adapters' initialisation, then B's
    policy = load_megatron_policy(ModelConfig(path=str(TINY), dtype="float32"), LORA, recompute=recompute).cuda()
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_()  # B starts at zero: give A a gradient too
    calls = []
    policy.gpt.decoder.layers[0].mlp.register_forward_pre_hook(lambda *args: calls.append(1))
    trainer = MegatronTrainer(policy, AlgorithmConfig(learning_rate=1e-2), micro_batch_size=4, max_new_tokens=6,
                              pad_id=0, device=torch.device("cuda"))
    metrics = trainer.step(synthetic_batch(seed=0))
    return metrics, {name: t.clone() for name, t in export_adapter(policy)}, len(calls)


def test_megatron_recompute_trains_exactly_as_without():
    from rltools.train.megatron.parallel import init_parallel

    torch.cuda.set_device(0)
    init_parallel(1, 1, seed=0)
    plain, plain_adapter, plain_calls = _step(recompute=False)
    recomputed, adapter, calls = _step(recompute=True)
    assert plain_calls == 2 and calls == 2 * plain_calls  # two micro batches, each run again in backward
    assert plain["grad_norm"] > 0  # a frozen embedding must not cut the adapters off (build._output_needs_grad)
    # the same kernels on the same inputs: equal up to a reordered fp32 sum (see test_trainer.py)
    assert recomputed["loss"] == pytest.approx(plain["loss"], rel=4e-5, abs=1e-7)
    assert recomputed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=4e-5)
    for name, tensor in plain_adapter.items():
        torch.testing.assert_close(adapter[name], tensor, rtol=4e-5, atol=1e-7)
