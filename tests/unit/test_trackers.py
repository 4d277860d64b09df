"""The experiment trackers, each real: W&B offline (read back from its transaction log) and MLflow's file
store (read back with MlflowClient); a second start continues the same tracker run. Then what trainer
rank 0 does with them (`Trackers`): each step, each evaluation once, resume, the final evaluation."""

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from rltools.config import load_config
from rltools.config.trackers import MlflowConfig, TrackersConfig, WandbConfig
from rltools.errors import UserError
from rltools.launch.preflight import check_trackers
from rltools.paths import RunPaths
from rltools.tracking import check_installed
from rltools.tracking.trackers import Trackers, loggable
from tests.unit import wandb_records

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

ROWS = [{"problem": 0, "accuracy": 0.5}, {"problem": 1, "accuracy": 1.0}]


@pytest.fixture
def paths(tmp_path):
    paths = RunPaths(tmp_path / "run")
    paths.create()
    paths.config.write_text("run: {name: demo}\nschedule: {steps: 4}\n"
                            "cluster: {environment: {WANDB_API_KEY: s3cret}}\n")
    return paths


def mlflow_client(paths: RunPaths):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=paths.mlruns.as_uri())


def history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_wandb_offline_run_records_scalars_config_and_tables_and_a_second_start_continues_it(paths):
    from rltools.tracking.wandb_tracker import WandbTracker

    first = WandbTracker(WandbConfig(tags=["t1"]), paths, "demo", None)
    first.config({"schedule": {"steps": 4}})
    first.scalars({"train/loss": 0.5}, 1)
    first.table("eval/held_out/problems", ROWS, 1)
    first.finish("stopped")
    assert "offline" in first.where and f"wandb sync {paths.wandb}/offline-run-*" in first.where
    second = WandbTracker(WandbConfig(), paths, "demo", first.run_id)
    second.config({"schedule": {"steps": 6}})
    second.scalars({"train/loss": 0.25}, 2)
    second.finish("finished")
    # nothing of W&B's outlives the trainer: its service was started for this process's pid
    assert subprocess.run(["pgrep", "-f", f"wandb-core.*--pid {os.getpid()}"], capture_output=True).stdout == b""

    folders = wandb_records.offline_runs(paths.wandb)
    assert len(folders) == 2 and {wandb_records.run_id(f) for f in folders} == {first.run_id}
    rows = [wandb_records.history(f) for f in folders]
    assert [(r["step"], r["train/loss"]) for r in rows[0] if "train/loss" in r] == [(1, 0.5)]
    assert [(r["step"], r["train/loss"]) for r in rows[1] if "train/loss" in r] == [(2, 0.25)]
    (tabled,) = [r for r in rows[0] if "eval/held_out/problems/path" in r]
    assert tabled["step"] == 1
    assert wandb_records.table(folders[0], tabled, "eval/held_out/problems") == \
        {"columns": ["problem", "accuracy"], "data": [[0, 0.5], [1, 1.0]]}
    assert wandb_records.config(folders[0])["schedule"] == {"steps": 4}
    assert wandb_records.config(folders[1])["schedule"] == {"steps": 6}


def test_mlflow_file_store_records_params_metrics_tables_and_a_second_start_continues_it(paths, caplog):
    from rltools.tracking.mlflow_tracker import MlflowTracker

    first = MlflowTracker(MlflowConfig(), paths, "demo", None)
    first.config({"schedule": {"steps": 4, "eval_every": 2}, "lora": {"target_modules": ["q_proj"]}})
    first.scalars({"train/loss": 0.5}, 1)
    first.table("eval/held_out/problems", ROWS, 1)
    first.finish("stopped")
    second = MlflowTracker(MlflowConfig(), paths, "demo", first.run_id)
    assert second.run_id == first.run_id
    second.config({"schedule": {"steps": 6, "eval_every": 2}, "lora": {"target_modules": ["q_proj"]}})
    second.scalars({"train/loss": 0.25}, 2)
    second.finish("finished")

    client = mlflow_client(paths)
    run = client.get_run(first.run_id)
    assert (run.info.status, run.info.run_name) == ("FINISHED", "demo")
    assert client.get_experiment(run.info.experiment_id).name == "rltools"
    assert history(client, first.run_id, "train/loss") == [(1, 0.5), (2, 0.25)]
    assert run.data.params["schedule.steps"] == "4"  # MLflow keeps a param's first value: a warning says so
    assert run.data.params["lora.target_modules"] == '["q_proj"]'
    assert "schedule.steps changed, but an MLflow param keeps its first value" in caplog.text
    config = yaml.safe_load(Path(client.download_artifacts(first.run_id, "config.yaml")).read_text())
    assert config["schedule"]["steps"] == 6  # the whole config of the latest start
    table = Path(client.download_artifacts(first.run_id, "tables/eval/held_out/problems/step_1.json"))
    table = json.loads(table.read_text())
    assert table == {"columns": ["problem", "accuracy"], "data": [[0, 0.5], [1, 1.0]]}


def write_eval(paths: RunPaths, step: int, avg: float) -> None:
    paths.eval_dir.mkdir(exist_ok=True)
    summary = {"avg_at_k": avg, "k": 8, "per_problem_accuracy": [avg, 1.0], "temperature": 1.0}
    paths.eval_result(step).write_text(json.dumps({"step": step, "sets": {"held_out": summary}}))


def record(step: int, loss: float) -> dict:
    return {"step": step, "loss": loss, "logprob_gap_engines": [0.0], "time": 1.0}


def test_trainer_rank_0_logs_each_step_and_each_evaluation_once_and_a_resume_continues(paths):
    section = TrackersConfig(mlflow=MlflowConfig())
    write_eval(paths, 0, 0.25)
    trackers = Trackers.start(section, paths, "demo", done=0)  # the base model's evaluation is there already
    run_id = trackers.opened["mlflow"].run_id
    for step in range(3):
        trackers.log_step(record(step, 1.0 / (step + 1)))
        if step == 1:
            write_eval(paths, 2, 0.5)
    trackers.close("failed")  # a crash after step 3 (steps done); the checkpoint holds 2
    client = mlflow_client(paths)
    assert history(client, run_id, "train/loss") == [(1, 1.0), (2, 0.5), (3, 1 / 3)]
    assert history(client, run_id, "eval/held_out/avg_at_k") == [(0, 0.25), (2, 0.5)]
    assert "train/logprob_gap_engines" not in client.get_run(run_id).data.metrics  # lists are not scalars
    assert json.loads(paths.trackers.read_text())["mlflow"] == {"run_id": run_id, "evals": [0, 2]}
    assert client.get_run(run_id).info.status == "FAILED"

    resumed = Trackers.start(section, paths, "demo", done=2)
    assert resumed.opened["mlflow"].run_id == run_id
    resumed.log_step(record(2, 0.3))  # step 3 again: a second point at that step
    paths.eval_result(2).unlink()  # a resume from 1 step forgets the evaluation after it
    resumed.close("finished")
    assert history(client, run_id, "train/loss")[-2:] == [(3, 0.3), (3, 1 / 3)]
    again = Trackers.start(section, paths, "demo", done=1)
    assert json.loads(paths.trackers.read_text())["mlflow"]["evals"] == [0]
    write_eval(paths, 2, 0.75)
    again.log_step(record(1, 0.4))
    again.close("finished")
    assert history(client, run_id, "eval/held_out/avg_at_k") == [(0, 0.25), (2, 0.5), (2, 0.75)]
    assert [f.path for f in client.list_artifacts(run_id, "tables/eval/held_out/problems")] == \
        ["tables/eval/held_out/problems/step_0.json", "tables/eval/held_out/problems/step_2.json"]


def test_a_tracker_turned_on_at_a_resume_gets_the_records_so_far(paths):
    paths.metrics.write_text("".join(json.dumps(record(step, 0.1 * step)) + "\n" for step in range(2)))
    write_eval(paths, 0, 0.25)
    trackers = Trackers.start(TrackersConfig(mlflow=MlflowConfig()), paths, "demo", done=2)
    run_id = trackers.opened["mlflow"].run_id
    trackers.close("finished")
    client = mlflow_client(paths)
    assert history(client, run_id, "train/loss") == [(1, 0.0), (2, 0.1)]
    assert history(client, run_id, "eval/held_out/avg_at_k") == [(0, 0.25)]
    params = client.get_run(run_id).data.params
    assert params["cluster.environment.WANDB_API_KEY"] == "***"  # a secret in the config is not logged


def test_the_final_evaluation_is_awaited_within_its_deadline(paths, caplog):
    trackers = Trackers.start(TrackersConfig(mlflow=MlflowConfig()), paths, "demo", done=0)
    run_id = trackers.opened["mlflow"].run_id
    threading.Timer(1.5, write_eval, (paths, 4, 0.5)).start()
    begin = time.monotonic()
    trackers.wait_for_eval(4, timeout_s=30, give_up=lambda: False)
    assert time.monotonic() - begin < 10
    assert history(mlflow_client(paths), run_id, "eval/held_out/avg_at_k") == [(4, 0.5)]
    trackers.wait_for_eval(6, timeout_s=0.1, give_up=lambda: False)
    assert "did not come within trackers.final_eval_timeout_s" in caplog.text and "rltools resume" in caplog.text
    begin = time.monotonic()
    trackers.wait_for_eval(8, timeout_s=60, give_up=lambda: True)  # a stop signal ends the wait
    assert time.monotonic() - begin < 5
    trackers.close("finished")


def test_a_tracker_that_fails_mid_run_is_dropped_and_the_run_goes_on(paths, caplog):
    trackers = Trackers.start(TrackersConfig(mlflow=MlflowConfig()), paths, "demo", done=0)
    shutil.rmtree(paths.mlruns)  # its store is gone
    trackers.log_step(record(0, 1.0))
    assert trackers.opened == {} and "trackers.mlflow failed (scalars)" in caplog.text
    trackers.log_step(record(1, 1.0))  # nothing left to log to: no error
    trackers.close("finished")


def test_a_tracker_that_fails_logging_an_evaluation_is_dropped_before_the_next(paths, caplog):
    trackers = Trackers.start(TrackersConfig(mlflow=MlflowConfig()), paths, "demo", done=0)
    shutil.rmtree(paths.mlruns)
    for step in (0, 2):
        write_eval(paths, step, 0.5)
    trackers.log_evals()
    assert trackers.opened == {} and caplog.text.count("trackers.mlflow failed") == 1
    assert json.loads(paths.trackers.read_text())["mlflow"]["evals"] == []


def test_other_ranks_and_runs_without_trackers_log_nothing(paths):
    trackers = Trackers()
    trackers.log_step(record(0, 1.0))
    trackers.table("samples", ROWS, 1)
    trackers.wait_for_eval(4, timeout_s=60, give_up=lambda: False)  # returns at once
    trackers.close("finished")
    assert not paths.trackers.exists()


def test_a_missing_package_is_named_with_its_key_and_the_pip_command(monkeypatch):
    monkeypatch.setattr("rltools.tracking.find_spec", lambda name: None if name == "mlflow" else object())
    check_installed(TrackersConfig(wandb=WandbConfig()))
    with pytest.raises(UserError, match=r"trackers.mlflow is set, but .* lacks mlflow-skinny: pip install "
                                        r"'rltools\[trackers\]' \(or pip install mlflow-skinny\)"):
        check_installed(TrackersConfig(wandb=WandbConfig(), mlflow=MlflowConfig()))


def test_submit_checks_the_packages_where_the_job_runs_this_python(repo, tmp_path, monkeypatch):
    monkeypatch.setattr("rltools.tracking.find_spec", lambda name: None)
    on = ["trackers.wandb={}", f"run.dir={tmp_path / 'run'}"]
    with pytest.raises(UserError, match="trackers.wandb is set"):
        check_trackers(load_config(repo / "configs/demo.yaml", on))
    elsewhere = load_config(repo / "configs/demo.yaml", [*on, "cluster.python=/opt/venv/bin/python"])
    assert check_trackers(elsewhere) == ["trackers.wandb: its package is not checked here (the job runs another "
                                         "Python); the trainer checks it as it starts"]
    assert check_trackers(load_config(repo / "configs/demo.yaml")) == []


def test_submit_asks_for_the_packages_without_importing_them(repo, tmp_path):
    code = ("import sys\nfrom rltools.cli import main\nassert main(sys.argv[1:]) == 0\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('wandb', 'mlflow')))")
    argv = ["submit", str(repo / "configs/demo.yaml"), "--dry-run", "--set", f"run.dir={tmp_path / 'run'}",
            "--set", "trackers.wandb={}", "--set", "trackers.mlflow.experiment=x"]
    result = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=repo)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_the_trackers_section_is_off_unless_present():
    assert TrackersConfig().wandb is None and TrackersConfig().mlflow is None
    assert TrackersConfig.model_validate({"wandb": {}}).wandb.mode == "offline"
    with pytest.raises(ValueError, match="mode"):
        TrackersConfig.model_validate({"wandb": {"mode": "cloud"}})
    assert loggable({"run": {"name": "x"}})["cluster"] == {"environment": {}}
