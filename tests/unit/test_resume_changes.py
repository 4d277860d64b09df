"""`rltools resume RUN --set KEY=V`: which keys a resume may change, extending a completed run, and
the config it writes into the run directory (the launcher replaced by a recorder: nothing runs)."""

import pytest

from rltools.cli import main
from rltools.config import load_config
from rltools.launch.run_dir import RESUMABLE, differing_keys, prepare_run_dir
from rltools.launch.sbatch import render_sbatch
from rltools.paths import CHECKPOINT_MARKER, RunPaths


@pytest.fixture
def completed(repo, tmp_path, monkeypatch):
    """A demo run of 20 steps whose checkpoint holds all 20; `launched` records what resume would run."""
    run_dir = tmp_path / "run"
    assert main(["render", str(repo / "configs/demo.yaml"), "--set", f"run.dir={run_dir}", "--set", "schedule.steps=20",
                 "--set", "algorithm.lr_schedule=cosine", "--set", "algorithm.min_lr_ratio=0.1"]) == 0
    paths = RunPaths(run_dir)
    paths.checkpoint_dir(20).mkdir(parents=True)
    (paths.checkpoint_dir(20) / CHECKPOINT_MARKER).write_text("")
    launched = []

    def run_local(config, paths, lock, progress):
        launched.append(config)
        return 0

    monkeypatch.setattr("rltools.launch.local.run_local", run_local)
    return paths, launched


def test_resume_extends_a_completed_run_and_writes_its_new_config(completed, capsys):
    paths, launched = completed
    capsys.readouterr()
    assert main(["resume", str(paths.root), "--set", "schedule.steps=30", "--set", "schedule.eval_every=5",
                 "--set", "cluster.time=01:00:00", "--set", "run.samples_per_step=64"]) == 0
    err = capsys.readouterr().err
    assert [c.schedule.steps for c in launched] == [30]
    stored = load_config(paths.config)
    assert (stored.schedule.steps, stored.schedule.eval_every, stored.cluster.time) == (30, 5, "01:00:00")
    assert stored.run.samples_per_step == 64  # what a step keeps to read made nothing the run trained on
    assert stored.model_copy(update={"schedule": launched[0].schedule, "cluster": launched[0].cluster}) == launched[0]
    assert "latest checkpoint holds 20 of 30 steps" in err
    # the horizon moved: the rate at step 20 is the new curve's (0.1 + 0.9 x (1 + cos(2 pi / 3)) / 2 = 0.325 of 1e-3)
    assert "the cosine learning-rate schedule is re-derived over 30 steps from step 20 on: its rate there is 0.000325 " \
           "(0.0001 over 20 steps)" in err


def test_a_completed_run_without_more_steps_stays_done(completed, capsys):
    paths, launched = completed
    capsys.readouterr()
    assert main(["resume", str(paths.root)]) == 0
    err = capsys.readouterr().err
    assert not launched and "is complete: its checkpoint holds all 20 steps; extend it with --set schedule.steps=N" in err
    assert load_config(paths.config).schedule.steps == 20


@pytest.mark.parametrize("override", ["algorithm.learning_rate=1e-4", "schedule.group_size=4", "lora.rank=4",
                                      "eval.k=4", "schedule={steps: 40}", "model.path=/elsewhere"])
def test_resume_refuses_keys_that_made_the_run_and_lists_those_it_may_change(completed, capsys, override):
    paths, launched = completed
    before = paths.config.read_text()
    assert main(["resume", str(paths.root), "--set", "schedule.steps=30", "--set", override]) == 2
    err = capsys.readouterr().err
    assert f"resume cannot change ['{override}']" in err
    assert "cluster.*" in err and "schedule.steps" in err and "schedule.eval_every" in err  # what it may change
    assert not launched and paths.config.read_text() == before


def test_resume_may_turn_a_tracker_on(completed, monkeypatch):
    monkeypatch.setattr("rltools.tracking.find_spec", lambda name: object())  # as if mlflow were installed
    paths, launched = completed
    assert main(["resume", str(paths.root), "--set", "schedule.steps=30", "--set", "trackers.mlflow.experiment=grpo"]) == 0
    assert launched[0].trackers.mlflow.experiment == load_config(paths.config).trackers.mlflow.experiment == "grpo"


def test_resume_never_shortens_a_run_past_its_checkpoint(completed, capsys):
    paths, launched = completed
    assert main(["resume", str(paths.root), "--set", "schedule.steps=10"]) == 2
    assert "schedule.steps 10 is below the 20 steps" in capsys.readouterr().err
    assert not launched and load_config(paths.config).schedule.steps == 20


def test_the_run_directory_compares_configs_key_by_key(repo, tmp_path):
    config = load_config(repo / "configs/demo.yaml", [f"run.dir={tmp_path / 'run'}"])
    prepare_run_dir(config, render_sbatch(config))
    longer = load_config(repo / "configs/demo.yaml", [f"run.dir={tmp_path / 'run'}", "schedule.steps=2000"])
    prepare_run_dir(longer, render_sbatch(longer), RESUMABLE)
    assert load_config(tmp_path / "run" / "config.yaml").schedule.steps == 2000
    other = load_config(repo / "configs/demo.yaml", [f"run.dir={tmp_path / 'run'}", "schedule.steps=2000",
                                                     "schedule.prompts_per_step=8"])
    with pytest.raises(Exception, match=r"already holds a different config \(schedule\.prompts_per_step differ\)"):
        prepare_run_dir(other, render_sbatch(other), RESUMABLE)


def test_differing_keys_are_dotted_leaves():
    old = {"a": {"b": 1, "c": {"d": 2}}, "e": 3}
    new = {"a": {"b": 1, "c": {"d": 4}}, "e": 3, "f": {"g": 1}}
    assert differing_keys(old, new) == ["a.c.d", "f"]
