"""The local launcher end to end: a short demo runs, and a failing child stops the run with its error."""

import json
import signal
import subprocess
import sys
import time


def submit(repo, run_dir, *overrides, timeout=600):
    argv = [sys.executable, "-m", "rltools", "submit", str(repo / "configs" / "demo.yaml"), "--set", f"run.dir={run_dir}"]
    for override in overrides:
        argv += ["--set", override]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=repo)


def test_a_failing_generator_stops_the_run_and_shows_its_error(repo, tmp_path):
    # 1 KiB of KV cache cannot hold one sequence: the vLLM engine refuses to start.
    result = submit(repo, tmp_path / "run", "generator.kv_cache_memory_bytes=1024", "schedule.steps=2")
    assert result.returncode == 1, result.stderr[-2000:]
    assert "generator 0 failed" in result.stderr
    assert "generator_0.log" in result.stderr
    alive = subprocess.run(["pgrep", "-f", str(tmp_path / "run")], capture_output=True, text=True)
    assert alive.stdout.strip() == "", "children outlived the launcher"


def test_ctrl_c_stops_every_child_at_a_checkpoint_and_resume_finishes(repo, tmp_path):
    run_dir, steps = tmp_path / "run", 60
    argv = [sys.executable, "-m", "rltools", "submit", str(repo / "configs" / "demo.yaml"), "--set", f"run.dir={run_dir}",
            "--set", f"schedule.steps={steps}", "--set", "eval.problems=16"]
    launcher = subprocess.Popen(argv, cwd=repo, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    metrics = run_dir / "metrics.jsonl"
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 15:  # mid-run
        assert time.monotonic() < deadline and launcher.poll() is None, "the demo never got to step 15"
        time.sleep(0.2)
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(timeout=30) == 130
    stderr = launcher.stderr.read()
    assert "interrupted" in stderr and f"continue with: rltools resume {run_dir}" in stderr, stderr[-2000:]
    alive = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True)
    assert alive.stdout.strip() == "", "children outlived the launcher"

    # the trainer checkpointed on its way out (SIGTERM from the launcher): resume runs the rest
    resumed = subprocess.run([sys.executable, "-m", "rltools", "resume", str(run_dir)], capture_output=True,
                             text=True, timeout=300, cwd=repo)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stderr and f"of {steps} steps" in resumed.stderr
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(range(steps))


def test_short_demo_runs_end_to_end(repo, tmp_path):
    run_dir = tmp_path / "run"
    result = submit(repo, run_dir, "schedule.steps=4", "eval.problems=16", "schedule.eval_every=2")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3]
    for key in ("reward_mean", "accuracy", "kl", "entropy", "clip_frac", "gen_tokens_per_s", "generation_s",
                "training_s", "sync_s", "staleness"):
        assert key in lines[0]
    assert all(0 <= m["staleness"] <= 1 for m in lines)
    assert sorted(p.name for p in (run_dir / "eval").iterdir()) == ["step_0.json", "step_2.json", "step_4.json"]
    assert "held-out avg@8:" in result.stderr and "before ->" in result.stderr


def test_demo_learns(repo, tmp_path):
    """A shortened default demo: the held-out avg@8 and the training reward both rise."""
    run_dir = tmp_path / "run"
    result = submit(repo, run_dir, "schedule.steps=150", "schedule.eval_every=150")
    assert result.returncode == 0, result.stderr[-3000:]
    before = json.loads((run_dir / "eval" / "step_0.json").read_text())["avg_at_k"]
    after = json.loads((run_dir / "eval" / "step_150.json").read_text())["avg_at_k"]
    rewards = [json.loads(line)["reward_mean"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    early, late = sum(rewards[:50]) / 50, sum(rewards[-50:]) / 50
    assert after > before + 0.015, f"held-out avg@8 {before:.3f} -> {after:.3f}"
    assert late > early, f"training reward {early:.3f} -> {late:.3f}"


def test_lora_weight_sync_serves_exactly_the_trainers_adapter(repo, tmp_path):
    """weight_sync: lora sends adapter tensors only; vLLM then samples from the very policy the trainer
    holds, so on-policy (staleness 0) the trainer's recomputed logprobs equal vLLM's."""
    run_dir = tmp_path / "run"
    result = submit(
        repo, run_dir, "generator.weight_sync=lora", "schedule.max_staleness=0", "schedule.steps=4",
        "eval.problems=16", "lora.target_modules=[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["staleness"] for m in lines] == [0, 0, 0, 0]
    assert all(m["logprob_diff"] < 1e-3 for m in lines[1:]), [m["logprob_diff"] for m in lines]
    assert any(m["grad_norm"] > 0 for m in lines)  # the adapters did change between versions
    served = [p.name for p in (run_dir / "weights").iterdir() if p.name.startswith("adapter_")]
    assert served == ["adapter_v4"]  # older versions cleaned up (weights/step_<k> are the evaluated exports)
