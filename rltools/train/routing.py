"""Routing replay (`algorithm.routing_replay`): the trainer routes each token of a MoE model to the
experts the generator routed it to.

Why: a MoE router picks its top-k experts from scores that two implementations (vLLM's kernels,
the trainer's) compute slightly differently; where two experts' scores nearly tie, they pick
different experts, and the token's logprob then differs by far more than rounding. Replaying the
generator's choice removes that part of the train/inference gap; the routing weights are still the
trainer's own scores at those experts, so the computation stays differentiable as before.

How: the rollout carries each token's experts (`RolloutBatch.routed_experts`, from vLLM's
`enable_return_routed_experts`), `logprobs.pack` lays them out like the token ids of each forward,
and `forced_routes` has every router return them for that forward. Routers are transformers'
`DeepseekV3TopkRouter` layout (sigmoid scores, correction bias for the choice only, optional
normalisation, routed scaling factor). Under activation checkpointing a layer's recompute in
backward runs with the routes its forward had (`pinned`).
"""

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn

_FORCED = "_rltools_forced_routes"


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The MoE routers in layer order."""
    return [module for module in model.modules() if type(module).__name__.endswith("TopkRouter")]


@contextlib.contextmanager
def forced_routes(model: nn.Module, routes: torch.Tensor | None):
    """Within: every router of `model` picks the experts in `routes` [tokens, MoE layers, top-k] (the
    forward's tokens flattened batch-major, as the router sees them); routes None: the routers' own."""
    if routes is None:
        yield
        return
    routers = moe_routers(model)
    if routes.shape[1] != len(routers):
        raise ValueError(f"routing replay: the rollouts route {routes.shape[1]} MoE layers, the model has {len(routers)}: "
                         "generator and trainer serve different models (model.path)")
    for index, router in enumerate(routers):
        if not hasattr(router, _FORCED):
            router.forward = functools.partial(_routed, router, router.forward)
        setattr(router, _FORCED, routes[:, index])
    try:
        yield
    finally:
        for router in routers:
            setattr(router, _FORCED, None)


def _routed(router: nn.Module, natural, hidden_states: torch.Tensor):
    forced = getattr(router, _FORCED)
    if forced is None:
        return natural(hidden_states)
    hidden_states = hidden_states.view(-1, router.hidden_dim)
    if forced.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"routing replay: {forced.shape[0]} routed tokens for a forward of {hidden_states.shape[0]}")
    logits = F.linear(hidden_states.type(torch.float32), router.weight.type(torch.float32))
    weights = logits.sigmoid().gather(1, forced)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, weights * router.routed_scaling_factor, forced


def pinned(layer: nn.Module, forward):
    """`forward` of `layer`, run with the routes its routers have now, whenever it is called: the
    recompute of a checkpointed layer in backward happens after `forced_routes` has exited."""
    routers = [module for module in layer.modules() if getattr(module, _FORCED, None) is not None]
    if not routers:
        return forward
    routes = [getattr(router, _FORCED) for router in routers]

    def run(*args, **kwargs):
        previous = [getattr(router, _FORCED) for router in routers]
        for router, forced in zip(routers, routes):
            setattr(router, _FORCED, forced)
        try:
            return forward(*args, **kwargs)
        finally:
            for router, forced in zip(routers, previous):
                setattr(router, _FORCED, forced)

    return run


@contextlib.contextmanager
def recorded_routes(model: nn.Module):
    """Within: each router call appends the experts it picked [tokens, top-k] to the yielded list of
    per-router lists (what a generator records, for tests and measurements)."""
    routers = moe_routers(model)
    calls: list[list[torch.Tensor]] = [[] for _ in routers]
    hooks = [router.register_forward_hook(lambda module, args, out, i=i: calls[i].append(out[2].detach()))
             for i, router in enumerate(routers)]
    try:
        yield calls
    finally:
        for hook in hooks:
            hook.remove()
