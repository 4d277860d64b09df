"""Faults of a multi-node run on the local Slurm, from outside the job as a node would fail: a
generator task killed with SIGKILL (its supervisor and so its engine: no replacement, as when its
node is gone) costs throughput, not the run, and a judge task its share of the judging; a trainer task killed with SIGKILL requeues the job,
which resumes from its checkpoint and completes."""

import json
import random
import re
import signal
import subprocess
import time

from tests.fleet_checks import assert_each_step_trained_its_own_prompts
from tests.judges import TINY_JUDGE

from rltools.launch.slurm import ACTIVE

from .conftest import demo_run, job_states, sbatch, wait_for_job


def role_processes(run_dir, role: str) -> dict[int, int]:
    """{task rank: pid} of a role's tasks (the plain-sbatch command line names the run directory); a
    generator task is its supervisor, not the engine it runs (`generate/supervisor.py`)."""
    found = {}
    pids = subprocess.run(["pgrep", "-f", f"rltools.jobs.{role} {run_dir}$"], capture_output=True, text=True).stdout
    for pid in map(int, pids.split()):
        try:
            environ = dict(item.split("=", 1) for item in open(f"/proc/{pid}/environ").read().split("\0") if "=" in item)
        except OSError:
            continue  # ended meanwhile
        if "RLTOOLS_ENGINE_RESTART" not in environ:
            found[int(environ["SLURM_PROCID"])] = pid
    return found


def done_steps(paths) -> int:
    return len(paths.metrics.read_text().splitlines()) if paths.metrics.exists() else 0


def kill_at_step(paths, job_id: str, role: str, rank: int, step: int, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while done_steps(paths) < step or rank not in role_processes(paths.root, role):
        states = job_states(job_id)
        ended = bool(states) and not ACTIVE & set(states.values())
        assert time.monotonic() < deadline and not ended, (f"no step {step} with a {role} {rank} to kill", states)
        time.sleep(0.2)
    subprocess.run(["kill", f"-{signal.SIGKILL.value}", str(role_processes(paths.root, role)[rank])], check=True)


def test_a_killed_generator_task_costs_throughput_not_the_run(slurm, repo, tmp_path):
    steps = 12
    step = random.Random(25).randint(3, 7)  # seeded: a failure names the step it happened at
    paths = demo_run(repo, tmp_path, f"schedule.steps={steps}", "schedule.eval_every=0", "eval.problems=16",
                     "cluster.generators.nodes=2", "generator.heartbeat_timeout_s=5",
                     f"schedule.keep_rollout_steps={steps}")
    job_id = sbatch(paths.sbatch_script)
    kill_at_step(paths, job_id, "generator", 1, step)
    states = wait_for_job(job_id, timeout_s=400)
    logs = {p.name: p.read_text() for p in paths.attempt_log_dir(0).glob("*.log")}
    assert states["trainers"] == "COMPLETED", (states, {k: v[-1500:] for k, v in logs.items()})
    metrics = [json.loads(line) for line in paths.metrics.read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(steps)), "every step exactly once"
    assert metrics[0]["engines"] == 2 and metrics[-1]["engines"] == 1
    fleet = json.loads(paths.fleet.read_text())
    assert fleet["live"] == [0] and [(e["event"], e["engine"]) for e in fleet["events"]] == [("lost", 1)]
    assert_each_step_trained_its_own_prompts(paths.root, steps)
    assert "(slot 1, for a lost engine)" in logs["generator_0.log"]


def test_a_killed_judge_task_costs_its_share_of_the_judging_not_a_call(slurm, repo, tmp_path):
    """A judge component of two engines on a node of its own (the tiny model as judge: tests/judges.py);
    judge task 1 is killed with SIGKILL at step 2: the generator sends its share to judge 0, no call fails,
    and judge 0 stops by itself once the trainers and the generator have ended. vLLM runs in one process
    here: the judge's plumbing is the subject, three engine-core processes beside the trainer starve two
    cores under the suite's load, and every other test of this tier runs vLLM's engine-core process."""
    steps = 6
    paths = demo_run(repo, tmp_path, f"schedule.steps={steps}", "schedule.eval_every=0", "eval.problems=16",
                     "cluster.judges.ntasks_per_node=2", "cluster.environment.VLLM_ENABLE_V1_MULTIPROCESSING=0",
                     *TINY_JUDGE)
    job_id = sbatch(paths.sbatch_script)
    kill_at_step(paths, job_id, "judge", 1, 2)
    states = wait_for_job(job_id, timeout_s=400)
    logs = {p.name: p.read_text() for p in paths.attempt_log_dir(0).glob("*.log")}
    assert states["trainers"] == "COMPLETED", (states, {k: v[-1500:] for k, v in logs.items()})
    metrics = [json.loads(line) for line in paths.metrics.read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(steps)), "every step exactly once"
    assert all(m["reward_failures"] == 0 and m["reward/judge"] > 0 for m in metrics), metrics
    assert "judge 1 is lost" in logs["generator_0.log"]
    assert "judge 0 stopping (the trainers and generators have ended)" in logs["judge_0.log"]
    script_log = "\n".join(p.read_text() for p in paths.log_dir.glob("*.err"))
    assert paths.component_exit(0, "judge").exists() and "component failed" not in script_log, script_log
    hosts = [json.loads(path.read_text())["host"] for path in (paths.judge_address(0), paths.sync_address)]
    assert hosts[0].startswith("127.0.1.") and hosts[0] != hosts[1], "judge 0 listened on its own node's address"


def test_a_killed_trainer_task_requeues_the_job_which_resumes_and_completes(slurm, repo, tmp_path):
    steps = 10
    paths = demo_run(repo, tmp_path, f"schedule.steps={steps}", "schedule.eval_every=0", "eval.problems=16",
                     "schedule.checkpoint_every=3", "cluster.trainers.nodes=2")
    job_id = sbatch(paths.sbatch_script)
    kill_at_step(paths, job_id, "trainer", 1, 5)  # past the checkpoint of step 3
    states = wait_for_job(job_id, timeout_s=400)
    assert set(states.values()) == {"COMPLETED"}, states
    assert sorted(paths.attempts()) == [0, 1]
    script_log = "\n".join(p.read_text() for p in paths.log_dir.glob("*.err"))
    assert "the trainers failed (exit" in script_log and "requeueing the job to resume from its last checkpoint" in script_log
    metrics = [json.loads(line) for line in paths.metrics.read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(steps)), "every step exactly once across the requeue"
    assert "resumed from" in paths.task_log(1, "trainer", 0).read_text()


def test_losing_every_engine_requeues_the_job_which_resumes_and_completes(slurm, repo, tmp_path):
    """The generator component ends (its one task killed with SIGKILL, as when its node is gone) after
    this start trained steps: the trainers get the warning signal, stop at a checkpoint and requeue
    the job, which starts new engines and completes."""
    steps = 10
    paths = demo_run(repo, tmp_path, f"schedule.steps={steps}", "schedule.eval_every=0", "eval.problems=16",
                     "schedule.checkpoint_every=3", f"schedule.keep_rollout_steps={steps}",
                     "generator.heartbeat_timeout_s=600")  # the script acts, not a heartbeat timeout
    job_id = sbatch(paths.sbatch_script)
    kill_at_step(paths, job_id, "generator", 0, 5)
    states = wait_for_job(job_id, timeout_s=400)
    assert set(states.values()) == {"COMPLETED"}, states
    assert sorted(paths.attempts()) == [0, 1]
    script_log = "\n".join(p.read_text() for p in paths.log_dir.glob("*.err"))
    assert "every generator engine is gone (the generator component ended, exit 137)" in script_log, script_log
    assert "the trainers failed" not in script_log
    first = paths.task_log(0, "trainer", 0).read_text()
    assert "requeue" in first and "checkpoint" in first, first[-2000:]
    metrics = [json.loads(line) for line in paths.metrics.read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(steps)), "every step exactly once across the requeue"
    assert "resumed from" in paths.task_log(1, "trainer", 0).read_text()
    assert_each_step_trained_its_own_prompts(paths.root, steps)


def test_a_generator_node_that_goes_down_costs_a_requeue_not_the_steps_trained(slurm, repo, tmp_path):
    """Slurm marks the node of generator 1 DOWN mid-run: it cancels the job for the node failure
    (SIGTERM to every task), the trainers checkpoint the steps they trained, and Slurm requeues the
    job (--requeue), which starts its engines on the nodes that are up and completes."""
    steps = 10
    paths = demo_run(repo, tmp_path, f"schedule.steps={steps}", "schedule.eval_every=0", "eval.problems=16",
                     "cluster.generators.nodes=2", "schedule.checkpoint_every=3", f"schedule.keep_rollout_steps={steps}",
                     "generator.heartbeat_timeout_s=600")
    job_id = sbatch(paths.sbatch_script)
    deadline = time.monotonic() + 240
    while done_steps(paths) < 5:
        assert time.monotonic() < deadline and ACTIVE & set(job_states(job_id).values() or {"PENDING"}), "no step 5"
        time.sleep(0.2)
    node = json.loads(paths.fleet.read_text())["where"]["1"]["node"]
    subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=rltools-test"], check=True)
    try:
        states = wait_for_job(job_id, timeout_s=400)
    finally:  # the local cluster may have taken it back already ("Invalid node state")
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True)
    assert set(states.values()) == {"COMPLETED"}, states
    assert sorted(paths.attempts()) == [0, 1]
    script_log = "\n".join(p.read_text() for p in paths.log_dir.glob("*.err"))
    assert f"Node failure on {node}" in script_log, script_log
    stopped = re.search(r"stopped on SIGTERM after (\d+) of 10 steps; checkpoint", paths.task_log(0, "trainer", 0).read_text())
    assert stopped and int(stopped.group(1)) >= 5, "the steps trained before the failure were checkpointed"
    assert f"resumed from {paths.checkpoint_dir(int(stopped.group(1)))}" in paths.task_log(1, "trainer", 0).read_text()
    # (which nodes the new start got is Slurm's: this local cluster takes the node back at once, its slurmd being up)
    metrics = [json.loads(line) for line in paths.metrics.read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(steps)), "every step exactly once across the requeue"
    assert_each_step_trained_its_own_prompts(paths.root, steps)
