"""Render the heterogeneous sbatch script from `templates/sbatch/` — a pure function of the config.

Invariant: config values reach the script only as validated `#SBATCH` words (checked by the config
types, plus the run-directory check below) or shell-quoted: through the template's `q` filter, or by
`shlex.quote` for the words of a task's command (`cluster.container`: see `launch.container`).
The user's `cluster.setup` lines are the one exception: they are the user's own shell code.
"""

import re
import shlex
from pathlib import Path

import jinja2

from .. import __version__
from ..config.schema import RLConfig
from ..errors import UserError
from ..paths import RunPaths
from . import container
from .plan import Component, plan

# rltools/templates links to the top-level templates/ in a checkout and is a real directory in a wheel.
TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "templates" / "sbatch"
TEMPLATE = "rl_job.sbatch.j2"

# `#SBATCH --output=PATH` is parsed by Slurm, not the shell: no quoting is possible there, so the run
# directory must be one word; `%` would be taken as a Slurm filename pattern.
_SBATCH_PATH = re.compile(r"[^\s'\"\\%]+")


def render_sbatch(
    config: RLConfig, entries: dict[str, str] | None = None, commands: dict[str, list[str]] | None = None
) -> str:
    """The job script for a resolved config (see `config.loader.resolve`).

    Each task runs `python -m <entry> RUN_DIR`, unless `commands` gives its role another argv (the
    submitit executor runs `python -m submitit.core._submit FOLDER`, which calls the same entry).
    """
    paths = RunPaths(config.run.dir)
    if not _SBATCH_PATH.fullmatch(str(paths.root)):
        raise UserError(
            f"run.dir {str(paths.root)!r} cannot appear on an #SBATCH line: use a path without spaces, "
            "quotes, backslashes or %"
        )
    components = plan(config, entries)
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["q"] = lambda value: shlex.quote(str(value))
    return env.get_template(TEMPLATE).render(
        version=__version__,
        run_name=config.run.name,
        run_dir=str(paths.root),
        job_options=job_options(config),
        components=[
            {
                "index": c.index,
                "name": c.name,
                "role": c.role,
                "command": _task_command(config, c, (commands or {}).get(c.role)),
                "container_options": container.srun_options(config),
                "options": component_options(c, config.cluster.partition, paths),
            }
            for c in components
        ],
        environment=sorted(config.cluster.environment.items()),
        setup=config.cluster.setup,
        log_root=paths.relative(paths.log_dir),
        attempt_log_dir=paths.relative(paths.attempt_log_dir("$attempt")),  # the script numbers its starts
        job_id_file=paths.relative(paths.job_id_file),
        metrics_file=paths.relative(paths.metrics),
        resumed_file=paths.relative(paths.resumed),
        preempt_signal=config.cluster.preempt_signal,
        lock_file=paths.relative(paths.lock_file),
        max_requeues=config.cluster.max_requeues if config.cluster.requeue else 0,
    )


def _task_command(config: RLConfig, component: Component, argv: list[str] | None) -> str:
    """The task's command line; in an apptainer container, behind an `apptainer exec ... IMAGE` line."""
    prefix = container.exec_prefix(config, gpus=component.resources.gpus_per_node > 0)
    if argv is None:
        command = f'{shlex.quote(container.python(config))} -m {component.entry} "$RLTOOLS_RUN_DIR"'
    else:
        command = " ".join(shlex.quote(str(word)) for word in argv)
    if not prefix:
        return command
    return " ".join(shlex.quote(word) for word in prefix) + " \\\n    " + command  # continued on the next line


def job_options(config: RLConfig) -> list[str]:
    cluster = config.cluster
    options = [f"--job-name={config.run.name}", f"--time={cluster.time}"]
    options += [f"--{key}={value}" for key, value in (("account", cluster.account), ("qos", cluster.qos)) if value]
    options.append(f"--signal={cluster.preempt_signal}@{cluster.preempt_grace_s}")
    options.append("--requeue" if cluster.requeue else "--no-requeue")
    options.append("--open-mode=append")  # a requeued attempt appends to the logs, never truncates them
    options += [f"--{key}={value}" if value else f"--{key}" for key, value in sorted(cluster.sbatch_extra.items())]
    return options


def component_options(component: Component, default_partition: str | None, paths: RunPaths) -> list[str]:
    r = component.resources
    partition = r.partition or default_partition
    options = [f"--partition={partition}"] if partition else []
    options += [f"--nodes={r.nodes}", f"--ntasks-per-node={r.ntasks_per_node}"]
    if r.gpus_per_node:
        options.append(f"--gpus-per-node={r.gpus_per_node}")
    options.append(f"--cpus-per-task={r.cpus_per_task}")
    if r.mem is not None:
        options.append(f"--mem={r.mem}")
    options.append(f"--output={paths.component_log(component.name, 'out')}")
    options.append(f"--error={paths.component_log(component.name, 'err')}")
    return options

