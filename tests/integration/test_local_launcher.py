"""The local launcher end to end: the demo learns, reproducibly; a failing child stops the run with its
error; LoRA weight sync serves the trainer's exact policy. (Signals, kills and resumes: tests/faults/.)"""

import datetime
import json
import subprocess
import sys

import pytest

from rltools.paths import RunPaths


def submit(repo, run_dir, *overrides, timeout=600):
    argv = [sys.executable, "-m", "rltools", "submit", str(repo / "configs" / "demo.yaml"), "--set", f"run.dir={run_dir}"]
    for override in overrides:
        argv += ["--set", override]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=repo)


def test_a_failing_generator_stops_the_run_and_shows_its_error(repo, tmp_path, one_process_vllm):
    # 1 KiB of KV cache cannot hold one sequence: the vLLM engine refuses to start.
    result = submit(repo, tmp_path / "run", "generator.kv_cache_memory_bytes=1024", "schedule.steps=2")
    assert result.returncode == 1, result.stderr[-2000:]
    assert "generator 0 failed" in result.stderr
    assert "generator_0.log" in result.stderr
    alive = subprocess.run(["pgrep", "-f", str(tmp_path / "run")], capture_output=True, text=True)
    assert alive.stdout.strip() == "", "children outlived the launcher"


@pytest.fixture(scope="module")
def learned(repo, tmp_path_factory):
    """A shortened default demo: 150 steps, evaluated before and after."""
    run_dir = tmp_path_factory.mktemp("learned") / "run"
    result = submit(repo, run_dir, "schedule.steps=150", "schedule.eval_every=150")
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def rewards(run_dir) -> list[float]:
    return [json.loads(line)["reward_mean"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_demo_learns(learned):
    """The held-out avg@8 and the training reward both rise."""
    before = json.loads((learned / "eval" / "step_0.json").read_text())["sets"]["held_out"]["avg_at_k"]
    after = json.loads((learned / "eval" / "step_150.json").read_text())["sets"]["held_out"]["avg_at_k"]
    early, late = sum(rewards(learned)[:50]) / 50, sum(rewards(learned)[-50:]) / 50
    assert after > before + 0.015, f"held-out avg@8 {before:.3f} -> {after:.3f}"
    assert late > early, f"training reward {early:.3f} -> {late:.3f}"


def test_the_same_seed_gives_the_same_rewards_on_a_loaded_machine(repo, tmp_path, learned, one_process_vllm):
    """The run is deterministic: a generator running ahead (max_staleness 1) samples step k with
    exactly policy version k-1, however slow either role is, and every request's seed is fixed. So
    the README's figures are reproducible, and any change to them is a change of the code. This run
    has vLLM in one process, the learned one its engine-core process: they sample the same tokens."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]  # both cores busy
    try:
        result = submit(repo, tmp_path / "run", "schedule.steps=12", "schedule.eval_every=150")
    finally:
        for hog in hogs:
            hog.kill()
    assert result.returncode == 0, result.stderr[-3000:]
    assert rewards(tmp_path / "run") == rewards(learned)[:12]


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
    # After every sync the engine scored the probe sequence as the trainer did: the gap is the numerics'
    assert all(m["logprob_gap"] < 1e-4 for m in lines), [m["logprob_gap"] for m in lines]
    assert sorted(p.name for p in (run_dir / "probes").iterdir()) == ["probe_v3.json", "probe_v4.json"]


def test_a_generator_serving_another_policy_than_the_trainers_stops_the_run_naming_the_gap(repo, tmp_path, one_process_vllm):
    """The probe check, made to fire: with generator.max_logprob_gap below float32 noise, the first
    sync's gap (~1e-6) is "another policy". Trainer rank 0 stops the run, naming the engine and the
    gap; a real mismatch (an adapter vLLM does not apply) differs by far more than numerics."""
    result = submit(repo, tmp_path / "run", "generator.max_logprob_gap=1e-9", "schedule.steps=3",
                    "schedule.eval_every=0", "eval.problems=16")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "trainer 0 failed" in result.stderr
    assert "policy version 1: the log-probabilities of the probe sequence" in result.stderr, result.stderr[-3000:]
    assert "sync rank 1 (generator 0)" in result.stderr and "above generator.max_logprob_gap 1e-09" in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()


def test_a_final_evaluation_that_outlasts_the_trainer_leaves_a_quiet_generator_log(repo, tmp_path, one_process_vllm,
                                                                                    monkeypatch):
    """The trainer finishes and closes its weight-sync store while the final evaluation still runs (a
    real model's takes minutes; here a fault makes it last 8 s): the generator has nothing more to say
    to the store, so its log gets no c10d TCPStore warnings (once one a second, each with a C++ stack
    trace: the heartbeat kept beating into the closed store)."""
    monkeypatch.setenv("RLTOOLS_FAULT", "generator.eval@2=sleep:8")
    run_dir = tmp_path / "run"
    result = submit(repo, run_dir, "schedule.steps=2", "schedule.eval_every=2", "eval.problems=16")
    assert result.returncode == 0, result.stderr[-3000:]
    paths = RunPaths(run_dir)
    generator, trainer = (paths.task_log(0, role, 0).read_text() for role in ("generator", "trainer"))
    evaluated = next(line for line in generator.splitlines() if "eval at policy version 2" in line)
    assert _log_time(evaluated) - _log_time(trainer.splitlines()[-1]) > 5, "the trainer did not end first"
    for noise in ("TCPStore", "[c10d]", "recvValue failed", "sendBytes failed", "Broken pipe"):
        assert noise not in generator, generator[-3000:]


def _log_time(line: str) -> float:
    """The time of a role's log line (`2026-12-05 00:10:17,123 generator ...`), in seconds."""
    return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_a_reward_that_fails_on_every_call_stops_the_run_naming_it(repo, tmp_path, one_process_vllm):
    """Issue 38: a custom reward raising on every call once scored 0 everywhere, trained on zero
    advantages and exited 0. Now the generator stops the run at the first batch it scores (the
    evaluation before step 1), naming the function and its error; nothing is trained."""
    run_dir = tmp_path / "run"
    result = submit(repo, run_dir, *custom_reward(tmp_path, "tests.unit.reward_fns:raise_error"), "schedule.steps=3",
                    "eval.problems=16")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "generator 0 failed (exit 2)" in result.stderr, result.stderr[-3000:]
    assert ("error: reward.function tests.unit.reward_fns:raise_error (reward.type custom) failed on 65 of 65 calls "
            "(of 128 to make): 65 raised or crashed; more than reward.max_failure_fraction 0.5 of them. The first "
            "failure: RuntimeError: boom.") in result.stderr, result.stderr[-3000:]
    paths = RunPaths(run_dir)
    assert not paths.metrics.exists() or not paths.metrics.read_text(), "a step was trained"
    assert paths.latest_checkpoint() == 0
    status = subprocess.run([sys.executable, "-m", "rltools", "status", str(run_dir)], capture_output=True, text=True,
                            timeout=120, cwd=repo)
    assert "FAILED" in status.stdout and "the generators component failed first" in status.stdout, status.stdout
    assert "RuntimeError: boom" in status.stdout


def test_reward_calls_that_fail_are_counted_per_step(repo, tmp_path, one_process_vllm):
    """A reward failing on some calls (every odd answer: whole groups), under reward.max_failure_fraction:
    the run goes on, and metrics.jsonl and `rltools status` count the samples that scored a failure's 0."""
    run_dir = tmp_path / "run"
    result = submit(repo, run_dir, *custom_reward(tmp_path, "tests.unit.reward_fns:fails_on_odd_answers"),
                    "reward.max_failure_fraction=0.9", "schedule.steps=2", "eval.problems=16")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < m["reward_failures"] < m["samples"] and m["reward_failures"] % 8 == 0 for m in lines), lines
    assert f"reward failures {lines[-1]['reward_failures']}/128" in result.stderr  # the live display's step line
    status = subprocess.run([sys.executable, "-m", "rltools", "status", str(run_dir)], capture_output=True, text=True,
                            timeout=120, cwd=repo)
    total = sum(m["reward_failures"] for m in lines)
    assert f"reward calls that failed and scored 0: {total} samples in 2 step(s)" in status.stdout, status.stdout


def custom_reward(tmp_path, function: str) -> list[str]:
    """Overrides for the demo with a custom reward (one worker: its calls come in a fixed order) and
    the demo's kind of problems from a file (generated arithmetic is scored by exact_integer only).
    The reward's module is found from the job's working directory, the repository (`submit`'s cwd)."""
    problems = tmp_path / "sums.jsonl"
    problems.write_text("".join(json.dumps({"problem": f"What is {a}+{b}?", "answer": a + b}) + "\n"
                                for a in range(10, 90, 5) for b in (3, 8, 14, 27)))
    return [f"data.train_path={problems}", f"data.eval_path={problems}", "reward.type=custom",
            f"reward.function={function}", "reward.workers=1"]
