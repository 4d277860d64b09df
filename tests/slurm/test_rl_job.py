"""The real RL job as a plain-sbatch user runs it: `rltools render`, then `sbatch` the script."""

import json

from rltools.config import load_config
from rltools.launch.run_dir import prepare_run_dir
from rltools.launch.sbatch import render_sbatch

from .conftest import sbatch, wait_for_job


def test_rendered_demo_hetjob_trains_across_nodes(slurm, repo, tmp_path):
    config = load_config(
        repo / "configs" / "demo.yaml",
        [
            "cluster.launcher=slurm",
            f"run.dir={tmp_path / 'run'}",
            "schedule.steps=4",
            "eval.problems=16",
            "cluster.generators.mem=null",
            "cluster.trainers.mem=null",
            "cluster.time=00:10:00",
        ],
    )
    paths = prepare_run_dir(config, render_sbatch(config))
    states = wait_for_job(sbatch(paths.sbatch_script), timeout_s=300)
    logs = {p.name: p.read_text() for p in paths.attempt_log_dir(0).glob("*.log")}
    assert set(states.values()) == {"COMPLETED"}, (states, {k: v[-1500:] for k, v in logs.items()})
    steps = [json.loads(line)["step"] for line in paths.metrics.read_text().splitlines()]
    assert steps == [0, 1, 2, 3]
    assert sorted(p.name for p in paths.eval_dir.iterdir()) == ["step_0.json", "step_4.json"]
    # trainer rank 0 hosted the weight-sync store on its own node's address, not the generator's
    address = json.loads(paths.sync_address.read_text())
    assert address["host"].startswith("127.0.1.") and "admitted generator worker(s) [1]" in logs["trainer_0.log"]
