"""The PPO-clip policy loss with an optional k3 KL penalty, GRPO or Dr.GRPO aggregation.

Shapes: per-token tensors are [B, T] over completion tokens, `mask` [B, T] (1 = real token);
`advantages` [B]. Returns `(loss, metrics)` with a scalar loss. Pure: no config, no I/O.
"""

import torch


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    token_sum_norm: int | None = None,
    tis_cap: float | None = None,
):
    """PPO-clip on the importance ratio exp(logprobs - old_logprobs) against the generator's logprobs.

    Truncated importance sampling (`tis_cap` C): the trainer's logprobs before this update
    (`logprobs` detached: one optimizer step per batch) become the PPO reference, and each token's
    loss is weighted by w = min(exp(logprobs_before - old_logprobs), C), detached — the
    trainer/generator probability ratio, truncated so rare disagreements cannot blow up the step.

    Aggregation: `token_sum_norm=None` averages tokens within each sequence, then sequences (GRPO);
    an int L sums all tokens and divides by B x L (Dr.GRPO, L = the generation budget), which removes
    GRPO's bias toward short wrong answers. KL: k3 = exp(ref - new) - (ref - new) - 1 per token.
    """
    real = mask.bool()
    mask = mask.to(logprobs.dtype)
    # Padding positions may hold anything: zero them before exp, or inf * 0 = nan poisons the sum.
    tis = torch.ones_like(logprobs)
    if tis_cap is not None:
        before = logprobs.detach()
        tis = torch.exp(torch.where(real, before - old_logprobs, 0.0)).clamp(max=tis_cap)
        old_logprobs = before
    ratio = torch.exp(torch.where(real, logprobs - old_logprobs, 0.0))
    adv = advantages.unsqueeze(1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped) * tis
    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None:
        delta = torch.where(real, ref_logprobs - logprobs, 0.0)
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * kl
    loss = _aggregate(per_token, mask, token_sum_norm)
    with torch.no_grad():
        tokens = mask.sum().clamp(min=1)
        metrics = {
            "clip_frac": float(((unclipped != clipped).to(mask.dtype) * mask).sum() / tokens),
            "kl": float((kl * mask).sum() / tokens),
            "ratio_mean": float((ratio * mask).sum() / tokens),
        }
        if tis_cap is not None:
            metrics["tis_mean"] = float((tis * mask).sum() / tokens)
            metrics["tis_capped_frac"] = float(((tis >= tis_cap).to(mask.dtype) * mask).sum() / tokens)
    return loss, metrics


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, token_sum_norm: int | None) -> torch.Tensor:
    if token_sum_norm is None:
        per_sequence = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_sequence.mean()
    return (per_token * mask).sum() / (per_token.shape[0] * token_sum_norm)
