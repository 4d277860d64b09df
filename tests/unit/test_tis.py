"""Truncated importance sampling in the policy loss, against values computed by hand."""

import math

import pytest
import torch

from rltools.algorithms.losses import policy_loss
from rltools.config.schema import AlgorithmConfig


def test_tis_weights_are_the_capped_trainer_generator_ratio():
    # Trainer probabilities 0.5 and 0.9; the generator gave 0.25 and 0.9: ratios 2 (capped at 1.5) and 1.
    # Third token is padding: any value there (even -inf from the generator) must not leak in.
    trainer = torch.tensor([[math.log(0.5), math.log(0.9), 0.0]], requires_grad=True)
    generator = torch.tensor([[math.log(0.25), math.log(0.9), -math.inf]])
    mask = torch.tensor([[1, 1, 0]])
    loss, m = policy_loss(trainer, generator, torch.tensor([1.0]), mask, clip_low=0.2, clip_high=0.2, tis_cap=1.5)
    # PPO ratio against the trainer's own logprobs is 1; per-token loss -w x A: mean of -1.5 and -1.0
    assert loss.item() == pytest.approx(-1.25)
    assert m["tis_mean"] == pytest.approx(1.25)
    assert m["tis_capped_frac"] == pytest.approx(0.5)
    assert m["clip_frac"] == 0.0
    loss.backward()
    # d/d logprob of -w x exp(logprob - logprob.detach()) / 2 tokens = -w / 2; the weight itself is detached
    assert torch.allclose(trainer.grad, torch.tensor([[-0.75, -0.5, 0.0]]))


def test_tis_weight_below_one_is_not_raised():
    trainer = torch.tensor([[math.log(0.2)]], requires_grad=True)
    generator = torch.tensor([[math.log(0.8)]])
    loss, m = policy_loss(trainer, generator, torch.tensor([-2.0]), torch.ones(1, 1), clip_low=0.2, clip_high=0.2,
                          tis_cap=2.0)
    assert m["tis_mean"] == pytest.approx(0.25)
    assert loss.item() == pytest.approx(0.25 * 2.0)  # -(w x ratio x A) = -(0.25 x 1 x -2)


def test_without_tis_the_ratio_is_against_the_generator():
    trainer = torch.tensor([[math.log(0.5)]])
    generator = torch.tensor([[math.log(0.25)]])
    loss, m = policy_loss(trainer, generator, torch.tensor([1.0]), torch.ones(1, 1), clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(-1.2)  # ratio 2 clipped to 1.2
    assert "tis_mean" not in m


def test_tis_cap_config():
    assert AlgorithmConfig().tis_cap is None
    assert AlgorithmConfig(tis_cap=2.0).tis_cap == 2.0
    with pytest.raises(ValueError):
        AlgorithmConfig(tis_cap=0)
