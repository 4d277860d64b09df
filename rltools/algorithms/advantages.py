"""Group-relative advantages (GRPO and Dr.GRPO), and DAPO's soft penalty for overlong answers.

Shapes: `rewards` [N] float, `group_ids` [N] int (samples of one prompt share an id; groups need
not be contiguous or of equal size). Returns advantages [N] and metrics. Pure: no config, no I/O.
"""

import torch

STD_EPS = 1e-4


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, scale_by_std: bool = True):
    """A_i = r_i - mean(group of i), divided by (std(group) + eps) when `scale_by_std` (GRPO).

    Dr.GRPO drops the std division (`scale_by_std=False`): it over-weights groups whose rewards
    barely differ. The std is the unbiased sample std, as in the GRPO paper's reference code; a
    group of identical rewards gets advantage 0 either way.
    """
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    rewards = rewards.to(torch.float64)
    sums = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, rewards)
    means = sums / counts
    centered = rewards - means[inverse]
    squares = torch.zeros(len(counts), dtype=torch.float64).index_add_(0, inverse, centered**2)
    std = torch.sqrt(squares / (counts - 1).clamp(min=1))
    # Groups that teach nothing (every sample scored alike), reported whichever scaling is used.
    metrics = {"zero_std_groups": float((std == 0).to(torch.float64).mean())}
    if scale_by_std:
        centered = centered / (std[inverse] + STD_EPS)
    return centered.to(torch.float32), metrics


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13), added to the
    reward: 0 up to max_new_tokens - buffer tokens, then falling linearly to -1 at max_new_tokens.
    `lengths` [N] completion lengths; returns [N] float32 penalties in [-1, 0]."""
    free = max_new_tokens - buffer
    over = (lengths.to(torch.float32) - free).clamp(min=0)
    return -(over / buffer).clamp(max=1.0)
