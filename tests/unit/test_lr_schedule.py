"""The learning-rate schedule (warm-up, constant / linear / cosine, floor) and its config keys."""

import math

import pytest

from rltools.config import load_config
from rltools.config.schema import AlgorithmConfig
from rltools.errors import UserError
from rltools.config.lr_schedule import learning_rate, rate_at


def lr(update, kind="constant", warmup=0, total=10, floor=0.0, per_step=1, peak=1e-3):
    return learning_rate(update, peak=peak, kind=kind, warmup_steps=warmup, total_steps=total, min_ratio=floor,
                         per_step=per_step)


def test_the_defaults_keep_a_constant_rate():
    algorithm = AlgorithmConfig(learning_rate=3e-4)
    assert [rate_at(algorithm, None, u) for u in (0, 1, 99, 10**6)] == [3e-4] * 4  # exactly, as before


def test_the_warm_up_rises_linearly_to_the_peak_at_its_last_update():
    assert [lr(u, warmup=4) for u in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert lr(0, warmup=4) > 0  # the first update moves the weights


def test_linear_decay_reaches_its_floor_at_the_end():
    values = [lr(u, kind="linear", warmup=2, total=10, floor=0.1) for u in range(12)]
    assert values[:3] == pytest.approx([5e-4, 1e-3, 1e-3])  # warm-up, then the decay starts at the peak
    assert values[6] == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))  # half way through the 8 decaying steps
    assert values[9] == pytest.approx(1e-3 * (0.1 + 0.9 / 8))  # the last step: one eighth above the floor
    assert values[10] == values[11] == pytest.approx(1e-4)  # past the end: the floor, never below
    assert all(a >= b for a, b in zip(values[1:], values[2:]))


def test_cosine_decay_follows_the_half_cosine_to_its_floor():
    values = [lr(u, kind="cosine", total=8, floor=0.2) for u in range(9)]
    assert values[0] == pytest.approx(1e-3)
    assert values[4] == pytest.approx(1e-3 * 0.6)  # half way: the mean of peak and floor
    assert values[2] == pytest.approx(1e-3 * (0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi / 4))))
    assert values[8] == pytest.approx(2e-4)
    assert lr(5, kind="cosine", total=8) == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi * 5 / 8)))


def test_several_updates_a_step_follow_the_same_curve_in_between():
    """mini_batches: step k's update i sits at k + i / m on the curve of one update a step."""
    for kind in ("linear", "cosine"):
        assert lr(6, kind=kind, warmup=1, total=10, per_step=2) == pytest.approx(lr(3, kind=kind, warmup=1, total=10))
        between = lr(7, kind=kind, warmup=1, total=10, per_step=2)
        assert lr(4, kind=kind, warmup=1, total=10) < between < lr(3, kind=kind, warmup=1, total=10)
    assert [lr(u, warmup=2, per_step=3) for u in range(7)] == pytest.approx([v * 1e-3 for v in (1/6, 2/6, 3/6, 4/6, 5/6, 1, 1)])


def test_rate_at_reads_the_algorithm_section():
    algorithm = AlgorithmConfig(learning_rate=2e-3, lr_schedule="cosine", lr_warmup_steps=1, min_lr_ratio=0.5,
                                mini_batches=2)
    assert rate_at(algorithm, 5, 0) == pytest.approx(1e-3)
    assert rate_at(algorithm, 5, 2) == pytest.approx(2e-3)
    assert rate_at(algorithm, 5, 10) == pytest.approx(1e-3)  # the end: half the peak


def _config(repo, *overrides):
    return load_config(repo / "configs/demo.yaml", list(overrides))


def test_the_optimizer_keys_validate(repo):
    config = _config(repo, "algorithm.lr_schedule=cosine", "algorithm.lr_warmup_steps=5", "algorithm.min_lr_ratio=0.1",
                     "algorithm.weight_decay=0.01", "algorithm.adam_beta2=0.95", "algorithm.adam_eps=1e-6")
    a = config.algorithm
    assert (a.lr_schedule, a.lr_warmup_steps, a.min_lr_ratio, a.weight_decay, a.adam_beta1, a.adam_beta2,
            a.adam_eps) == ("cosine", 5, 0.1, 0.01, 0.9, 0.95, 1e-6)


@pytest.mark.parametrize("overrides,message", [
    (["algorithm.min_lr_ratio=0.1"], "min_lr_ratio 0.1 is the floor of a decaying learning rate"),
    (["algorithm.lr_warmup_steps=20", "schedule.steps=20"], "lr_warmup_steps 20 must be below schedule.steps"),
    (["algorithm.lr_schedule=exponential"], "algorithm.lr_schedule"),
    (["algorithm.adam_beta2=1.0"], "algorithm.adam_beta2"),
    (["algorithm.weight_decay=-0.1"], "algorithm.weight_decay"),
    (["algorithm.lr_warmup=5"], "did you mean 'algorithm.lr_warmup_steps'"),
    (["lora.enabled=false", "lora.init_from=/tmp"], "lora.init_from loads LoRA adapters: it needs lora.enabled: true"),
])
def test_wrong_optimizer_keys_are_refused_by_name(repo, overrides, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(".", r"\.")):
        _config(repo, *overrides)
