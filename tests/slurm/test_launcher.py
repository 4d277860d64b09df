"""`rltools submit` with cluster.launcher: slurm, and the commands that follow a run: status, logs, cancel, plot."""

import json
import subprocess
import time

from tests.judges import TINY_JUDGE

from rltools.launch.slurm import SqueueJob
from rltools.paths import RunPaths

from .conftest import cli, slurm_demo_overrides


def submit(repo, run_dir, *overrides, wait=True):
    argv = ["submit", repo / "configs" / "demo.yaml", *slurm_demo_overrides(run_dir, *overrides)]
    return cli(*argv, "--wait") if wait else cli(*argv)


def status(run_dir) -> dict:
    result = cli("status", run_dir, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_submitted_demo_runs_across_two_nodes(slurm, repo, tmp_path):
    """The demo as one hetjob (that it learns is tests/integration/test_local_launcher.py's: the same
    code, seed and numbers), then the commands that follow a run."""
    run_dir = tmp_path / "run"
    result = submit(repo, run_dir, "schedule.steps=30", "schedule.eval_every=30", "eval.problems=64")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "held-out avg@8:" in result.stderr and "COMPLETED" in result.stderr

    s = status(run_dir)
    assert (s["state"], s["step"], s["total_steps"], s["restarts"]) == ("COMPLETED", 30, 30, 0)
    nodes = {name: c["nodes"] for name, c in s["components"].items()}
    assert set(nodes) == {"generators", "trainers"} and nodes["generators"] != nodes["trainers"], nodes
    assert set(s["evals"]) == {"0", "30"} and s["last_metrics"]["step"] == 29, s

    # submitit's side: each task's return value is pickled in its component's folder
    job = SqueueJob(folder=RunPaths(run_dir).submitit_dir("trainer"), job_id=s["job_id"], tasks=[0])
    assert job.result() == "trainer 0 finished"
    assert list((run_dir / "tb").glob("events.out.tfevents.*")), "no TensorBoard event file"

    logs = cli("logs", run_dir, "--role", "trainer", "--rank", "0")
    assert logs.returncode == 0 and "admitted generator worker(s) [1]" in logs.stdout, logs.stderr
    # `rltools eval` of a Slurm run is a Slurm job itself (one task on a generator's resources) and
    # reproduces the run's own evaluation of the same policy
    evaluated = cli("eval", run_dir, "--checkpoint", "latest", "--json")
    assert evaluated.returncode == 0, evaluated.stderr[-2000:]
    assert "submitted eval job" in evaluated.stderr
    result, recorded = json.loads(evaluated.stdout), json.loads((run_dir / "eval/step_30.json").read_text())
    timeless = [{name: {k: v for k, v in summary.items() if k != "seconds"} for name, summary in r["sets"].items()}
                for r in (result, recorded)]
    assert result["step"] == 30 and timeless[0] == timeless[1] and list(result["sets"]) == ["held_out"]

    png = tmp_path / "run.png"
    plotted = cli("plot", run_dir, "-o", png)
    assert plotted.returncode == 0, plotted.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failing_generator_fails_the_job_fast_and_is_named(slurm, repo, tmp_path):
    run_dir = tmp_path / "run"
    start = time.monotonic()
    # 1 KiB of KV cache cannot hold one sequence: the generator's vLLM engine refuses to start, while the
    # trainer would wait schedule.rollout_timeout_s (30 min) for its rollouts.
    result = submit(repo, run_dir, "generator.kv_cache_memory_bytes=1024", "schedule.steps=2")
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stderr[-3000:]
    assert elapsed < 120, f"the failed job took {elapsed:.0f} s to end"

    s = status(run_dir)
    assert s["state"] == "FAILED" and s["failed_component"] == "generators", s
    assert "generator_0.log" in s["log_tail"] and "Error" in s["log_tail"], s["log_tail"]
    assert "the generators component failed first" in cli("status", run_dir).stdout
    assert (run_dir / "slurm/logs/attempt_0/trainer.exit").read_text().strip() != "0"  # stopped, not waiting


def test_cancel_stops_every_process_of_the_job(slurm, repo, tmp_path):
    """Every component's, a judge's included (its vLLM engine-core process too)."""
    run_dir = tmp_path / "run"
    result = submit(repo, run_dir, "schedule.steps=5000", *TINY_JUDGE, wait=False)
    assert result.returncode == 0, result.stderr
    # vLLM's engine-core process starts in ~15 s idle, minutes on a loaded 2-core machine (the suite
    # runs three processes): the deadline is for a job that never trains, not for a slow start.
    deadline = time.monotonic() + 360
    try:
        while not (run_dir / "metrics.jsonl").exists():  # mid-run: training has started
            assert time.monotonic() < deadline, status(run_dir)
            time.sleep(0.5)
    except AssertionError:
        cli("cancel", run_dir)  # a 5000-step job left running would slow every later test
        raise

    cancelled = cli("cancel", run_dir)
    assert cancelled.returncode == 0 and "CANCELLED" in cancelled.stdout, (cancelled.stdout, cancelled.stderr)
    assert status(run_dir)["state"] == "CANCELLED"
    deadline = time.monotonic() + 30
    while (alive := subprocess.run(["pgrep", "-af", str(run_dir)], capture_output=True, text=True).stdout.strip()):
        assert time.monotonic() < deadline, f"processes of the cancelled job remain:\n{alive}"
        time.sleep(0.5)
