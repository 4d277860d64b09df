"""What `algorithm.type` means for the loss (rltools.algorithms.losses), with the published defaults.

Invariant: the one place that maps an algorithm name to its parts; the config's docstrings quote
these defaults, and tests/unit/test_algorithms.py checks the table covers the config's choices.
"""

from dataclasses import dataclass

from ..config.schema import AlgorithmConfig


@dataclass(frozen=True)
class Recipe:
    objective: str  # ppo | gspo | cispo
    aggregation: str  # sequence | token | budget
    scale_by_std: bool  # group advantages divided by the group's reward std
    clip_low: float
    clip_high: float


RECIPES = {
    "grpo": Recipe("ppo", "sequence", True, 0.2, 0.2),  # Shao et al. 2024 (DeepSeekMath)
    "dr_grpo": Recipe("ppo", "budget", False, 0.2, 0.2),  # Liu et al. 2025, arXiv:2503.20783
    "dapo": Recipe("ppo", "token", True, 0.2, 0.28),  # Yu et al. 2025, arXiv:2503.14476: clip-higher
    "gspo": Recipe("gspo", "sequence", True, 3e-4, 4e-4),  # Zheng et al. 2025, arXiv:2507.18071, sec. 5.1
    # MiniMax-M1, arXiv:2506.13585: no lower bound on the weight, only the upper one tuned (the value
    # is Trinity-RFT's CISPO default; the paper does not state its own)
    "cispo": Recipe("cispo", "token", True, 1.0, 0.28),
}


def recipe(algorithm: AlgorithmConfig) -> Recipe:
    """The objective's parts, with algorithm.clip_eps_low/high where set."""
    base = RECIPES[algorithm.type]
    low = base.clip_low if algorithm.clip_eps_low is None else algorithm.clip_eps_low
    high = base.clip_high if algorithm.clip_eps_high is None else algorithm.clip_eps_high
    return Recipe(base.objective, base.aggregation, base.scale_by_std, low, high)
