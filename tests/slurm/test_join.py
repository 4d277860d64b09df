"""`rltools join` on the local Slurm: a job of its own adds an engine to a running 1-engine run; the
run's rollouts come from both; the join job is cancelled mid-run and its engine leaves at once (no
heartbeat timeout, no failed step); the run completes with every step once, each its own prompts."""

import json
import subprocess
import time

from tests.fleet_checks import assert_each_step_trained_its_own_prompts

from rltools.launch.slurm import ACTIVE
from rltools.paths import RunPaths

from .conftest import cli, demo_run, job_states, sbatch, wait_for_job


def wait_until(what: str, ready, job_id: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        states = job_states(job_id)
        ended = bool(states) and not ACTIVE & set(states.values())
        assert time.monotonic() < deadline and not ended, (f"{what}: not within {timeout_s:.0f} s", states)
        time.sleep(0.2)


def fleet(paths: RunPaths) -> dict:
    try:
        return json.loads(paths.fleet.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def test_rltools_join_adds_an_engine_that_shares_the_steps_and_leaves_when_its_job_ends(slurm, repo, tmp_path):
    steps = 40
    paths = demo_run(repo, tmp_path, f"schedule.steps={steps}", "schedule.eval_every=0", "eval.problems=16",
                     "generator.slots=2", "generator.heartbeat_timeout_s=600",  # a loss noticed late would show
                     f"schedule.keep_rollout_steps={steps}")
    job_id = sbatch(paths.sbatch_script)
    # sbatch by hand: the run records its job id when the job script starts, a moment after RUNNING
    wait_until("the run's job running", lambda: job_states(job_id).get("trainers") == "RUNNING"
               and paths.job_id_file.exists(), job_id, 120)
    joined = cli("join", paths.root, "--nodes", "1", "--time", "10")
    assert joined.returncode == 0, joined.stderr
    assert "generator engine(s) 1 join" in joined.stderr, joined.stderr
    join_job = json.loads(paths.joins.read_text())[0]["job_id"]
    try:
        wait_until("the joined engine live", lambda: 1 in fleet(paths).get("live", []), job_id)
        joined_at = next(e["step"] for e in fleet(paths)["events"] if e["event"] == "joined")
        wait_until("steps with the joined engine", lambda: int(fleet(paths).get("delivered", {}).get("1", 0)) >= 3 * 64,
                   job_id)
        status = cli("status", paths.root)
        assert "generator engines: 2 live (1 configured, 1 joined)" in status.stdout, status.stdout
        assert f"join job {join_job}" in status.stdout
    finally:  # the join job's end: its engine hands its slot back at once
        subprocess.run(["scancel", join_job], check=True)
    states = wait_for_job(job_id, timeout_s=400)
    assert states["trainers"] == "COMPLETED", states
    metrics = [json.loads(line) for line in paths.metrics.read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(steps)), "every step exactly once"
    assert {m["engines"] for m in metrics} == {1, 2} and metrics[-1]["engines"] == 1
    record = fleet(paths)
    left = [e for e in record["events"] if e["event"] == "lost"]
    assert [(e["engine"], e["why"]) for e in left] == [(1, "it left: its job ends")], record["events"]
    assert left[0]["step"] < steps - 1, "the engine left before the run's end"
    shares = {tuple(engines) for start, engines in record["assignments"] if joined_at <= start < left[0]["step"]}
    assert shares == {(0, 1)}, record["assignments"]  # while joined, each engine generated a slot of each step
    assert all(m["reassigned_samples"] == 0 for m in metrics)  # a share taken or handed back, no engine lost
    assert_each_step_trained_its_own_prompts(paths.root, steps)
    waits = [m["wait_s"] for m in metrics[left[0]["step"]:]]
    assert max(waits) < 60, f"a step waited {max(waits):.0f} s for the engine that left (heartbeat timeout 600 s)"
