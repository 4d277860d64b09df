"""The `cluster:` section: where and how the job runs (Slurm or local, resources per hetjob
component, containers, preemption).

Invariant: as the rest of the schema, every key is declared here with its type and default.
"""

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from .types import (
    ContainerMount,
    EnvName,
    EnvPath,
    SbatchOption,
    SbatchValue,
    Section,
    ShellLine,
    SlurmMem,
    SlurmTime,
    SlurmWord,
)


class ComponentConfig(Section):
    nodes: int = Field(1, ge=1)
    """Nodes of this hetjob component."""
    ntasks_per_node: int = Field(1, ge=1)
    """Tasks (processes) per node: one per vLLM engine, or one per trainer rank."""
    gpus_per_node: int = Field(0, ge=0)
    """GPUs requested per node (0 on CPU partitions)."""
    cpus_per_task: int = Field(1, ge=1)
    """CPU cores per task."""
    mem: SlurmMem | None = None
    """Memory per node, e.g. 64G; 0 asks for all of it; unset uses the partition default."""
    partition: SlurmWord | None = None
    """Partition for this component; default cluster.partition."""

    @property
    def ntasks(self) -> int:
        return self.nodes * self.ntasks_per_node


class ContainerConfig(Section):
    runtime: Literal["none", "pyxis", "apptainer"] = "none"
    """none: tasks run on the nodes as they are; pyxis: each job step starts in an enroot container
    (srun --container-image); apptainer: each task runs under `apptainer exec`. Needs cluster.launcher:
    slurm. With none the other container keys are unused. Guide: docs/containers.md."""
    image: EnvPath | None = None
    """The image, with rltools (the version on the login node), its job dependencies and submitit
    installed. pyxis: an enroot URI like nvcr.io#nvidia/pytorch:25.01-py3 or a squashfs file's absolute
    path; apptainer: a .sif file's absolute path (or a docker:// URI)."""
    mounts: list[ContainerMount] = []
    """Extra bind mounts, each SRC:DST or SRC:DST:ro with absolute paths. The run directory (read-write),
    model.path and the data files' directories (read-only) are mounted at their own paths without
    being listed, unless a mount here already covers them."""
    workdir: EnvPath | None = None
    """Working directory of the tasks inside the container (absolute); default: the run directory."""
    python: str = "python3"
    """Interpreter inside the image that runs the role entry points (a name on the image's PATH or an
    absolute path); cluster.python names the login node's, which the image does not have."""

    @model_validator(mode="after")
    def _image_and_paths(self):
        if self.runtime != "none" and not self.image:
            raise ValueError(f"cluster.container.runtime: {self.runtime} needs cluster.container.image: the image to run in")
        for key, value in (("image", self.image), ("workdir", self.workdir), ("python", self.python)):
            if value is not None and (not value.strip() or "\n" in value or "\r" in value):
                raise ValueError(f"cluster.container.{key} must be one non-empty line, got {value!r}")
        if self.workdir and not self.workdir.startswith("/"):
            raise ValueError(f"cluster.container.workdir must be an absolute path, got {self.workdir!r}")
        return self


class ClusterConfig(Section):
    model_config = ConfigDict(coerce_numbers_to_str=True)  # environment: {OMP_NUM_THREADS: 1}

    launcher: Literal["slurm", "local"] = "local"
    """slurm: one heterogeneous Slurm job; local: processes on this machine, no Slurm."""
    partition: SlurmWord | None = None
    """Slurm partition (-p)."""
    account: SlurmWord | None = None
    """Slurm account (-A)."""
    qos: SlurmWord | None = None
    """Slurm QOS, e.g. a preemptible one."""
    time: SlurmTime = "01:00:00"
    """Wall-time limit of the job."""
    gpu_memory_gib: float | None = Field(None, gt=0)
    """Memory of one GPU in GiB (e.g. 80 for an H100 80GB, 139 for an H200). With it, submit and
    --dry-run judge the memory estimate per trainer rank and per generator GPU (docs/memory.md), and
    submit refuses a job that clearly does not fit; unset: the estimate is printed without a verdict."""
    generators: ComponentConfig = ComponentConfig()
    """Hetjob component 0: the vLLM generation engines."""
    trainers: ComponentConfig = ComponentConfig()
    """Hetjob component 1: the trainer ranks."""
    judges: ComponentConfig = ComponentConfig()
    """Hetjob component 2, only with a reward function of type judge: the judge model's vLLM engines
    (reward.judge), one per task; the generators send each scoring batch to them."""
    setup: list[ShellLine] = []
    """Shell lines run in the batch script before the job steps (module load, conda activate).
    They are your own shell code, run verbatim."""
    environment: dict[EnvName, str] = {}
    """Environment variables exported to every task (values are shell-quoted)."""
    python: EnvPath | None = None
    """Python interpreter that runs the role entry points; default: the one running rltools. In a
    container cluster.container.python runs them instead."""
    preempt_signal: Literal["USR1", "USR2", "TERM", "INT", "HUP"] = "USR2"
    """Signal Slurm sends to the tasks preempt_grace_s seconds before the time limit."""
    preempt_grace_s: int = Field(90, ge=10, le=65535)
    """Seconds between the warning signal and the kill: enough to write a checkpoint."""
    requeue: bool = True
    """Requeue the job after preemption or a wall-time stop, and resume from the checkpoint."""
    max_requeues: int = Field(3, ge=0)
    """Give up after this many restarts."""
    sbatch_extra: dict[SbatchOption, SbatchValue] = {}
    """Extra job-level sbatch options, e.g. {constraint: gpu, exclusive: ''} -> --constraint=gpu --exclusive."""
    container: ContainerConfig = ContainerConfig()
    """The container each task runs in (pyxis or apptainer); by default none."""

    @model_validator(mode="after")
    def _container_needs_slurm(self):
        if self.container.runtime != "none" and self.launcher == "local":
            raise ValueError(f"cluster.container.runtime: {self.container.runtime} needs cluster.launcher: slurm (the local "
                             "launcher starts plain processes here, without a container runtime); set cluster.launcher: "
                             "slurm, or cluster.container.runtime: none to run without the container")
        return self
