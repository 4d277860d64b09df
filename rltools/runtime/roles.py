"""What the generator and trainer roles must agree on, in one place.

Invariant: both roles derive these from the same resolved config, never from their own guesses:
the weight-sync world (trainer rank 0 + every vLLM worker), its backend, and which prompts of a step
each slot holds (group ids are global, so advantages group correctly).
"""

from ..config.schema import RLConfig


def sync_workers(config: RLConfig) -> int:
    """The generator workers of the weight-sync group: every TP worker of every configured engine
    (their fixed sync ranks are 1..this; trainer rank 0 is 0)."""
    return config.cluster.generators.ntasks * config.generator.tensor_parallel_size


def sync_rank_base(config: RLConfig, generator_rank: int) -> int:
    """Sync rank of TP worker 0 of `generator_rank`'s engine (its TP workers follow)."""
    return 1 + generator_rank * config.generator.tensor_parallel_size


def sync_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def gpu_index(local_rank: int, device_count: int, visible: str | None) -> int:
    """The CUDA device (an index among those this task sees) of the trainer with node-local rank
    `local_rank`. Two layouts work: Slurm binds one GPU to each task (`--gpus-per-task`, or
    CUDA_VISIBLE_DEVICES of one: device 0), or every task sees the node's GPUs (device `local_rank`).
    `visible`: CUDA_VISIBLE_DEVICES as the task got it, named in the error."""
    if device_count == 1:
        return 0
    if 0 <= local_rank < device_count:
        return local_rank
    raise RuntimeError(
        f"trainer with node-local rank {local_rank} sees {device_count} GPU(s) (CUDA_VISIBLE_DEVICES="
        f"{visible if visible is not None else 'unset'}): each trainer task needs a GPU of its own. Give the "
        "trainers as many GPUs per node as tasks (cluster.trainers.gpus_per_node >= ntasks_per_node), or bind "
        "one GPU per task")


def slots(config: RLConfig) -> int:
    """Parts of each step's prompts, one rollout shard each (generator.slots; default one per engine)."""
    return config.generator.slots or config.cluster.generators.ntasks


def prompt_share(config: RLConfig, slot: int) -> range:
    """Indices of the step's prompts in slot `slot`, whichever engine generates it."""
    return range(slot, config.schedule.prompts_per_step, slots(config))


def group_id(config: RLConfig, step: int, prompt_index: int, draw: int = 0) -> int:
    """Unique within a step's batch across generator ranks (and across steps, for draw 0); `draw`:
    the dynamic-sampling round that drew the prompt (0: the step's own prompts)."""
    return (draw * config.schedule.steps + step) * config.schedule.prompts_per_step + prompt_index


def sends_start_policy(config: RLConfig, start: int) -> bool:
    """Whether trainer rank 0 broadcasts policy version `start` (the steps its checkpoint holds)
    before it trains, and the generators take it before they sample: after a resume, and at step 0
    when `lora.init_from` gave the adapters their values (version 0 is then not the base model the
    generators loaded)."""
    return bool(start) or config.lora.init_from is not None


def eval_due(config: RLConfig, version: int) -> bool:
    """Whether policy version `version` (= optimizer steps done) is evaluated on the held-out set and
    exported to weights/step_<version>: before training, every schedule.eval_every steps, at the end."""
    every = config.schedule.eval_every
    return version == 0 or version == config.schedule.steps or bool(every and version % every == 0)
