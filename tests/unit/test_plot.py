"""`rltools plot` draws only panels with something in them, and writes the format its suffix names."""

import json

import pytest

from rltools.errors import UserError
from rltools.paths import RunPaths
from rltools.plot import _fleet, _held_out, _policy, plot_run, smooth


def write_run(root, steps: int, kl: float = 0.0, evals=(0,)):
    paths = RunPaths(root)
    root.mkdir(exist_ok=True)
    with open(paths.metrics, "w") as f:
        for s in range(steps):
            f.write(json.dumps({"step": s, "reward_mean": 0.1 * (s % 3), "accuracy": 0.1 * (s % 3), "kl": kl,
                                "entropy": 1.0, "clip_frac": 0.0, "generation_s": 0.1, "training_s": 0.2,
                                "sync_s": 0.01, "sync_wait_s": 0.0, "wait_s": 0.05, "time": 100.0 + s}) + "\n")
    paths.eval_dir.mkdir(exist_ok=True)
    for step in evals:
        paths.eval_result(step).write_text(json.dumps({"k": 8, "avg_at_k": 0.3, "stderr": 0.01, "pass_at_k": 0.7,
                                                       "n_problems": 16}))
    return paths


def test_smoothing_is_a_trailing_mean():
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert smooth([1.0, 2.0], 1) == [1.0, 2.0]


def test_panels_with_nothing_to_show_are_left_out(tmp_path):
    paths = write_run(tmp_path / "run", 10, evals=())
    metrics = [json.loads(line) for line in paths.metrics.read_text().splitlines()]
    assert not _held_out.wanted(metrics, {}), "no evaluation yet: no held-out panel"
    assert _policy.wanted(metrics, {})


@pytest.mark.parametrize("suffix", ["png", "svg"])
def test_a_run_is_drawn_in_the_format_its_suffix_names(tmp_path, suffix):
    paths = write_run(tmp_path / "run", 40, kl=0.01, evals=(0, 20, 40))
    out = tmp_path / f"run.{suffix}"
    plot_run(paths, out)
    head = out.read_bytes()[:200]
    assert head.startswith(b"\x89PNG") if suffix == "png" else b"<svg" in out.read_bytes()[:2000]
    if suffix == "svg":
        text = out.read_text()
        assert "held-out problems (16)" in text and "KL to the reference" in text and "+0.0 points" in text


def test_a_run_whose_engines_changed_gets_a_fleet_panel_and_step_lines_that_count_them(tmp_path):
    from rltools.monitor.progress import step_line

    paths = write_run(tmp_path / "run", 12)
    metrics = [json.loads(line) for line in paths.metrics.read_text().splitlines()]
    assert not _fleet.wanted(metrics, {}), "one engine throughout: no fleet panel"
    for m in metrics:  # 2 engines, one lost at step 5 (its slot covered), replaced at step 9
        m.update(engines=1 if 5 <= m["step"] < 9 else 2, reassigned_samples=64 if 5 <= m["step"] < 9 else 0,
                 gen_tokens_per_s=1.0)
    paths.metrics.write_text("".join(json.dumps(m) + "\n" for m in metrics))
    assert _fleet.wanted(metrics, {})
    plot_run(paths, tmp_path / "run.svg")
    text = (tmp_path / "run.svg").read_text()
    assert "generator fleet" in text and "samples generated for a lost engine" in text
    assert step_line(6, 12, metrics[5]).endswith("| engines 1 (64 samples for a lost one)")
    assert step_line(1, 12, metrics[0]).endswith("| engines 2")


def test_an_unknown_format_is_a_user_error(tmp_path):
    paths = write_run(tmp_path / "run", 3)
    with pytest.raises(UserError, match=r"\.png, \.svg or \.pdf"):
        plot_run(paths, tmp_path / "run.xyz")
