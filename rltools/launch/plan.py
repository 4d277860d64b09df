"""The job's topology: which hetjob component runs which role, on how many tasks.

Invariant: component 0 is always the generators and component 1 the trainers, for the Slurm and
the local launcher alike; RoleEnv relies on these indices to find trainer rank 0. A judge (a reward
function of type judge) is component 2.
"""

from dataclasses import dataclass

from ..config.schema import ComponentConfig, RLConfig
from ..config.support import megatron_unsupported
from ..errors import UserError
from ..runtime.role_env import GENERATOR_GROUP, JUDGE_GROUP, TRAINER_GROUP
from .memory import memory_lines


@dataclass(frozen=True)
class Component:
    index: int
    """Hetjob component index (`srun --het-group=<index>`)."""
    name: str
    """Config key under `cluster:` (generators / trainers / judges)."""
    role: str
    """Role of each task: generator, trainer or judge."""
    entry: str
    """Python module each task runs (`python -m <entry> RUN_DIR`)."""
    resources: ComponentConfig


def plan(config: RLConfig, entries: dict[str, str] | None = None) -> list[Component]:
    """The components of the job (a judge's with a reward function of type judge), after checking that
    the shapes fit together.

    `entries` replaces a role's entry module (e.g. the cluster self-check instead of the RL loop).
    """
    entries = {"generator": "rltools.jobs.generator", "trainer": "rltools.jobs.trainer", "judge": "rltools.jobs.judge",
               **(entries or {})}
    components = [
        Component(GENERATOR_GROUP, "generators", "generator", entries["generator"], config.cluster.generators),
        Component(TRAINER_GROUP, "trainers", "trainer", entries["trainer"], config.cluster.trainers),
    ]
    if config.reward.uses_judge:
        components.append(Component(JUDGE_GROUP, "judges", "judge", entries["judge"], config.cluster.judges))
    check_topology(config)
    return components


def check_topology(config: RLConfig) -> None:
    gens, trainers = config.cluster.generators, config.cluster.trainers
    _check_engines("generators", gens, "generator.tensor_parallel_size", config.generator.tensor_parallel_size)
    if config.reward.uses_judge:
        _check_engines("judges", config.cluster.judges, "reward.judge.tensor_parallel_size",
                       config.reward.judge.tensor_parallel_size)
    if trainers.gpus_per_node and trainers.ntasks_per_node != trainers.gpus_per_node:
        raise UserError(
            f"cluster.trainers.ntasks_per_node ({trainers.ntasks_per_node}) must equal "
            f"cluster.trainers.gpus_per_node ({trainers.gpus_per_node}): one trainer rank per GPU"
        )
    samples = config.schedule.prompts_per_step * config.schedule.group_size
    if samples % trainers.ntasks:
        raise UserError(
            f"schedule.prompts_per_step x schedule.group_size = {samples} samples per step do not split evenly "
            f"over {trainers.ntasks} trainer ranks; make it a multiple of the trainer rank count"
        )
    if config.schedule.prompts_per_step < gens.ntasks:
        raise UserError(
            f"schedule.prompts_per_step ({config.schedule.prompts_per_step}) is smaller than the number of "
            f"generators ({gens.ntasks}): some generators would have nothing to sample"
        )
    t = config.trainer
    model_parallel = t.tensor_parallel * t.pipeline_parallel
    if trainers.ntasks % model_parallel:
        raise UserError(
            f"trainer ranks ({trainers.ntasks}) must be a multiple of trainer.tensor_parallel x "
            f"trainer.pipeline_parallel ({model_parallel})"
        )
    missing = megatron_unsupported(config) if t.backend == "megatron" else []
    if missing:  # at submit time: not after the job waited in the queue for its nodes
        raise UserError("trainer.backend: megatron does not support " + "; ".join(missing) + " yet — use trainer.backend: fsdp2")


def _check_engines(name: str, component: ComponentConfig, tp_key: str, tp: int) -> None:
    """A component of vLLM engines (one a task, `tp` GPUs each) asks for exactly the GPUs its engines use."""
    if component.gpus_per_node and component.ntasks_per_node * tp != component.gpus_per_node:
        raise UserError(
            f"cluster.{name}: {component.ntasks_per_node} engine(s) per node x {tp_key} {tp} "
            f"= {component.ntasks_per_node * tp} GPUs, but gpus_per_node is {component.gpus_per_node}; "
            f"set cluster.{name}.ntasks_per_node to {max(1, component.gpus_per_node // tp)}"
        )


def describe(config: RLConfig, components: list[Component]) -> str:
    """A few lines a user reads before trusting the job: who runs where, on what."""
    lines = [f"run {config.run.name}: {config.run.dir}"]
    for c in components:
        r = c.resources
        gpus = f", {r.gpus_per_node} GPU(s)/node" if r.gpus_per_node else ", CPU only"
        lines.append(
            f"  component {c.index} {c.name}: {r.nodes} node(s) x {r.ntasks_per_node} task(s){gpus}, "
            f"{r.cpus_per_task} CPU(s)/task -> {r.ntasks} {c.role}(s) running {c.entry}"
        )
    g, t, s = config.generator, config.trainer, config.schedule
    lines.append(
        f"  generation: {g.backend}, TP {g.tensor_parallel_size}; training: {t.backend}"
        + (f", TP {t.tensor_parallel} PP {t.pipeline_parallel} EP {t.expert_parallel}" if t.backend == "megatron" else "")
        + (f", LoRA r={config.lora.rank}" if config.lora.enabled else ", full fine-tuning")
    )
    lines.append(
        f"  schedule: {s.steps} steps x {s.prompts_per_step} prompts x {s.group_size} samples, "
        f"max_staleness {s.max_staleness}, checkpoint every {s.checkpoint_every}"
    )
    lines += memory_lines(config)
    return "\n".join(lines)
