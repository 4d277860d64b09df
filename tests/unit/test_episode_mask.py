"""The trainer learns only from the tokens the model wrote: an environment's answer in a multi-turn
sample is masked out of the loss, and counts toward no token budget."""

import numpy as np
import torch

from rltools.rollout import FinishReason, RolloutBatch, Sample
from rltools.train.logprobs import pack


def test_environment_tokens_are_masked_out_of_the_loss():
    mask = [1, 1, 1, 0, 0, 0, 0, 1, 1]  # <calc>..</calc>, <result>..</result>, the answer
    samples = [Sample([5, 6], list(range(10, 19)), [-0.1 * m for m in mask], 1.0, 0, 0, FinishReason.STOP,
                      completion_mask=mask, turns=2, tool_calls=1),
               Sample([5, 6], [20, 21], [-0.3, -0.2], 0.0, 0, 1, FinishReason.STOP,
                      completion_mask=[1, 1], turns=1)]
    batch = RolloutBatch.from_samples(samples, policy_version=0)
    packed = pack(batch, np.arange(2), pad_id=0, device=torch.device("cpu"))
    assert packed.mask.tolist() == [mask, [1, 1, 0, 0, 0, 0, 0, 0, 0]]
    dropped = pack(batch, np.arange(1), pad_id=0, device=torch.device("cpu"), drop_truncated=True)
    assert dropped.mask.sum() == 5, "a finished sample keeps its model tokens"
