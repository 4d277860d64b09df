"""Turning rollouts into tensors, and a model's per-token logprobs of the completions.

Samples of one group share their prompt, so each distinct prompt is run once: its KV cache is
computed (with gradients) for the distinct prompts, then gathered to every sample, and only the
completion tokens are run on top. For G samples per prompt this cuts the tokens processed by
roughly G x prompt length — most of a step's compute when completions are short.

Invariant: completion token j of sample i is scored by the logits that predict it (the prompt's
last position for j = 0), so the result aligns one-to-one with `RolloutBatch.completion_logprobs`.

A batch that carries routed experts (routing replay, `train.routing`) is packed with them laid out
like the two forwards' token ids; each forward's routers then pick those experts.
"""

from dataclasses import dataclass

import numpy as np
import torch

from ..rollout import FinishReason, RolloutBatch
from .routing import forced_routes


@dataclass
class Packed:
    prompt_ids: torch.Tensor  # [P, Lp] distinct prompts, left-padded so they all end at column Lp-1
    prompt_mask: torch.Tensor  # [P, Lp]
    prompt_of: torch.Tensor  # [B] row of each sample's prompt in prompt_ids
    completion_ids: torch.Tensor  # [B, T] right-padded
    mask: torch.Tensor  # [B, T] 1 for real completion tokens (float)
    old_logprobs: torch.Tensor  # [B, T] the generator's logprobs
    proximal_logprobs: torch.Tensor | None = None  # [B, T] the trainer's before the step's first update
    prompt_routes: torch.Tensor | None = None  # [P, Lp, MoE layers, top-k] experts of each prompt token
    completion_routes: torch.Tensor | None = None  # [B, T, MoE layers, top-k] of each completion token run


def pack(batch: RolloutBatch, indices: np.ndarray, pad_id: int, device: torch.device,
         proximal: np.ndarray | None = None, drop_truncated: bool = False) -> Packed:
    """`indices`' samples as tensors. `proximal`: logprobs laid out like `batch.completion_logprobs`;
    `drop_truncated`: answers cut at the token budget get no real tokens in `mask` (DAPO's
    overlong filtering)."""
    rows: dict[tuple, int] = {}
    prompt_of = [rows.setdefault(tuple(batch.prompt(i).tolist()), len(rows)) for i in indices]
    width = max(len(p) for p in rows)
    prompt_ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    prompt_mask = np.zeros((len(rows), width), dtype=np.int64)
    for prompt, row in rows.items():
        prompt_ids[row, width - len(prompt) :] = prompt
        prompt_mask[row, width - len(prompt) :] = 1
    steps = max(1, max(len(batch.completion(i)) for i in indices))
    completion_ids = np.full((len(indices), steps), pad_id, dtype=np.int64)
    mask = np.zeros((len(indices), steps), dtype=np.float32)
    old = np.zeros((len(indices), steps), dtype=np.float32)
    near = None if proximal is None else np.zeros((len(indices), steps), dtype=np.float32)
    for row, i in enumerate(indices):
        c = len(batch.completion(i))
        completion_ids[row, :c] = batch.completion(i)
        # an environment's tokens (multi-turn) are never trained on; nor, with drop_truncated, a cut answer
        mask[row, :c] = 0.0 if drop_truncated and batch.finish_reasons[i] == FinishReason.LENGTH else batch.trained_mask(i)
        old[row, :c] = batch.logprobs(i)
        if near is not None:
            near[row, :c] = proximal[batch.completion_offsets[i] : batch.completion_offsets[i + 1]]
    as_tensor = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    routes = _routes(batch, indices, rows, prompt_of, width, steps) if batch.routed_experts is not None else (None, None)
    return Packed(
        as_tensor(prompt_ids), as_tensor(prompt_mask), as_tensor(np.array(prompt_of, dtype=np.int64)),
        as_tensor(completion_ids), as_tensor(mask), as_tensor(old), None if near is None else as_tensor(near),
        *(None if r is None else as_tensor(r) for r in routes),
    )


def _routes(batch: RolloutBatch, indices, rows: dict, prompt_of: list, width: int, steps: int):
    """The samples' routed experts laid out as `pack` lays out the tokens: a prompt's from its first
    sample (they share it), completion token j's (as input) from row len(prompt) + j. Padding, and the
    last completion token (sampled, never run by the generator, and predicting nothing here), take
    experts 0..k-1: their outputs reach no scored token."""
    layers, top_k = batch.routed_experts.shape[1:]
    filler = np.broadcast_to(np.arange(top_k, dtype=np.int64), (layers, top_k))
    prompt_routes = np.tile(filler, (len(rows), width, 1, 1))
    completion_routes = np.tile(filler, (len(indices), steps, 1, 1))
    done = set()
    for slot, i in enumerate(indices):
        routes, prompt_len = batch.routes(i), len(batch.prompt(i))
        if prompt_of[slot] not in done:
            done.add(prompt_of[slot])
            prompt_routes[prompt_of[slot], width - prompt_len:] = routes[:prompt_len]
        ran = routes[prompt_len:]  # completion tokens 0 .. c-2
        completion_routes[slot, : len(ran)] = ran
    return prompt_routes, completion_routes


def completion_logprobs(model, packed: Packed, temperature: float = 1.0, with_entropy: bool = False):
    """Per-token logprobs [B, T] of the completion tokens (and their entropies [B, T] if asked).

    Logits are divided by the sampling temperature, as vLLM's processed logprobs are: the ratio
    then compares the distribution that was actually sampled.
    """
    positions = (packed.prompt_mask.cumsum(1) - 1).clamp(min=0)
    with forced_routes(model, _flat(packed.prompt_routes)):
        prompt = model(
            input_ids=packed.prompt_ids, attention_mask=packed.prompt_mask, position_ids=positions, use_cache=True
        )
    cache = prompt.past_key_values
    cache.reorder_cache(packed.prompt_of)  # differentiable gather: one cache row per sample
    lengths = packed.prompt_mask.sum(1)[packed.prompt_of]
    steps = packed.completion_ids.shape[1]
    attention = torch.cat([packed.prompt_mask[packed.prompt_of], packed.mask.to(packed.prompt_mask.dtype)], dim=1)
    attention[:, packed.prompt_mask.shape[1]] = 1  # a sample with an empty completion still has one query
    with forced_routes(model, _flat(packed.completion_routes)):
        completion = model(
            input_ids=packed.completion_ids,
            attention_mask=attention,
            position_ids=lengths.unsqueeze(1) + torch.arange(steps, device=lengths.device),
            past_key_values=cache,
            use_cache=True,
        )
    first = prompt.logits[:, -1][packed.prompt_of].unsqueeze(1)  # predicts completion token 0
    logits = torch.cat([first, completion.logits[:, :-1]], dim=1)
    return token_logprobs(logits, packed.completion_ids, temperature, with_entropy)


def _flat(routes: torch.Tensor | None) -> torch.Tensor | None:
    return None if routes is None else routes.flatten(0, 1)  # [rows x columns, MoE layers, top-k]


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float, with_entropy: bool):
    """logprobs [B, T] of `ids` [B, T] under `logits` [B, T, V] (position t predicts ids[:, t]) at the
    sampling temperature, and the entropies [B, T] if asked (else None)."""
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    result = logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return result, None
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return result, entropy
