"""Policy losses: PPO-clip (GRPO, Dr.GRPO, DAPO), GSPO's sequence-level ratio, CISPO's clipped
importance weights; an optional k3 KL penalty; three ways to aggregate tokens.

Shapes: per-token tensors are [B, T] over completion tokens, `mask` [B, T] (1 = real token);
`advantages` [B]. Returns `(loss, metrics)` with a scalar loss. Pure: no config, no I/O.

Notation: logp = the trainer's logprobs (with gradient), b = the behaviour policy's (the generator
that sampled), p = the proximal policy's (the trainer's own before this step's first update, when
given: `proximal_logprobs`; else b). Token ratio r_t = exp(logp_t - p_t); A = the sample's advantage;
sg = stop-gradient; clip(x) = clamp(x, 1 - clip_low, 1 + clip_high).

- ppo (GRPO, Dr.GRPO, DAPO):  l_t = -min(r_t A, clip(r_t) A)
- gspo (Zheng et al. 2025, arXiv:2507.18071, in its GSPO-token form, which equals GSPO for one
  advantage per sequence):  s = exp(mean_t(logp_t - p_t)) over the sequence's tokens,
  s_t = sg(s) * exp(logp_t - sg(logp_t)) (value s, gradient of the token's own logprob),
  l_t = -min(s_t A, clip(s_t) A): the clip keeps or drops whole sequences.
- cispo (MiniMax-M1, arXiv:2506.13585):  l_t = -sg(clip(r_t)) A logp_t: every token keeps a
  gradient; the clipped ratio only weights it.

Truncated importance sampling / decoupled PPO (`tis_cap` C): each token's loss is multiplied by
w_t = min(exp(p_t - b_t), C), detached: the proximal policy is the PPO anchor and w corrects for
the behaviour policy being another one (an older version under `max_staleness`, other numerics on
GPU). Without `proximal_logprobs` it is the trainer's current logprobs, detached (right for one
optimizer step per batch).

Aggregation: "sequence" averages tokens within each sequence, then sequences (GRPO, GSPO);
"token" averages all tokens of the batch (DAPO, CISPO); "budget" sums all tokens and divides by
B x `budget` (Dr.GRPO, budget = the generation budget: no bias toward short wrong answers). With
micro batches the trainer passes `budget` for "token" too: the batch's mean tokens per sample, so
that micro batches weighted by their share of samples give the batch's token mean.
KL: k3 = exp(ref - logp) - (ref - logp) - 1 per token.
"""

import torch

OBJECTIVES = ("ppo", "gspo", "cispo")
AGGREGATIONS = ("sequence", "token", "budget")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    objective: str = "ppo",
    aggregation: str = "sequence",
    budget: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    tis_cap: float | None = None,
    proximal_logprobs: torch.Tensor | None = None,
):
    """The loss of one (micro) batch and its metrics; see the module docstring for the formulas.
    `old_logprobs` are the behaviour policy's (the generator's) logprobs."""
    if objective not in OBJECTIVES or aggregation not in AGGREGATIONS:
        raise ValueError(f"objective {objective!r} / aggregation {aggregation!r}: expected {OBJECTIVES} / {AGGREGATIONS}")
    real = mask.bool()
    mask = mask.to(logprobs.dtype)
    # Padding positions may hold anything: zero them before exp, or inf * 0 = nan poisons the sum.
    weight = torch.ones_like(logprobs)
    anchor = old_logprobs
    if tis_cap is not None:
        anchor = logprobs.detach() if proximal_logprobs is None else proximal_logprobs
        weight = torch.exp(torch.where(real, anchor - old_logprobs, 0.0)).clamp(max=tis_cap)
    elif proximal_logprobs is not None:
        anchor = proximal_logprobs
    log_ratio = torch.where(real, logprobs - anchor, 0.0)
    adv = advantages.unsqueeze(1)
    if objective == "gspo":
        sequence = (log_ratio * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
        ratio = torch.exp(sequence.detach() + logprobs - logprobs.detach())
    else:
        ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    if objective == "cispo":
        per_token = -clipped_ratio.detach() * adv * torch.where(real, logprobs, 0.0)
        clipped = clipped_ratio != ratio
    else:
        unclipped, kept = ratio * adv, clipped_ratio * adv
        per_token = -torch.minimum(unclipped, kept)
        clipped = unclipped != kept
    per_token = per_token * weight
    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None:
        delta = torch.where(real, ref_logprobs - logprobs, 0.0)
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * kl
    loss = _aggregate(per_token, mask, aggregation, budget)
    with torch.no_grad():
        tokens = mask.sum().clamp(min=1)
        metrics = {
            "clip_frac": float((clipped.to(mask.dtype) * mask).sum() / tokens),
            "kl": float((kl * mask).sum() / tokens),
            "ratio_mean": float((ratio * mask).sum() / tokens),
        }
        if tis_cap is not None:
            metrics["tis_mean"] = float((weight * mask).sum() / tokens)
            metrics["tis_capped_frac"] = float(((weight >= tis_cap).to(mask.dtype) * mask).sum() / tokens)
    return loss, metrics


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str, budget: float | None) -> torch.Tensor:
    if aggregation == "sequence":
        per_sequence = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_sequence.mean()
    if budget is None:
        if aggregation == "budget":
            raise ValueError("aggregation 'budget' needs the budget (tokens per sample)")
        return (per_token * mask).sum() / mask.sum().clamp(min=1)  # "token", over this batch alone
    return (per_token * mask).sum() / (per_token.shape[0] * budget)
