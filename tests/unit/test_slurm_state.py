"""Reading a job's state without accounting, and a run's status from its directory alone."""

import json
import os

import pytest

from rltools.config import load_config
from rltools.launch.run_dir import prepare_run_dir
from rltools.launch.run_lock import RunLock
from rltools.launch.sbatch import render_sbatch
from rltools.launch.slurm import _components, minutes, overall_state
from rltools.monitor.status import format_status, run_status


@pytest.mark.parametrize("text,expected", [("30", 30), ("00:30:00", 30), ("1:00:01", 61), ("2-00:00:00", 2880),
                                           ("1-2", 1560), ("90:30", 91), ("0:10", 1)])
def test_slurm_time_formats_in_minutes(text, expected):
    assert minutes(text) == expected


def test_hetjob_rows_become_named_components():
    rows = [["77+0", "RUNNING", "n1", "None"], ["77+1", "CANCELLED by 0", "n2", "None"], ["77.batch", "x", "", ""]]
    assert _components(rows) == {
        "generators": {"state": "RUNNING", "nodes": "n1", "reason": "None"},
        "trainers": {"state": "CANCELLED", "nodes": "n2", "reason": "None"},
    }


@pytest.mark.parametrize("states,expected", [
    (["RUNNING", "RUNNING"], "RUNNING"),
    (["COMPLETED", "COMPLETED"], "COMPLETED"),
    (["COMPLETED", "FAILED"], "FAILED"),
    (["CANCELLED", "RUNNING"], "CANCELLED"),
    (["PENDING", "PENDING"], "PENDING"),
    (["TIMEOUT", "CANCELLED"], "TIMEOUT"),
])
def test_one_word_for_the_job(states, expected):
    assert overall_state(states) == expected


def make_run(repo, tmp_path, *overrides):
    config = load_config(repo / "configs" / "demo.yaml", [f"run.dir={tmp_path / 'run'}", *overrides])
    return prepare_run_dir(config, render_sbatch(config))


def test_status_after_the_job_left_the_queue_names_the_component_that_failed_first(repo, tmp_path):
    paths = make_run(repo, tmp_path, "cluster.launcher=slurm")
    paths.job_id_file.write_text("999999\n")  # long gone: squeue and sacct do not know it
    attempt = paths.attempt_log_dir(1)
    attempt.mkdir(parents=True)
    paths.task_log(1, "generator", 0).write_text("loading\nTraceback (most recent call last):\nValueError: boom\n")
    paths.task_log(1, "trainer", 0).write_text("waiting for rollouts\n")
    paths.component_exit(1, "generator").write_text("1\n")
    paths.component_exit(1, "trainer").write_text("143\n")
    os.utime(paths.component_exit(1, "generator"), (1000, 1000))  # the generator ended first
    os.utime(paths.component_exit(1, "trainer"), (2000, 2000))
    paths.metrics.write_text(json.dumps({"step": 0, "reward_mean": 0.5, "accuracy": 0.5, "time": 1.0}) + "\n")

    status = run_status(paths)
    assert (status.state, status.restarts, status.step, status.job_id) == ("FAILED", 1, 1, "999999")
    assert status.failed_component == "generators"
    assert "ValueError: boom" in status.log_tail and "generator_0.log" in status.log_tail
    assert "the generators component failed first" in format_status(status)


def test_status_of_local_runs_from_the_exit_files_the_launcher_writes(repo, tmp_path):
    paths = make_run(repo, tmp_path, "schedule.steps=2")
    lines = [{"step": s, "reward_mean": 0.1, "accuracy": 0.1, "time": 10.0 + s} for s in range(2)]
    paths.metrics.write_text("".join(json.dumps(m) + "\n" for m in lines))
    paths.attempt_log_dir(0).mkdir(parents=True)
    with RunLock.acquire(paths, by="a local launcher"):  # a live launcher holds the run's lock
        assert run_status(paths).state == "RUNNING"
    for role, code in (("generator", 0), ("trainer", 3)):
        paths.component_exit(0, role).write_text(f"{code}\n")
    stopped = run_status(paths)
    assert stopped.state == "STOPPED" and "continue with: rltools resume" in format_status(stopped)
    paths.component_exit(0, "trainer").write_text("0\n")
    status = run_status(paths)
    assert (status.state, status.step, status.total_steps, status.job_id) == ("COMPLETED", 2, 2, None)


def test_a_trainer_stopped_because_the_generators_failed_is_a_failure_of_the_generators(repo, tmp_path):
    paths = make_run(repo, tmp_path, "schedule.steps=2")
    paths.attempt_log_dir(0).mkdir(parents=True)
    paths.task_log(0, "generator", 0).write_text("error: reward.function m:f (reward.type custom) failed on 65 ...\n")
    for role, code in (("trainer", 3), ("generator", 2)):  # the launcher stopped the trainer, which checkpointed
        paths.component_exit(0, role).write_text(f"{code}\n")
    status = run_status(paths)
    assert (status.state, status.failed_component) == ("FAILED", "generators")
    assert "error: reward.function m:f" in format_status(status)
    paths.component_exit(0, "generator").write_text("143\n")  # killed at the time limit: the trainers' stop stands
    assert run_status(paths).state == "STOPPED"


def test_a_resume_forgets_what_steps_after_the_checkpoint_recorded(repo, tmp_path):
    from rltools.metrics import resume_metrics

    paths = make_run(repo, tmp_path)
    paths.metrics.write_text("".join(json.dumps({"step": s, "reward_mean": 0.1}) + "\n" for s in range(7))
                             + '{"step": 7, "rew')  # a line cut by the crash
    paths.eval_dir.mkdir()
    for step in (0, 5, 6):
        paths.eval_result(step).write_text("{}")
    resume_metrics(paths, steps_done=5)
    assert [json.loads(line)["step"] for line in paths.metrics.read_text().splitlines()] == [0, 1, 2, 3, 4]
    assert sorted(p.name for p in paths.eval_dir.iterdir()) == ["step_0.json", "step_5.json"]
    assert list(paths.tensorboard.glob("events.out.tfevents.*"))  # reopened with the later steps purged


def test_logs_print_each_task_log_under_a_header_and_follow_ends_with_the_run(repo, tmp_path, capsys):
    from rltools.errors import UserError
    from rltools.monitor.logs import show_logs

    paths = make_run(repo, tmp_path)
    with pytest.raises(UserError, match="no logs yet"):
        show_logs(paths, None, None, follow=False)
    paths.attempt_log_dir(0).mkdir(parents=True)
    paths.task_log(0, "generator", 0).write_text("gen line\n")
    paths.task_log(0, "trainer", 0).write_text("trainer line\n")
    # no live launcher (no slurm/local.pid) and no Slurm job: -f returns after one poll
    show_logs(paths, None, None, follow=True)
    out = capsys.readouterr().out
    assert out.index("generator_0.log <==\ngen line") < out.index("trainer_0.log <==\ntrainer line")
    show_logs(paths, "trainer", 0, follow=False)
    assert "gen line" not in capsys.readouterr().out
    with pytest.raises(UserError, match="is rank 3 within"):
        show_logs(paths, "trainer", 3, follow=False)


def test_waits_end_when_the_job_leaves_the_queue_without_a_known_end(repo, tmp_path, monkeypatch):
    import rltools.launch.slurm as slurm
    import rltools.monitor.status as monitor_status

    paths = make_run(repo, tmp_path, "cluster.launcher=slurm")
    paths.job_id_file.write_text("999999\n")  # neither squeue nor sacct knows it
    monkeypatch.setattr(monitor_status, "UNSEEN_S", 0.0)
    assert monitor_status.wait_for_end(paths).state == "UNKNOWN"  # returns instead of polling forever

    answers = iter(["RUNNING", "UNKNOWN"])
    monkeypatch.setattr(slurm, "job_state", lambda job_id: {"state": next(answers), "components": {}})
    watcher = slurm.SqueueWatcher(delay_s=5)
    assert watcher.get_state("7", mode="force") == "RUNNING"
    watcher.update()  # the next poll: squeue has forgotten the job
    assert watcher.get_state("7", mode="cache") == slurm.LEFT_QUEUE
    assert watcher.is_done("7", mode="cache")  # submitit's job.result() stops waiting


def test_status_lists_the_engine_pool_with_join_jobs_losses_and_samples(repo, tmp_path):
    from rltools.runtime.fleet import FleetRecord, add_join, set_join_job

    paths = make_run(repo, tmp_path, "generator.slots=4")
    set_join_job(paths, add_join(paths, configured=1, engines=1, nodes=1), "77")
    record = FleetRecord.start(1, slots=4)
    record.live = [0, 1]
    record.note("joined", 1, 3)
    record.reassign(3)
    record.count(3, [8, 8, 8, 8])
    record.where = {"0": {"node": "n1", "job": "70"}, "1": {"node": "n3", "job": "77"}}
    record.live = [0]
    record.note("lost", 1, 6, "it left: its job ends")
    record.write(paths)
    status = run_status(paths)
    pool = status.engines["pool"]
    assert [(e["engine"], e["state"], e["node"], e["since_step"], e["samples"]) for e in pool] == [
        (0, "live", "n1", 0, 16), (1, "left", "n3", 3, 16)]
    assert pool[1]["join_job"] == "77" and json.loads(json.dumps(status.to_json()))["engines"]["pool"] == pool
    text = format_status(status)
    assert "generator engines: 1 live (1 configured, 1 joined); left: generator 1 at step 6\n" in text
    assert "join job 77" in text and "restarts 0" in text
