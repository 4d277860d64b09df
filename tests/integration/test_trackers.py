"""The demo job with both experiment trackers on: W&B offline and MLflow's file store get each step's
scalars (a reward's named scores apart), the config, each step's kept completions (a table) and the evaluations (scalars and a table,
the final one included); a resume that
extends the run continues the same tracker runs with the later steps."""

import json
import subprocess
import sys

import pytest

from rltools.paths import RunPaths
from tests.integration.test_local_launcher import submit
from tests.unit import wandb_records

pytest.importorskip("wandb")
pytest.importorskip("mlflow")


def test_both_trackers_record_the_demo_and_a_resume_continues_their_runs(repo, tmp_path, one_process_vllm,
                                                                          monkeypatch):
    run_dir = tmp_path / "run"
    paths = RunPaths(run_dir)
    result = submit(repo, run_dir, "schedule.steps=3", "schedule.eval_every=2", "schedule.checkpoint_every=3",
                    "eval.problems=16", "trackers.wandb.tags=[ci]", "trackers.mlflow={}",
                    "reward.functions=[{function: tests.unit.reward_fns:format_and_correct, weight: {correct: 1}}]")
    assert result.returncode == 0, result.stderr[-3000:]
    ids = json.loads(paths.trackers.read_text())
    assert ids["wandb"]["evals"] == ids["mlflow"]["evals"] == [0, 2, 3]  # the final one waited for
    resumed = subprocess.run([sys.executable, "-m", "rltools", "resume", str(run_dir), "--set", "schedule.steps=5"],
                             capture_output=True, text=True, timeout=600, cwd=repo)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = json.loads(paths.trackers.read_text())
    assert {name: after[name]["run_id"] for name in after} == {name: ids[name]["run_id"] for name in ids}
    assert after["mlflow"]["evals"] == [0, 2, 3, 4, 5]

    first, second = wandb_records.offline_runs(paths.wandb)
    assert {wandb_records.run_id(first), wandb_records.run_id(second)} == {ids["wandb"]["run_id"]}
    rows = [wandb_records.history(first), wandb_records.history(second)]
    steps = [[row["step"] for row in start if "train/loss" in row] for start in rows]
    assert steps == [[1, 2, 3], [4, 5]]
    named = [row for row in rows[0] if "train/reward/correct" in row]  # the reward's named scores, apart
    assert [row["step"] for row in named] == [1, 2, 3] and all("train/reward/format" in row for row in named)
    evals = [row for row in rows[0] if "eval/held_out/avg_at_k" in row]
    assert [row["step"] for row in evals] == [0, 2, 3]
    (table,) = [row for row in rows[0] if row["step"] == 3 and "eval/held_out/problems/path" in row]
    problems = wandb_records.table(first, table, "eval/held_out/problems")
    assert problems["columns"] == ["problem", "accuracy"] and len(problems["data"]) == 16
    assert [wandb_records.config(start)["schedule"]["steps"] for start in (first, second)] == [3, 5]
    (kept,) = [row for row in rows[0] if row["step"] == 2 and "samples/path" in row]  # step 2's kept completions
    completions = wandb_records.table(first, kept, "samples")
    assert {"prompt", "completion", "reward", "advantage"} <= set(completions["columns"])
    assert len(completions["data"]) == 16

    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads a file store only when told to
    client = MlflowClient(tracking_uri=paths.mlruns.as_uri())
    run = client.get_run(ids["mlflow"]["run_id"])
    assert run.info.status == "FINISHED" and run.data.params["schedule.eval_every"] == "2"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/reward_mean")] == [1, 2, 3, 4, 5]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/reward/format")] == [1, 2, 3, 4, 5]
    evaluated = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval/held_out/avg_at_k")}
    recorded = {step: json.loads(paths.eval_result(step).read_text())["sets"]["held_out"]["avg_at_k"]
                for step in evaluated}
    assert sorted(evaluated) == [0, 2, 3, 4, 5] and evaluated == recorded
    tables = [f.path.rsplit("/", 1)[1] for f in client.list_artifacts(run.info.run_id, "tables/eval/held_out/problems")]
    assert sorted(tables) == [f"step_{step}.json" for step in (0, 2, 3, 4, 5)]
    kept = [f.path.rsplit("/", 1)[1] for f in client.list_artifacts(run.info.run_id, "tables/samples")]
    assert sorted(kept) == [f"step_{step}.json" for step in (1, 2, 3, 4, 5)]
