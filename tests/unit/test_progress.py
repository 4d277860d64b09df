"""The launcher's progress display follows metrics.jsonl while a resume rewrites it shorter."""

import json

from rltools.config import load_config
from rltools.metrics import _keep_lines
from rltools.monitor.progress import Progress
from rltools.paths import RunPaths


def record(step: int, time: float) -> str:
    return json.dumps({"step": step, "reward_mean": 0.5, "accuracy": 0.5, "gen_tokens_per_s": 1000.0,
                       "generation_s": 0.1, "training_s": 0.1, "sync_s": 0.01, "time": time}) + "\n"


def shown(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_a_resume_that_rewrites_the_metrics_shows_each_new_step_once(repo, tmp_path, capsys):
    config = load_config(repo / "configs" / "demo.yaml", [f"run.dir={tmp_path}", "schedule.steps=10"])
    paths = RunPaths(tmp_path)
    paths.metrics.write_text("".join(record(s, 100.0 + s) for s in range(8)))  # a crashed run: 8 steps
    paths.eval_dir.mkdir()
    paths.eval_result(0).write_text(json.dumps({"k": 8, "avg_at_k": 0.25, "stderr": 0.01, "n_problems": 16}))

    progress = Progress(config, paths)  # the resume's launcher, before its trainer starts
    progress.update()
    assert shown(capsys) == [], "history is not shown again"

    _keep_lines(paths.metrics, lambda r: r["step"] < 5)  # the trainer resumes from its checkpoint of 5 steps
    with open(paths.metrics, "a") as f:
        f.write(record(5, 200.0) + "not json, a line cut by a crash\n" + record(6, 201.0) + '{"step": 7, "rew')
    progress.update()
    assert [line.split(" [")[0] for line in shown(capsys)] == ["step 6/10", "step 7/10"]

    with open(paths.metrics, "a") as f:
        f.write('ard_mean": 0.5, "accuracy": 0.5, "gen_tokens_per_s": 1.0, "generation_s": 0.1, "training_s": 0.1, '
                '"sync_s": 0.01, "time": 202.0}\n')
    paths.eval_result(8).write_text(json.dumps({"k": 8, "avg_at_k": 0.5, "stderr": 0.01, "n_problems": 16}))
    progress.update()
    assert [line.split(" [")[0].split(":")[0] for line in shown(capsys)] == ["step 8/10", "eval after 8 steps"]

    _keep_lines(paths.metrics, lambda r: r["step"] < 5)  # restarted again mid-run (a requeue under --wait)
    with open(paths.metrics, "a") as f:
        f.write(record(5, 300.0))
    progress.update()
    lines = shown(capsys)
    assert lines[0] == "(the job restarted from its checkpoint after 0 steps)" and lines[1].startswith("step 6/10")


def test_step_lines_carry_the_time_left_at_the_recent_pace(repo, tmp_path, capsys):
    config = load_config(repo / "configs" / "demo.yaml", [f"run.dir={tmp_path}", "schedule.steps=10"])
    paths = RunPaths(tmp_path)
    progress = Progress(config, paths)
    paths.metrics.write_text(record(0, 100.0))
    progress.update()
    assert "eta" not in shown(capsys)[0], "one step gives no pace"
    with open(paths.metrics, "a") as f:
        f.write(record(1, 102.0) + record(2, 104.0))  # 2 s a step, 7 steps left
    progress.update()
    assert [line.split(" | ")[-1] for line in shown(capsys)] == ["eta 0:00:16", "eta 0:00:14"]
    with open(paths.metrics, "a") as f:
        f.write(json.dumps({**json.loads(record(9, 118.0)), "sync_wait_s": 2.5}) + "\n")
    progress.update()
    last = shown(capsys)[-1]
    assert "eta" not in last and "(+2.5s generators busy)" in last, last


def test_eval_lines_show_each_set_and_a_cut_set_s_size():
    from rltools.monitor.progress import eval_line

    summary = {"k": 8, "avg_at_k": 0.25, "stderr": 0.01, "n_problems": 30, "problems_available": 30, "maj_at_k": 0.3}
    greedy = {"k": 1, "avg_at_k": 0.5, "stderr": 0.02, "n_problems": 256, "problems_available": 1319}
    assert eval_line(4, {"step": 4, "sets": {"aime": summary, "gsm8k": greedy}}) == (
        "eval after 4 steps, aime: avg@8 0.250 (+- 0.010, 30 problems, maj@8 0.300)\n"
        "eval after 4 steps, gsm8k: avg@1 0.500 (+- 0.020, 256 of 1319 problems)")
    assert eval_line(0, {"step": 0, "sets": {"held_out": summary}}).startswith("eval after 0 steps: avg@8 0.250")
