"""The Megatron backend's process groups and the collectives it runs over them.

megatron-core lays trainer ranks out TP-innermost, then DP, then PP: the ranks of one pipeline
stage are contiguous, global rank 0 is (TP 0, DP 0, stage 0), and the last stage holds the loss.
MoE layers lay the ranks of a stage out again for their experts: EP innermost (expert tensor
parallelism is 1), then expert DP; each EP rank holds its contiguous block of the routed experts.

Invariants:
- `gather` is collective over this rank's TP group, `expert_shards` over its EP group;
  `to_first_stage` and `from_last_stage` over its pipeline group (the ranks with its TP and DP rank,
  one per stage). Every trainer rank calls them in the same order.
- `to_first_stage` streams: a later stage sends one tensor at a time and waits until it is taken,
  so the first stage never holds more than one of another stage's tensors besides what its own
  consumer keeps.
"""

from typing import Callable, Iterator

import torch
import torch.distributed as dist


def init_parallel(tensor_parallel: int, pipeline_parallel: int, seed: int, expert_parallel: int = 1) -> None:
    """megatron's process groups (torch.distributed must be initialised with more than one rank)."""
    from megatron.core import parallel_state, tensor_parallel as tp

    if not dist.is_initialized():  # one rank: megatron still wants a process group
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tensor_parallel,
                                             pipeline_model_parallel_size=pipeline_parallel,
                                             expert_model_parallel_size=expert_parallel,
                                             expert_tensor_parallel_size=1)
    tp.model_parallel_cuda_manual_seed(seed)


def tp_rank_size() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def pp_rank_size() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_world_size()


def ep_rank_size() -> tuple[int, int]:
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_model_parallel_world_size()


def expert_shards(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """Every EP rank's `tensor` (of the same shape), in EP rank order, one at a time: each is
    broadcast by its rank only when the consumer asks for it (collective over the EP group)."""
    from megatron.core import parallel_state

    rank, size = ep_rank_size()
    if size == 1:
        yield tensor.detach()
        return
    group = parallel_state.get_expert_model_parallel_group()
    for source in range(size):
        out = tensor.detach().contiguous() if source == rank else torch.empty_like(tensor)
        dist.broadcast(out, src=dist.get_global_rank(group, source), group=group)
        yield out


def shards(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every TP rank's `tensor`, in TP rank order (collective over the TP group)."""
    from megatron.core import parallel_state

    size = parallel_state.get_tensor_model_parallel_world_size()
    if size == 1:
        return [tensor.detach()]
    out = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(out, tensor.detach().contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return out


def gather(tensor: torch.Tensor, dim: int | None) -> torch.Tensor:
    """The full tensor from every TP rank's shard along `dim` (None: replicated, nothing to gather)."""
    return tensor.detach() if dim is None else torch.cat(shards(tensor), dim=dim)


def to_first_stage(items: Callable[[], Iterator[tuple[str, torch.Tensor]]],
                   device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Every stage's `items()`, in stage order, on global rank 0 (collective over trainer ranks).

    Each rank runs its own stage's `items()` (their TP collectives included); the (TP 0, DP 0)
    rank of a later stage sends each item to rank 0, which yields them after its own. Other ranks
    yield only their own stage's items, for a consumer that discards them."""
    from megatron.core import parallel_state

    stage, stages = pp_rank_size()
    if stages == 1 or stage == 0:
        yield from items()
        if dist.get_rank() == 0:
            for source in range(1, stages):
                yield from _receive(parallel_state.get_pipeline_model_parallel_group(), source, device)
        return
    sender = parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_data_parallel_rank() == 0
    for name, tensor in items():
        if sender:
            dist.send_object_list([(name, tensor.dtype, tuple(tensor.shape))], dst=0)
            dist.send(tensor.contiguous(), dst=0)
        yield name, tensor
    if sender:
        dist.send_object_list([None], dst=0)


def every_stage(items: list) -> list:
    """Every pipeline stage's `items` (small, picklable), concatenated in stage order (collective
    over this rank's pipeline group)."""
    from megatron.core import parallel_state

    stages = pp_rank_size()[1]
    if stages == 1:
        return items
    out = [None] * stages
    dist.all_gather_object(out, items, group=parallel_state.get_pipeline_model_parallel_group())
    return [item for stage_items in out for item in stage_items]


def _receive(group, stage: int, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    source = dist.get_global_rank(group, stage)
    while True:
        header = [None]
        dist.recv_object_list(header, src=source)
        if header[0] is None:
            return
        name, dtype, shape = header[0]
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(tensor, src=source)
        yield name, tensor


def from_last_stage(value):
    """The last pipeline stage's `value` (any picklable object) on every stage of this rank's
    pipeline (collective)."""
    from megatron.core import parallel_state

    stage, stages = pp_rank_size()
    if stages == 1:
        return value
    group = parallel_state.get_pipeline_model_parallel_group()
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, stages - 1), group=group)
    return box[0]


def sum_over_pipeline(value: torch.Tensor) -> torch.Tensor:
    """`value` summed over this rank's pipeline stages (collective)."""
    from megatron.core import parallel_state

    if pp_rank_size()[1] > 1:
        dist.all_reduce(value, group=parallel_state.get_pipeline_model_parallel_group())
    return value
