"""The judge component on the local launcher: the tiny model as a judge (two vLLM engines) scores the demo's
rollouts as one weighted, named reward function; one judge engine dies at its second request and the run
goes on with the other (the wire, deadlines and the failure cases: tests/unit/test_judge.py; on the local
Slurm: tests/slurm/test_fleet.py)."""

import json
import os
import subprocess
import sys
from collections import defaultdict

from tests.judges import TINY_JUDGE

from rltools.paths import RunPaths

STEPS = 4


def test_a_judge_component_scores_the_rollouts_and_outlives_the_loss_of_an_engine(repo, tmp_path, one_process_vllm):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "rltools", "submit", str(repo / "configs" / "demo.yaml")]
    for override in [f"run.dir={run_dir}", f"schedule.steps={STEPS}", f"schedule.eval_every={STEPS}", "eval.problems=16",
                     "cluster.judges.ntasks_per_node=2", *TINY_JUDGE]:
        argv += ["--set", override]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=repo,
                            env={**os.environ, "RLTOOLS_FAULT": "judge.serve@2/1=kill"})  # judge 1, its 2nd request
    assert result.returncode == 0, result.stderr[-3000:]
    assert "judge 1 failed (exit -9); the run goes on with the other judge engines" in result.stderr

    paths = RunPaths(run_dir)
    metrics = [json.loads(line) for line in paths.metrics.read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert all(m["reward_failures"] == 0 and m["reward/judge"] > 0 for m in metrics), metrics
    logs = {p.name: p.read_text() for p in paths.attempt_log_dir(0).glob("*.log")}
    assert "judge 1 is lost" in logs["generator_0.log"]
    assert "judge 0 stopping (SIGTERM)" in logs["judge_0.log"], "the launcher stops the judges once the run is over"

    # each completion's judge score is the judge's reply to its own prompt, through the split across the
    # engines and the re-sending of the lost engine's share: one score per (problem, completion length)
    judged = defaultdict(set)
    for step in range(STEPS):
        for line in (run_dir / "samples" / f"step_{step}.jsonl").read_text().splitlines():
            sample = json.loads(line)
            judged[sample["prompt"], len(sample["completion"])].add(sample["scores"]["judge"])
    assert judged and all(len(scores) == 1 for scores in judged.values()), judged
    assert len({score for scores in judged.values() for score in scores}) > 1, "the judge's replies differ"
