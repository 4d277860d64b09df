"""How far two float32 runs of the same AdamW training may drift apart: a bound derived from the
arithmetic, so that it holds on any x86 host, not a difference seen on one.

The runs compared (Megatron at TP/DP/PP against FSDP2, two FSDP2 ranks against one, a resume at
another TP) compute the same gradients in another summation order. float32 rounds each addition
by at most u = 2^-24 = 6e-8 relative; in practice the errors of a long sum grow like sqrt(n) x u,
with n up to ~1e4 terms for one LoRA gradient here. Measured on this model: a float32 step's
gradients are within 2.6e-7 x |g|_2 of a float64 recomputation, coordinate by coordinate. Another
host's kernels (AVX-512 vs AVX2 blocking, another oneDNN path) sum in another order but with the
same u and the same magnitudes, so two runs differ by about twice that; Megatron's RoPE, which
rotates a left-padded row at positions shifted by its padding, adds ~1e-7 relative (float32
angles rounded at other points). So each gradient coordinate differs by

    delta <= GRAD_RTOL x |g|_2,    GRAD_RTOL = 1e-5: 20x the sum of those.

AdamW moves a weight by lr x m_hat / (sqrt(v_hat) + eps). m_hat is a convex combination of the
gradients so far and sqrt(v_hat) their weighted RMS: both move by at most delta; and |m_hat| <=
1.01 sqrt(v_hat) over the first five steps (Cauchy-Schwarz, betas 0.9/0.999). So one step moves
by at most 2.01 x lr x delta / eps more. With torch's eps = 1e-8 that gain is lr / eps = 1e6: a
weight whose gradient happens to be ~1e-8 turns 1e-11 of summation noise into 1e-5, and which
weights sit there depends on the host (hardening item 18: up to 1.8e-5 on a Xeon, where this
machine saw 3.4e-6). The tests set eps = ADAM_EPS = 1e-3, capping the gain at lr / eps = 10:
Adam still moves the adapters with gradients above 1e-3 by ~lr. Both backends step the Trainer's
own AdamW, so its eps is no part of what the comparisons check. What the first-order bound leaves
out, later steps' gradients taken at weights already <= 20 delta apart, is second order and well
inside the margin.

Measured (two steps; the bound is 1.0e-5): Megatron's adapters are within 2e-8 of FSDP2's, two
FSDP2 ranks' within 7e-9 of one rank's (with torch's eps: 7.7e-6). A learning rate 1% off moves them
by 1.7e-4, a dropped micro batch by 4.7e-3; `assert_runs_agree` checks that the bound stays below 1%
of the update.
"""

import torch

ADAM_EPS = 1e-3
GRAD_RTOL = 1e-5
_STEP_GAIN = 2.01  # 1 + max |m_hat| / sqrt(v_hat) over AdamW's first five steps


def condition(trainer):
    """Give the trainer's AdamW eps = ADAM_EPS (see the module docstring); returns the trainer."""
    for group in trainer.optimizer.param_groups:
        group["eps"] = ADAM_EPS
    return trainer


def adapter_atol(lr: float, grad_norms: list[float]) -> float:
    """Largest difference of an adapter weight between two runs after the AdamW steps whose
    (pre-clipping) gradient norms are `grad_norms`: each step adds its own bound, with the largest
    delta of the gradients in its moments so far."""
    return sum(_STEP_GAIN * lr / ADAM_EPS * GRAD_RTOL * max(grad_norms[: t + 1]) for t in range(len(grad_norms)))


def assert_runs_agree(ours: dict, theirs: dict, *, lr: float, grad_norms: list[float], lora_scale: float,
                      lora_rank: int) -> None:
    """Adapters ("adapter": PEFT name -> tensor) within `adapter_atol`; merged weights ("weights",
    W + scale x B @ A in float32) within what that moves B @ A, plus the float32 rounding of W + delta."""
    atol = adapter_atol(lr, grad_norms)
    moved = max(t.abs().max().item() for n, t in theirs["adapter"].items() if ".lora_B." in n)  # B starts at 0
    assert atol < 0.01 * moved, f"a bound of {atol:.1e} would miss a 1% error in updates of {moved:.1e}"
    assert ours["adapter"].keys() == theirs["adapter"].keys()
    for name, tensor in theirs["adapter"].items():
        torch.testing.assert_close(ours["adapter"][name], tensor, rtol=0, atol=atol)
    largest = max(t.abs().max().item() for t in theirs["adapter"].values())
    merged_atol = lora_scale * lora_rank * (2 * largest + atol) * atol  # |dB||A| + |B||dA| over the rank
    assert ours["weights"].keys() == theirs["weights"].keys()
    for name, tensor in theirs["weights"].items():
        torch.testing.assert_close(ours["weights"][name], tensor, rtol=2**-22, atol=merged_atol)
