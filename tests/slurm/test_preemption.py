"""Preemption on a real Slurm: signal -> checkpoint -> requeue -> resume, with nothing lost or done twice."""

import json
import random
import subprocess
import time

import torch

from rltools.paths import RunPaths
from rltools.train import checkpoints

from .conftest import cli, slurm_demo_overrides


def submit(repo, run_dir, *overrides):
    result = cli("submit", repo / "configs" / "demo.yaml", *slurm_demo_overrides(run_dir, *overrides))
    assert result.returncode == 0, result.stderr
    return (run_dir / "slurm" / "job_id").read_text().strip()


def status(run_dir) -> dict:
    return json.loads(cli("status", run_dir, "--json").stdout)


def steps_done(run_dir) -> int:
    metrics = run_dir / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def wait_until(condition, what: str, job_id: str, timeout_s: float = 240.0):
    """Poll `condition()` until it is truthy. A requeued hetjob on this small idle cluster can sit
    PENDING (reason BeginTime) until the scheduler looks at it again; an update of the job pokes the
    scheduler, so the test does not depend on when the next scheduling pass happens."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id])
            raise AssertionError(f"timed out waiting for {what} (job {job_id} cancelled)")
        states = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout
        if "PENDING" in states:
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "Comment=rltools-test-poke"], capture_output=True)
        time.sleep(0.5)
    return value


def preempt(run_dir, job_id: str, how: str, at_step: int, restarts: int) -> None:
    """Wait until the current attempt has trained past `at_step`, then preempt the job `how`."""
    wait_until(lambda: status(run_dir)["restarts"] == restarts and steps_done(run_dir) >= at_step,
               f"attempt {restarts} to pass step {at_step}", job_id)
    command = ["scontrol", "requeue", job_id] if how == "requeue" else ["scancel", "--signal=USR2", job_id]
    subprocess.run(command, check=True)


def finish(run_dir, job_id: str, restarts: int) -> dict:
    s = wait_until(lambda: (s := status(run_dir))["state"] in ("COMPLETED", "FAILED", "STOPPED", "CANCELLED") and s,
                   "the end of the job", job_id, timeout_s=400)
    assert (s["state"], s["restarts"]) == ("COMPLETED", restarts), s
    return s


def test_three_preemptions_lose_nothing_and_repeat_nothing(slurm, repo, tmp_path):
    """The warning while the roles start up (it used to kill both components while they imported
    torch and vLLM: exit 140, the job FAILED), then a requeue and the warning at seeded random steps:
    every step exactly once, and a second launch on the running run is refused. The generator runs
    up to three policy versions ahead (decoupled PPO corrects for it): the deepest asynchrony
    rltools tests, through every restart."""
    run_dir, steps = tmp_path / "run", 60
    job_id = submit(repo, run_dir, f"schedule.steps={steps}", "schedule.checkpoint_every=10", "eval.problems=16",
                    "schedule.max_staleness=3", "algorithm.tis_cap=2.0")
    logs = [run_dir / "slurm/logs/attempt_0" / f"{role}_0.log" for role in ("generator", "trainer")]
    wait_until(lambda: all(log.exists() and "starting in" in log.read_text() for log in logs),
               "both roles to start", job_id)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)  # while they import torch and vLLM
    rng = random.Random(20261129)
    at = sorted(rng.sample(range(8, steps - 15), 2))
    for restarts, (how, step) in enumerate(zip(["requeue", "signal"], at), start=1):
        preempt(run_dir, job_id, how, step, restarts)
        if restarts == 1:
            second = cli("resume", run_dir)  # the job script holds the run's lock while the job runs
            assert second.returncode == 2 and f"run directory {run_dir} is in use by Slurm job {job_id}" in \
                second.stderr, second.stderr
    s = finish(run_dir, job_id, restarts=3)

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(steps)), "each step exactly once across restarts"
    assert all(0 <= m["staleness"] <= 3 for m in lines)  # no shard of a discarded policy was trained on
    assert max(m["staleness"] for m in lines) == 3
    assert s["step"] == steps and s["checkpoint"] == steps
    generator, trainer = (log.read_text() for log in logs)
    assert "received SIGUSR2" in trainer and f"stopped on SIGUSR2 after 0 of {steps} steps" in trainer, trainer[-2000:]
    assert f"requeued job {job_id}" in trainer
    assert "SIGUSR2" in generator and "Traceback" not in generator, generator[-2000:]
    logs = [p.read_text() for p in sorted((run_dir / "slurm/logs").glob("attempt_*/trainer_0.log"))]
    assert len(logs) == 4 and all("resumed from" in text for text in logs[2:]), [t[-800:] for t in logs]
    assert "received SIGUSR2" in logs[2] and "requeued job" in logs[2]  # the signal path mid-run: checkpoint, requeue


def test_a_preempted_run_ends_with_the_same_adapter_as_an_uninterrupted_one(slurm, repo, tmp_path):
    common = ["schedule.steps=24", "schedule.max_staleness=0", "schedule.checkpoint_every=100", "eval.problems=16"]
    reference = tmp_path / "reference"
    done = cli("submit", repo / "configs/demo.yaml", "--set", f"run.dir={reference}",
               *[w for o in common for w in ("--set", o)])
    assert done.returncode == 0, done.stderr[-2000:]

    run_dir = tmp_path / "run"
    job_id = submit(repo, run_dir, *common)
    preempt(run_dir, job_id, "signal", at_step=10, restarts=0)
    finish(run_dir, job_id, restarts=1)

    ours = checkpoints.read_weights(RunPaths(run_dir).checkpoint_dir(24))
    expected = checkpoints.read_weights(RunPaths(reference).checkpoint_dir(24))
    assert ours.keys() == expected.keys() and ours
    for name in expected:
        torch.testing.assert_close(ours[name], expected[name], rtol=1e-5, atol=1e-7)


def test_the_time_limit_warning_checkpoints_and_resume_finishes(slurm, repo, tmp_path):
    run_dir, steps = tmp_path / "run", 200
    # 1 minute of wall time, the warning 30 s before it, no automatic requeue: the run stops at a
    # checkpoint and a person resumes it. The one-process engine: vLLM's engine-core process can take
    # more than those 30 s to start while the suite loads both cores, and the warning would then come
    # before the generator joined (this test is about the signal path, not the engine).
    job_id = submit(repo, run_dir, f"schedule.steps={steps}", "cluster.time=1", "cluster.preempt_grace_s=30",
                    "cluster.requeue=false", "eval.problems=16", "cluster.environment.VLLM_ENABLE_V1_MULTIPROCESSING=0")
    s = wait_until(lambda: (s := status(run_dir))["state"] not in ("PENDING", "RUNNING", "COMPLETING") and s,
                   "the time-limit stop", job_id, timeout_s=150)
    assert s["state"] == "STOPPED" and s["checkpoint"] == s["step"] < steps, s
    assert "continue with: rltools resume" in cli("status", run_dir).stdout

    resumed = cli("resume", run_dir, "--set", "cluster.time=10", "--wait")  # with enough time this once
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # Slurm may send the warning up to a minute early, so rarely before the first step: then there is
    # no checkpoint yet and resume starts over, which is still the right thing to do
    expected = (f"resuming {run_dir}: its latest checkpoint holds {s['step']} of {steps} steps" if s["step"]
                else f"no checkpoint in {run_dir}")
    assert expected in resumed.stderr
    if s["step"]:  # --wait follows the job: it says what the trainers loaded
        assert f"the trainers resumed from the checkpoint after {s['step']} steps" in resumed.stderr
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(steps))
    final = status(run_dir)
    assert (final["state"], final["step"], final["restarts"]) == ("COMPLETED", steps, 1)
