"""The Slurm launcher: the RL job as ONE heterogeneous job, submitted through submitit.

What is submitit's, kept as it is: the job folder, the pickled call each task runs
(`python -u -m submitit.core._submit FOLDER` loads `<job_id>_submitted.pkl` and calls it), the
per-task result pickles carrying a task's return value or traceback, `Job.result()` and
`Job.cancel()`, the sbatch call and the parsing of its job id.

What is ours:
- The script text. submitit's builder writes one sorted option block for a single job; a hetjob
  needs one block per component separated by `#SBATCH hetjob`. So `_make_submission_file_text`
  renders templates/sbatch/rl_job.sbatch.j2: the script `rltools render` writes for plain sbatch
  users, with submitit's command on each srun line.
- The task count (`_num_tasks`): the trainer component's ranks; trainer rank 0's result is the job's.
- One submitit folder per component. The components number their tasks from 0, and submitit names
  a result after the task number alone; the submitted pickle is linked into the generators' (and
  the judges') folder.
- Job state from `squeue --states=all`. submitit's watcher asks `sacct`, which needs an accounting
  database many clusters (and our local one) lack, and then waits forever. `sacct` is the fall-back
  for a job squeue has forgotten (MinJobAge), and the job script's exit files the last resort.
- Signals: submitit's USR2 handler requeues the job from task 0 of any step, which in a hetjob
  is a generator, with no checkpoint; `rltools.jobs.common.run_submitted` hands the signals back to the role.

This module runs on the login node: it never imports the job's code. The caller hands it the
callable each task runs (the CLI passes `rltools.jobs.common.run_submitted`), which submitit pickles
by reference.
"""

import os
import shlex
import shutil
import subprocess
import time
from typing import Callable

import submitit
from submitit.core import core

from ..config.schema import RLConfig
from ..errors import UserError
from ..paths import ROLES, RunPaths
from ..runtime.role_env import GENERATOR_GROUP, JUDGE_GROUP, TRAINER_GROUP
from . import container
from .run_lock import RunInUse
from .sbatch import render_sbatch

COMPONENTS = {GENERATOR_GROUP: "generators", TRAINER_GROUP: "trainers", JUDGE_GROUP: "judges"}
ACTIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD",
                    "REQUEUE_FED", "RESIZING", "SUSPENDED", "STAGE_OUT", "SIGNALING"})
LEFT_QUEUE = "LEFT_QUEUE"
"""A job squeue and sacct knew and have forgotten (MinJobAge) before we saw how it ended."""
FAILED = frozenset({"FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "TIMEOUT", "BOOT_FAIL", "DEADLINE", "PREEMPTED"})


def submit_job(config: RLConfig, paths: RunPaths, task: Callable[[str], str]) -> "SqueueJob":
    """Submit the run's hetjob, each task calling `task(RUN_DIR)`; its id is written to the run
    directory for status/logs/cancel."""
    _require_sbatch("or run on this machine with cluster.launcher: local (--set cluster.launcher=local)")
    refuse_if_active(paths)
    executor = HetJobExecutor(config, paths)
    try:
        job = executor.submit(task, str(paths.root))
    except submitit.core.utils.FailedJobError as err:
        raise UserError(f"sbatch refused the job: {err}") from None
    paths.job_id_file.write_text(f"{job.job_id}\n")
    return job


def refuse_if_active(paths: RunPaths) -> None:
    """RunInUse while the run's Slurm job is queued, running or requeued: between two attempts of a
    requeued job nothing holds the run's lock, but the job still owns the directory."""
    if not paths.job_id_file.exists():
        return
    job_id = paths.job_id_file.read_text().strip()
    state = job_state(job_id)["state"]
    if state in ACTIVE:
        raise RunInUse(
            f"run directory {paths.root} is in use by Slurm job {job_id} ({state}): follow it with "
            f"`rltools status {paths.root}`, stop it with `rltools cancel {paths.root}`, or set another run.dir"
        )


class SqueueWatcher(core.InfoWatcher):
    """submitit's shared state poller, reading `job_state` instead of sacct."""

    def _make_command(self):  # submitit's hook; `update` below does the querying
        return None

    def update(self) -> None:
        for job_id in self._registered - self._finished:
            state = job_state(job_id)["state"]
            if state == "UNKNOWN" and "State" in self._info_dict.get(job_id, {}):
                state = LEFT_QUEUE  # seen before, gone now without a final state: it will not come back
            if state != "UNKNOWN":
                self._info_dict[job_id] = {"State": state}
            if state not in ACTIVE and state != "UNKNOWN":
                self._finished.add(job_id)
        self._num_calls += 1
        self._last_status_check = time.time()

    def get_state(self, job_id: str, mode: str = "standard") -> str:
        return self.get_info(job_id, mode=mode).get("State") or "UNKNOWN"


class SqueueJob(submitit.SlurmJob):
    """A submitit job handle whose state comes from squeue (see the module docstring); it serves the
    plain eval job as well."""

    watcher = SqueueWatcher(delay_s=5)


class HetJobExecutor(submitit.SlurmExecutor):
    job_class = SqueueJob

    def __init__(self, config: RLConfig, paths: RunPaths):
        self.config, self.paths = config, paths
        for role in ROLES:
            paths.submitit_dir(role).mkdir(parents=True, exist_ok=True)
        super().__init__(
            folder=paths.submitit_dir("trainer"),
            max_num_timeout=config.cluster.max_requeues,
            python=shlex.quote(container.python(config)),
        )
        self.parameters["time"] = minutes(config.cluster.time)  # submitit's preemption-vs-timeout arithmetic

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        python = container.python(self.config)  # render_sbatch puts the container around the command
        commands = {  # SUBMITIT_EXECUTOR tells submitit's task side which cluster it runs on
            role: ["env", "SUBMITIT_EXECUTOR=slurm", python, "-u", "-m", "submitit.core._submit",
                   str(self.paths.submitit_dir(role))]
            for role in ROLES
        }
        return render_sbatch(self.config, commands=commands)

    def _num_tasks(self) -> int:
        return self.config.cluster.trainers.ntasks

    def _internal_process_submissions(self, delayed_submissions):
        jobs = super()._internal_process_submissions(delayed_submissions)
        for job in jobs:  # the generator (and judge) tasks read the same call from their own folder
            pickle = job.paths.submitted_pickle
            for role in ROLES:
                if role != "trainer":
                    os.link(pickle, self.paths.submitit_dir(role) / pickle.name)
        return jobs


def _require_sbatch(alternative: str) -> None:
    if shutil.which("sbatch") is None:
        raise UserError(f"sbatch not found: run this on a Slurm login node, {alternative}")


def job_state(job_id: str) -> dict:
    """{"state": overall, "components": {name: {"state", "nodes", "reason"}}} of a hetjob, or
    state UNKNOWN when neither squeue nor sacct knows the job."""
    components = _squeue(job_id) or _sacct(job_id)
    if not components:
        return {"state": "UNKNOWN", "components": {}}
    return {"state": overall_state([c["state"] for c in components.values()]), "components": components}


def overall_state(states: list[str]) -> str:
    """One word for the job: a failure or cancellation wins, then activity, then completion."""
    for group in (FAILED, {"CANCELLED"}):
        found = [s for s in states if s in group]
        if found:
            return found[0]
    for state in ("RUNNING", "COMPLETING", "CONFIGURING", "REQUEUED", "PENDING"):
        if state in states:
            return state
    return states[0] if len(set(states)) == 1 else "MIXED(" + ",".join(states) + ")"


def _squeue(job_id: str) -> dict:
    out = _run(["squeue", "--states=all", "--noheader", "-j", job_id, "-o", "%i|%T|%N|%r"])
    return _components(line.split("|") for line in out.splitlines())


def _sacct(job_id: str) -> dict:
    out = _run(["sacct", "--noheader", "--parsable2", "-X", "-j", job_id, "-o", "JobID,State,NodeList,Reason"])
    return _components(line.split("|") for line in out.splitlines())


def _components(rows) -> dict:
    found = {}
    for row in rows:
        if len(row) < 4 or "." in row[0]:  # a job step, not the job
            continue
        # a hetjob's components are LEADER+<index>; a plain job (the eval job) is one component
        name = COMPONENTS.get(int(row[0].split("+")[1]), row[0]) if "+" in row[0] else "job"
        state = row[1].split()[0] if row[1] else "UNKNOWN"  # sacct: "CANCELLED by 0"
        found[name] = {"state": state, "nodes": row[2], "reason": row[3]}
    return found


def _run(argv: list[str]) -> str:
    """A Slurm query's stdout; empty when the command fails (unknown job, no accounting database)."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return result.stdout if result.returncode == 0 else ""


def cancel_job(job_id: str) -> None:
    result = subprocess.run(["scancel", job_id], capture_output=True, text=True)
    if result.returncode != 0:
        raise UserError(f"scancel {job_id} failed: {result.stderr.strip()}")


def minutes(slurm_time: str) -> int:
    """Slurm's time formats ([D-]HH:MM:SS, MM:SS, MM, D-HH...) in whole minutes, rounded up."""
    days, _, clock = slurm_time.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    if days:
        hours, minutes_, seconds = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        hours, minutes_, seconds = parts
    else:
        hours, (minutes_, seconds) = 0, (parts + [0])[:2]
    total_s = ((int(days or 0) * 24 + hours) * 60 + minutes_) * 60 + seconds
    return max(1, -(-total_s // 60))


class GeneratorJobExecutor(submitit.SlurmExecutor):
    """A plain job on the generator component's kind of node: `rltools eval` (one task) and `rltools join`
    (engines for a running run). submitit writes the script itself; ours are the state watcher and
    the resources taken from the config."""

    job_class = SqueueJob

    def __init__(self, config: RLConfig, paths: RunPaths, name: str, *, nodes: int = 1, ntasks_per_node: int = 1,
                 time_limit: str | None = None, partition: str | None = None, environment: dict[str, str] | None = None):
        folder = paths.slurm_dir / "submitit" / name
        folder.mkdir(parents=True, exist_ok=True)
        cluster, gens = config.cluster, config.cluster.generators
        # In a container: apptainer's prefix goes before the interpreter, pyxis's options on submitit's srun line.
        python = [*container.exec_prefix(config, gpus=gens.gpus_per_node > 0), container.python(config)]
        super().__init__(folder=folder, max_num_timeout=0, python=" ".join(shlex.quote(word) for word in python))
        extra = {"mem": gens.mem} if gens.mem is not None else {}
        exports = {**cluster.environment, **(environment or {})}
        self.update_parameters(
            job_name=f"{config.run.name}-{name}",
            partition=partition or gens.partition or cluster.partition,
            account=cluster.account,
            qos=cluster.qos,
            time=minutes(time_limit or cluster.time),
            nodes=nodes,
            ntasks_per_node=ntasks_per_node,
            cpus_per_task=gens.cpus_per_task,
            gpus_per_node=gens.gpus_per_node or None,
            setup=[*cluster.setup, *(f"export {k}={shlex.quote(v)}" for k, v in sorted(exports.items()))],
            srun_args=[f"{option}={value}" for option, value in container.srun_options(config)],
            additional_parameters=extra,
        )


def submit_task(config: RLConfig, paths: RunPaths, name: str, function: Callable, *args, **kwargs) -> SqueueJob:
    """Submit `function(*args, **kwargs)` as a one-task Slurm job on one generator's resources (where vLLM
    runs): `rltools eval` and `rltools export`; `job.result()` is what it returns."""
    _require_sbatch(f"or run `rltools {name}` with --local on a machine that can run vLLM")
    return GeneratorJobExecutor(config, paths, name).submit(function, *args, **kwargs)
