"""Turning rollouts into padded tensors, and a model's per-token logprobs of the completions.

Invariant: completion token j of sample i (at sequence position P_i + j) is scored by the logits at
position P_i + j - 1, so the result aligns one-to-one with `RolloutBatch.completion_logprobs`.
"""

from dataclasses import dataclass

import numpy as np
import torch

from ..rollout import RolloutBatch


@dataclass
class Packed:
    input_ids: torch.Tensor  # [B, L] prompt + completion, right-padded
    attention_mask: torch.Tensor  # [B, L]
    positions: torch.Tensor  # [B, T] index into the next-token logprobs for each completion token
    mask: torch.Tensor  # [B, T] 1 for real completion tokens
    old_logprobs: torch.Tensor  # [B, T] the generator's logprobs


def pack(batch: RolloutBatch, indices: np.ndarray, pad_id: int, device: torch.device) -> Packed:
    prompts = [batch.prompt(i) for i in indices]
    completions = [batch.completion(i) for i in indices]
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions)]
    width, steps = max(lengths), max(1, max(len(c) for c in completions))
    input_ids = np.full((len(indices), width), pad_id, dtype=np.int64)
    attention = np.zeros((len(indices), width), dtype=np.int64)
    positions = np.zeros((len(indices), steps), dtype=np.int64)
    mask = np.zeros((len(indices), steps), dtype=np.float32)
    old = np.zeros((len(indices), steps), dtype=np.float32)
    for row, (i, prompt, completion) in enumerate(zip(indices, prompts, completions)):
        p, c = len(prompt), len(completion)
        input_ids[row, :p] = prompt
        input_ids[row, p : p + c] = completion
        attention[row, : p + c] = 1
        positions[row, :c] = np.arange(p - 1, p - 1 + c)
        mask[row, :c] = 1.0
        old[row, :c] = batch.logprobs(i)
    as_tensor = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    return Packed(as_tensor(input_ids), as_tensor(attention), as_tensor(positions), as_tensor(mask), as_tensor(old))


def completion_logprobs(model, packed: Packed, temperature: float = 1.0, with_entropy: bool = False):
    """Per-token logprobs [B, T] of the completion tokens (and their entropies [B, T] if asked).

    Logits are divided by the sampling temperature, as vLLM's processed logprobs are: the ratio
    then compares the distribution that was actually sampled.
    """
    logits = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask).logits
    logits = logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    next_tokens = packed.input_ids[:, 1:].unsqueeze(-1)
    token_logp = logp.gather(-1, next_tokens).squeeze(-1)  # [B, L-1]
    positions = packed.positions.clamp(max=token_logp.shape[1] - 1)
    result = token_logp.gather(1, positions)
    if not with_entropy:
        return result, None
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1).gather(1, positions)
    return result, entropy
