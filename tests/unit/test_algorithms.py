"""Advantages and losses against values computed by hand."""

import math

import pytest
import torch

from rltools.algorithms.advantages import STD_EPS, group_advantages, overlong_penalty
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
    loss, _ = policy_loss(new, new, torch.tensor([1.0, 2.0]), mask, clip_low=0.2, clip_high=0.2, aggregation="budget",
                          budget=4)
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


def test_token_mean_aggregation_weighs_every_token_alike():
    """DAPO / CISPO: the long sequence's 3 tokens count 3 times the short one's token."""
    new = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, _ = policy_loss(new, new, torch.tensor([1.0, 2.0]), mask, clip_low=0.2, clip_high=0.2, aggregation="token")
    assert loss.item() == pytest.approx(-(3 * 1 + 1 * 2) / 4)
    # micro batches: the batch's mean tokens per sample as the budget gives the same token mean
    loss, _ = policy_loss(new, new, torch.tensor([1.0, 2.0]), mask, clip_low=0.2, clip_high=0.2, aggregation="token",
                          budget=2.0)
    assert loss.item() == pytest.approx(-(3 * 1 + 1 * 2) / 4)


def test_gspo_clips_whole_sequences_on_the_geometric_mean_ratio():
    """Sequence 0: token ratios 1.5 and 1/1.5 -> s = 1, inside the clip: the loss is -A and each token
    gets the gradient -A s / |y| of its own logprob. Sequence 1: ratios 1.01 and 1.03 -> s = sqrt(1.01 x
    1.03) > 1 + 4e-4 with A > 0: clipped, so the whole sequence gets no gradient."""
    old = torch.zeros(2, 2)
    new = torch.tensor([[ln(1.5), -ln(1.5)], [ln(1.01), ln(1.03)]], requires_grad=True)
    mask = torch.ones(2, 2)
    adv = torch.tensor([2.0, 1.0])
    loss, m = policy_loss(new, old, adv, mask, clip_low=3e-4, clip_high=4e-4, objective="gspo")
    s1 = math.sqrt(1.01 * 1.03)
    assert loss.item() == pytest.approx((-2.0 + -(1 + 4e-4) * 1.0) / 2, rel=1e-6)
    assert m["clip_frac"] == pytest.approx(0.5) and m["ratio_mean"] == pytest.approx((1 + 1 + 2 * s1) / 4, rel=1e-6)
    loss.backward()
    assert torch.allclose(new.grad, torch.tensor([[-2.0 / 2 / 2, -2.0 / 2 / 2], [0.0, 0.0]]))


def test_cispo_weights_every_tokens_gradient_by_its_clipped_detached_ratio():
    """Token ratios 2.0 (weight clipped to 1.28) and 0.5 (no lower bound with clip_low 1): the loss is
    -sum(w A logp) / tokens, and even the clipped token keeps its gradient -w A / tokens."""
    old = torch.zeros(1, 2)
    new = torch.tensor([[ln(2.0), ln(0.5)]], requires_grad=True)
    loss, m = policy_loss(new, old, torch.tensor([1.0]), torch.ones(1, 2), clip_low=1.0, clip_high=0.28,
                          objective="cispo", aggregation="token")
    assert loss.item() == pytest.approx(-(1.28 * ln(2.0) + 0.5 * ln(0.5)) / 2, rel=1e-6)
    assert m["clip_frac"] == pytest.approx(0.5)
    loss.backward()
    assert torch.allclose(new.grad, torch.tensor([[-1.28 / 2, -0.5 / 2]]))


def test_a_proximal_policy_anchors_the_ratio_and_the_behaviour_gap_becomes_a_truncated_weight():
    """Decoupled PPO (mini batches, stale rollouts): ratio against the proximal logprobs, weight
    min(exp(proximal - behaviour), cap) on top."""
    behaviour, proximal = torch.tensor([[0.0]]), torch.tensor([[ln(3.0)]])
    new = torch.tensor([[ln(3.0 * 1.1)]])
    loss, m = policy_loss(new, behaviour, torch.tensor([1.0]), torch.ones(1, 1), clip_low=0.2, clip_high=0.2,
                          tis_cap=2.0, proximal_logprobs=proximal)
    assert loss.item() == pytest.approx(-1.1 * 2.0, rel=1e-6)  # ratio 1.1 (not 3.3), weight min(3, 2)
    assert m["tis_capped_frac"] == 1.0
    loss, _ = policy_loss(new, behaviour, torch.tensor([1.0]), torch.ones(1, 1), clip_low=0.2, clip_high=0.2,
                          proximal_logprobs=proximal)
    assert loss.item() == pytest.approx(-1.1, rel=1e-6)  # without tis_cap: the anchor alone


def test_dapo_overlong_penalty_by_hand():
    lengths = torch.tensor([10, 12, 14, 16])  # budget 16, the last 4 tokens penalised
    assert torch.allclose(overlong_penalty(lengths, max_new_tokens=16, buffer=4), torch.tensor([0.0, 0.0, -0.5, -1.0]))


def test_unknown_objective_or_aggregation_is_refused():
    with pytest.raises(ValueError, match="objective 'ppo2'"):
        policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), clip_low=0.2,
                    clip_high=0.2, objective="ppo2")


def test_every_algorithm_type_has_a_recipe_and_set_clips_override_its_defaults():
    import typing

    from rltools.config.schema import AlgorithmConfig
    from rltools.train.recipes import RECIPES, recipe

    assert set(RECIPES) == set(typing.get_args(AlgorithmConfig.model_fields["type"].annotation))
    assert (recipe(AlgorithmConfig(type="gspo")).clip_low, recipe(AlgorithmConfig(type="gspo")).clip_high) == (3e-4, 4e-4)
    assert recipe(AlgorithmConfig(type="dapo", clip_eps_high=0.3)).clip_high == 0.3
    assert recipe(AlgorithmConfig(type="cispo")).objective == "cispo"
