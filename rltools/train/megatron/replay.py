"""Routing replay on megatron's routers (`algorithm.routing_replay`): each MoE layer's router takes
the experts vLLM recorded for every token instead of its own top-k, and weights them as it weights
its own (sigmoid scores gathered at those experts, normalised, scaled), as the FSDP2 backend's
`train.routing.forced_routes` does.

It goes in by megatron's own hook: a router's `router_replay` object supplies the top-k
(`moe_utils.topk_routing_with_score_function` asks it). A recomputed layer (gradient checkpointing)
runs its forward again during backward, when later micro batches may have set other routes (1F1B
with pipeline stages): so each forward that autograd will recompute queues its routes, and a
forward run inside backward takes the oldest queued (backward visits a stage's micro batches in
the order their forwards ran).
"""

from collections import deque

import torch


class _Replay:
    """One router's replayed experts: `current` [tokens, top-k] for forwards, `queued` for recomputes."""

    def __init__(self):
        self.current: torch.Tensor | None = None
        self.queued: deque[torch.Tensor] = deque()

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if torch._C._current_graph_task_id() != -1 and self.queued:  # a recompute, inside backward
            target = self.queued.popleft()
        elif self.current is not None:
            target = self.current
        else:
            return default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if target.shape != (scores.shape[0], topk):
            raise ValueError(f"routing replay: experts for {tuple(target.shape)} tokens x top-k, the router "
                             f"routes {scores.shape[0]} x {topk}")
        target = target.to(scores.device)
        return scores.gather(1, target), target


def routers(gpt) -> list:
    """This stage's MoE routers, in layer order."""
    return [layer.mlp.router for layer in gpt.decoder.layers if hasattr(layer.mlp, "router")]


def set_routes(gpt, routes: torch.Tensor | None, moe_layers: list[int], *, recompute: bool) -> None:
    """Make the routers of `gpt` (this stage's, global MoE layer indices `moe_layers`) take `routes`
    [tokens as the router sees them, all MoE layers, top-k] in the next forward, or their own (None)."""
    for router, index in zip(routers(gpt), moe_layers, strict=True):
        if not isinstance(router.router_replay, _Replay):
            router.router_replay = _Replay()
        replay = router.router_replay
        replay.current = None if routes is None else routes[:, index].contiguous()
        if replay.current is not None and recompute and torch.is_grad_enabled():
            replay.queued.append(replay.current)
