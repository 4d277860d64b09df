"""The learning rate of each optimizer update: a warm-up, then constant, linear or cosine decay.

Invariant: the learning rate is a pure function of the update's number in the run and the run's
length, so it needs no state of its own: a resumed run (whose checkpoint holds the steps done)
computes the same value as an uninterrupted one. Light (no torch): `rltools resume` prints what a
new `schedule.steps` does to it.

The clock counts optimizer updates: step k's mini-batch i (of `algorithm.mini_batches`) is update
k x mini_batches + i; the warm-up and the horizon are given in steps (`algorithm.lr_warmup_steps`,
`schedule.steps`) and scaled the same way, so within a step the rate moves from one mini-batch to
the next as it would with one update per step.
"""

import math

from .schema import AlgorithmConfig


def learning_rate(update: int, *, peak: float, kind: str, warmup_steps: int, total_steps: int | None,
                  min_ratio: float, per_step: int = 1) -> float:
    """The learning rate of optimizer update `update` (0-based over the run, `per_step` a step).

    The warm-up rises linearly over `warmup_steps` steps, reaching `peak` at its last update
    (update u gets peak x (u + 1) / warm-up updates: never 0). Then `kind`: constant stays at `peak`;
    linear and cosine decay from `peak` at the warm-up's end towards `min_ratio` x `peak` at the end
    of `total_steps` (reached only by an update past the end; a constant rate needs no `total_steps`)."""
    warmup = warmup_steps * per_step
    if update < warmup:
        return peak * (update + 1) / warmup
    if kind == "constant":
        return peak
    total = total_steps * per_step
    progress = min(1.0, (update - warmup) / max(1, total - warmup))
    if kind == "linear":
        shape = 1.0 - progress
    elif kind == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"unknown learning-rate schedule {kind!r}: expected constant, linear or cosine")
    return peak * (min_ratio + (1.0 - min_ratio) * shape)


def rate_at(algorithm: AlgorithmConfig, total_steps: int | None, update: int) -> float:
    """`learning_rate` of update `update` of a run of `total_steps` steps trained with `algorithm`."""
    return learning_rate(update, peak=algorithm.learning_rate, kind=algorithm.lr_schedule,
                         warmup_steps=algorithm.lr_warmup_steps, total_steps=total_steps,
                         min_ratio=algorithm.min_lr_ratio, per_step=algorithm.mini_batches)
