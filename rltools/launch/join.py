"""`rltools join RUN --nodes N`: more generator engines for a running run, as a Slurm job of their own.

The join job is a plain job of generator tasks on the generator component's kind of node (another
partition, a preemptible one, say). Its engines take engine numbers past the run's own (recorded in
`joins.json` before the job is submitted: trainer rank 0 admits the weight-sync workers of those
engines only), join the weight-sync group at the next weight sync and get a share of the step's slots
(`runtime.fleet.FleetRecord.reassign`). When the job ends (time limit, `scancel`, preemption) each
engine tells trainer rank 0 it leaves, and its slots go back to the others.

Invariant: login-node light, like the rest of the command line.
"""

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..config import load_config
from ..errors import UserError
from ..paths import RunPaths
from ..runtime.fleet import FleetRecord, add_join, joined_engines, set_join_job
from ..runtime.role_env import FIRST_ENGINE
from ..runtime.roles import slots
from .slurm import GeneratorJobExecutor, _require_sbatch, job_state, minutes


@dataclass(frozen=True)
class Join:
    job_id: str
    first_engine: int
    engines: int


def join_run(paths: RunPaths, nodes: int, task: Callable[[str], str], time_limit: str | None = None,
             partition: str | None = None) -> Join:
    """Submit `nodes` nodes of generator engines that join the run in `paths`; each task calls `task(RUN_DIR)`."""
    if nodes < 1:
        raise UserError(f"--nodes must be 1 or more, got {nodes}")
    if time_limit is not None:
        try:
            minutes(time_limit)
        except ValueError:
            raise UserError(f"--time {time_limit!r}: expected a Slurm time such as 04:00:00, 90 or 1-00:00:00") from None
    config = load_config(paths.config)
    if config.cluster.launcher != "slurm":
        raise UserError(f"{paths.root} runs with the local launcher: engines can join a run on Slurm only")
    _require_sbatch("rltools join submits a Slurm job")
    job_id = paths.job_id_file.read_text().strip() if paths.job_id_file.exists() else None
    state = job_state(job_id)["state"] if job_id else "never submitted"
    if state != "RUNNING":
        raise UserError(f"{paths.root} is not running (its job {job_id or ''} is {state}): engines join a running run")
    record = FleetRecord.read(paths)
    coming = _joins_not_live(paths, record)
    live = len(record.live) if record else config.cluster.generators.ntasks
    total_slots = slots(config)
    if live + coming >= total_slots:
        raise UserError(
            f"{paths.root} cuts each step into {total_slots} slot(s) (generator.slots), and {live} live engine(s)"
            + (f" and {coming} joining" if coming else "") + " generate them: another engine would have nothing to do. "
            "A run meant to grow needs more slots than engines: start it with --set generator.slots=N")
    engines = nodes * config.cluster.generators.ntasks_per_node
    if live + coming + engines > total_slots:
        print(f"note: {total_slots} slots for {live + coming + engines} engines: "
              f"{live + coming + engines - total_slots} of them will wait for a slot", flush=True)
    first = add_join(paths, config.cluster.generators.ntasks, engines, nodes=nodes, time=time_limit,
                     partition=partition, submitted=round(time.time(), 3))
    executor = GeneratorJobExecutor(config, paths, f"join_{first}", nodes=nodes,
                                    ntasks_per_node=config.cluster.generators.ntasks_per_node, time_limit=time_limit,
                                    partition=partition, environment={FIRST_ENGINE: str(first), "RLTOOLS_ROLE": "generator"})
    job = executor.submit(task, str(paths.root))
    set_join_job(paths, first, job.job_id)
    return Join(job.job_id, first, engines)


def _joins_not_live(paths: RunPaths, record: FleetRecord | None) -> int:
    """Engines of earlier joins still to come: their job is queued or running, and they never joined."""
    from .slurm import ACTIVE

    seen = set(record.live) | {e["engine"] for e in record.events} if record else set()
    by_job: dict[str, list[int]] = {}
    for engine, join in joined_engines(paths).items():
        if "job_id" in join and engine not in seen:
            by_job.setdefault(join["job_id"], []).append(engine)
    return sum(len(engines) for job, engines in by_job.items() if job_state(job)["state"] in ACTIVE)


def join_logs(paths: RunPaths, first_engine: int) -> Path:
    return paths.slurm_dir / "submitit" / f"join_{first_engine}"
