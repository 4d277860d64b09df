"""The real RL job as a plain-sbatch user runs it: `rltools render`, then `sbatch` the script."""

import json

from .conftest import cli, demo_run, sbatch, wait_for_job


def test_rendered_demo_hetjob_trains_across_nodes(slurm, repo, tmp_path):
    paths = demo_run(repo, tmp_path, "schedule.steps=4", "eval.problems=16", "cluster.time=00:10:00")
    job_id = sbatch(paths.sbatch_script)
    states = wait_for_job(job_id, timeout_s=300)
    logs = {p.name: p.read_text() for p in paths.attempt_log_dir(0).glob("*.log")}
    assert set(states.values()) == {"COMPLETED"}, (states, {k: v[-1500:] for k, v in logs.items()})
    steps = [json.loads(line)["step"] for line in paths.metrics.read_text().splitlines()]
    assert steps == [0, 1, 2, 3]
    assert sorted(p.name for p in paths.eval_dir.iterdir()) == ["step_0.json", "step_4.json"]
    # trainer rank 0 hosted the weight-sync store on its own node's address, not the generator's
    address = json.loads(paths.sync_address.read_text())
    assert address["host"].startswith("127.0.1.") and "admitted generator worker(s) [1]" in logs["trainer_0.log"]

    # the run directory of a hand-submitted job works with the same commands
    status = json.loads(cli("status", paths.root, "--json").stdout)
    assert (status["job_id"], status["state"], status["step"]) == (job_id, "COMPLETED", 4)
    assert "admitted generator worker(s)" in cli("logs", paths.root, "--role", "trainer").stdout
