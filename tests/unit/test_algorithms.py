"""Advantages and losses against values computed by hand."""

import math

import pytest
import torch

from rltools.algorithms.advantages import STD_EPS, group_advantages
from rltools.algorithms.losses import policy_loss


def test_grpo_advantages_by_hand():
    # group 7: rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(1/3); group 3: all 1 -> zero advantage
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([7, 7, 3, 7, 7, 3])
    adv, metrics = group_advantages(rewards, groups)
    a = 0.5 / (math.sqrt(1 / 3) + STD_EPS)
    assert torch.allclose(adv, torch.tensor([a, -a, 0.0, -a, a, 0.0]), atol=1e-6)
    assert metrics["zero_std_groups"] == 0.5


def test_dr_grpo_advantages_skip_std():
    adv, metrics = group_advantages(torch.tensor([3.0, 0.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 0, 1, 1]), scale_by_std=False)
    assert torch.allclose(adv, torch.tensor([2.0, -1.0, -1.0, 0.0, 0.0]))
    assert metrics["zero_std_groups"] == 0.5  # reported for Dr.GRPO too


def test_unequal_group_sizes():
    adv, _ = group_advantages(torch.tensor([1.0, 0.0, 5.0]), torch.tensor([0, 0, 1]), scale_by_std=False)
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, 0.0]))


def ln(x):
    return math.log(x)


def test_ppo_clip_by_hand():
    # Sequence 0 (A=+1): token ratios 1.5 (clipped to 1.2) and 1.0; sequence 1 (A=-1): ratio 0.5
    # (clipped to 0.8, min picks the unclipped -(-0.5)... see below), second token masked out.
    old = torch.zeros(2, 2)
    new = torch.tensor([[ln(1.5), 0.0], [ln(0.5), 123.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([1.0, -1.0])
    loss, m = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # seq 0: -min(1.5, 1.2) = -1.2 ; -min(1.0, 1.0) = -1.0 -> mean -1.1
    # seq 1: -min(0.5*-1, 0.8*-1) = -(-0.8) = 0.8
    assert loss.item() == pytest.approx((-1.1 + 0.8) / 2, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(2 / 3)
    assert m["kl"] == 0.0


def test_dr_grpo_token_sum():
    new = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, _ = policy_loss(new, new, torch.tensor([1.0, 2.0]), mask, clip_low=0.2, clip_high=0.2, token_sum_norm=4)
    # ratio 1 everywhere: per-token loss -A; sum = -(3*1 + 1*2) = -5 ; / (B=2 x L=4)
    assert loss.item() == pytest.approx(-5 / 8)


def test_k3_kl_by_hand():
    new = torch.tensor([[0.0]])
    ref = torch.tensor([[ln(2.0)]])
    loss, m = policy_loss(new, new, torch.tensor([0.0]), torch.ones(1, 1), clip_low=0.2, clip_high=0.2,
                          ref_logprobs=ref, kl_coef=0.5)
    k3 = 2.0 - ln(2.0) - 1.0
    assert m["kl"] == pytest.approx(k3)
    assert loss.item() == pytest.approx(0.5 * k3)


def test_gradient_flows_only_through_new_logprobs():
    new = torch.tensor([[0.1, -0.2]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0]], requires_grad=True)
    loss, _ = policy_loss(new, old.detach(), torch.tensor([1.0]), torch.ones(1, 2), clip_low=0.2, clip_high=0.2)
    loss.backward()
    # unclipped region: d(-ratio)/d new = -ratio / T (mean over 2 tokens)
    assert torch.allclose(new.grad, -torch.exp(new.detach()) / 2)
