"""`cluster.container` as what it adds to a job step: pyxis `srun --container-*` options, or an
`apptainer exec` prefix to the task's command. Plain data for the job script and the submitit executors.

Invariant: inside the container every path of the config means what it means on the login node: the
run directory, the model and the data files are mounted at their own paths. Only the tasks run in
the container; the job script's own work (the run lock, the logs, the exit files) stays in the batch
shell. Both runtimes pass the task's environment through (RLTOOLS_*, SLURM_*, cluster.environment).
"""

import re
from pathlib import PurePosixPath

from ..config.schema import RLConfig
from ..errors import UserError

# Both runtimes split a mount list at commas and a mount at colons.
_UNMOUNTABLE = re.compile(r"[\s,:'\"\\]")


def python(config: RLConfig) -> str:
    """The interpreter that runs the role entry points: the image's in a container, else cluster.python."""
    container = config.cluster.container
    return container.python if container.runtime != "none" else str(config.cluster.python)


def srun_options(config: RLConfig) -> list[tuple[str, str]]:
    """pyxis: (option, value) pairs for each job step's srun line; the caller shell-quotes the values."""
    container = config.cluster.container
    if container.runtime != "pyxis":
        return []
    return [
        ("--container-image", container.image),
        ("--container-mounts", ",".join(mounts(config))),
        ("--container-workdir", container.workdir or str(config.run.dir)),
    ]


def exec_prefix(config: RLConfig, gpus: bool) -> list[str]:
    """apptainer: the words before a task's command (`--nv` maps the GPUs in, for a component that has them)."""
    container = config.cluster.container
    if container.runtime != "apptainer":
        return []
    nv = ["--nv"] if gpus else []
    return ["apptainer", "exec", *nv, "--bind", ",".join(mounts(config)),
            "--pwd", container.workdir or str(config.run.dir), container.image]


def mounts(config: RLConfig) -> list[str]:
    """cluster.container.mounts plus what the job reads and writes, each at its own path: the run
    directory (read-write), the model and the directories of what the job reads (`RLConfig.input_paths`:
    data, eval sets, a chat template, lora.init_from; read-only), each left out
    where a mount already covers its path. Parents come before their children."""
    found = list(config.cluster.container.mounts)
    needed = [("run.dir", str(config.run.dir), ""), ("model.path", config.model.path, ":ro")]
    needed += [(key, str(PurePosixPath(path).parent), ":ro") for key, path in config.input_paths()]
    for key, path, flags in needed:
        if any(_under(path, spec.split(":")[1]) for spec in found):
            continue
        if _UNMOUNTABLE.search(path):
            raise UserError(
                f"{key} {path!r} cannot be mounted into the container (cluster.container): the runtimes split "
                "mounts at spaces, commas and colons; move it to a path without them, or mount a directory "
                "above it yourself in cluster.container.mounts"
            )
        found.append(f"{path}:{path}{flags}")
    return sorted(found, key=lambda spec: len(PurePosixPath(spec.split(":")[1]).parts))


def _under(path: str, top: str) -> bool:
    return PurePosixPath(path).is_relative_to(top)
