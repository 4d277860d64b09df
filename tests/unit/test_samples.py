"""The completions a run keeps for people to read: which samples of a step are kept, their lines, the
evaluation's completions, what a resume drops, and `rltools samples` printing them."""

import json

import numpy as np
import pytest
import torch

from rltools.algorithms.advantages import group_advantages
from rltools.cli import main
from rltools.completions import drop_after, read_rows, write_eval_completions, write_step_samples
from rltools.generate.episodes import Episode
from rltools.generate.evaluation import problem_row
from rltools.paths import RunPaths
from rltools.rollout import FinishReason, RolloutBatch, Sample
from rltools.train.samples import StepSamples, choose_groups
from tests.unit.test_cli import run_light


class CharTokenizer:
    """decode: token t is the letter chr(97 + t % 26); special tokens (0) show as <s> unless skipped."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if t == 0 and skip_special_tokens else "<s>" if t == 0 else chr(97 + t % 26) for t in ids)


def batch_of(groups: int, size: int, version: int = 3, texts: bool = True, episodes: bool = False) -> RolloutBatch:
    samples = []
    for g in range(groups):
        for j in range(size):
            completion = [1 + j, 2 + g]
            samples.append(Sample(prompt_ids=[0, 7, 4 + g], completion_ids=completion, completion_logprobs=[-0.5] * 2,
                                  reward=float((g + j) % 3 == 0), group_id=100 + g, sample_index=j,
                                  finish_reason=FinishReason.LENGTH if j == 1 else FinishReason.STOP,
                                  text=f"answer {g}.{j}" if texts else None,
                                  **({"completion_mask": [1, 0], "turns": 2, "tool_calls": 1} if episodes else {})))
    return RolloutBatch.from_samples(samples, policy_version=version)


def advantages_of(batch):
    return group_advantages(torch.from_numpy(batch.rewards), torch.from_numpy(batch.group_ids))


@pytest.fixture
def paths(tmp_path):
    paths = RunPaths(tmp_path / "run")
    paths.create()
    paths.config.write_text("run: {name: x}\n")  # what `open_run` looks for
    return paths


def test_whole_groups_are_chosen_deterministically_by_step():
    groups = np.repeat(np.arange(10), 4)[np.random.default_rng(0).permutation(40)]  # groups need not be contiguous
    chosen = choose_groups(groups, 12, seed=1, step=5)
    kept = set(groups[chosen])
    assert len(kept) == 3 and len(chosen) == 12 and all(np.sum(groups[chosen] == g) == 4 for g in kept)
    assert list(chosen) == sorted(chosen)  # in batch order
    assert np.array_equal(chosen, choose_groups(groups, 12, seed=1, step=5))
    assert any(set(groups[choose_groups(groups, 12, seed=1, step=s)]) != kept for s in range(6, 10))
    assert len(choose_groups(groups, 2, seed=1, step=5)) == 4  # one whole group at least
    assert len(choose_groups(groups, 100, seed=-3, step=0)) == 40  # a negative run seed is a seed too


def test_a_step_keeps_its_groups_with_the_advantages_it_trained_on(paths):
    shards = [batch_of(2, 4, version=3), batch_of(2, 4, version=2)]
    shards[1] = RolloutBatch(**{**shards[1].arrays, "group_ids": shards[1].group_ids + 10}, policy_version=2,
                             texts=shards[1].texts)
    batch = RolloutBatch.concat(shards)
    StepSamples(paths, 8, seed=0, model_path="unused", tokenizer=CharTokenizer()).write(4, batch, advantages_of,
                                                                                         engines=[1, 0])
    rows = read_rows(paths.step_samples(4))
    assert len(rows) == 8 and len({r["group"] for r in rows}) == 2
    expected = advantages_of(batch)[0].numpy()
    for row in rows:
        i = int(np.flatnonzero((batch.group_ids == row["group"]) & (batch.sample_indices == row["index"]))[0])
        slot = i // 8
        assert row["advantage"] == pytest.approx(float(expected[i]), abs=1e-6)
        assert row["reward"] == float(batch.rewards[i]) and row["completion"] == batch.texts[i]
        assert (row["slot"], row["engine"], row["policy_version"]) == (slot, [1, 0][slot], [3, 2][slot])
        assert row["prompt"] == "<s>h" + chr(97 + (4 + (row["group"] % 10)) % 26)
        assert row["finish_reason"] == ("length" if row["index"] == 1 else "stop") and row["completion_tokens"] == 2
    assert "episode" not in rows[0] and "scores" not in rows[0]


def test_without_texts_the_completion_is_decoded_and_an_episode_shown_whole(paths):
    batch = batch_of(1, 2, texts=False, episodes=True)
    StepSamples(paths, 16, seed=0, model_path="unused", tokenizer=CharTokenizer()).write(0, batch, advantages_of, [0])
    first = read_rows(paths.step_samples(0))[0]
    assert first["completion"] == "bc" and first["episode"] == "bc"
    assert (first["turns"], first["tool_calls"], first["tool_errors"]) == (2, 1, 0)
    assert (first["engine"], first["slot"], first["policy_version"]) == (0, 0, 3)  # a batch not joined from shards


def test_samples_per_step_0_writes_nothing_and_loads_no_tokenizer(paths):
    StepSamples(paths, 0, seed=0, model_path="/nonexistent").write(0, batch_of(1, 2), advantages_of, [0])
    assert not paths.samples_dir.exists()


def test_a_problem_row_keeps_each_completion_with_its_score_and_extracted_answer(tmp_path):
    episodes = [Episode("p", 0, None, token_ids=[5, 6], last_turn="81", finish_reason=FinishReason.STOP),
                Episode("p", 1, None, token_ids=[5, 6, 7], last_turn="8", finish_reason=FinishReason.LENGTH)]
    problem = type("Problem", (), {"prompt": "What is 23+58?=", "answer": np.int64(81)})()  # a parquet column's
    row = problem_row(problem, episodes, [1.0, 0.0], np.array([81, 8], dtype=object))
    assert row["accuracy"] == 0.5 and row["prompt"] == "What is 23+58?="
    assert row["completions"][1] == {"completion": "8", "score": 0.0, "correct": False, "finish_reason": "length",
                                     "tokens": 3, "extracted": 8}
    whole = problem_row(problem, episodes, [1.0, 0.0], None, decode=lambda ids: f"{len(ids)} tokens")
    assert "extracted" not in whole["completions"][0] and whole["completions"][0]["episode"] == "2 tokens"
    write_eval_completions(tmp_path / "step_0", {"s": [row]})
    assert read_rows(tmp_path / "step_0" / "s.jsonl")[0]["answer"] == 81


def test_an_evaluation_directory_appears_whole_and_replaces_the_last(paths):
    directory = paths.eval_samples_dir(2, adhoc=True)
    write_eval_completions(directory, {"a": [{"x": 1}], "b": [{"x": 2}]})
    write_eval_completions(directory, {"c": [{"x": 3}]})
    assert sorted(p.name for p in directory.iterdir()) == ["c.jsonl"]
    assert sorted(p.name for p in directory.parent.iterdir()) == ["step_2"]  # no temporary left
    assert paths.eval_sample_steps(adhoc=True) == {2: directory} and paths.eval_sample_steps() == {}


def test_a_resume_drops_what_the_steps_it_trains_again_kept(paths):
    for step in range(6):
        write_step_samples(paths, step, [{"group": step}])
    for step in (0, 2, 4, 6):
        write_eval_completions(paths.eval_samples_dir(step), {"s": []})
    write_eval_completions(paths.eval_samples_dir(6, adhoc=True), {"s": []})
    write_eval_completions(paths.eval_samples_dir(4, adhoc=True), {"s": []})
    (paths.samples_dir / ".step_7.jsonl.123.tmp").write_text("{half")
    (paths.eval_samples_root() / ".step_8.tmp").mkdir()
    drop_after(paths, 4)  # the checkpoint after 4 steps: steps 4 and 5 train again, policies 5+ are new
    assert sorted(paths.sample_steps()) == [0, 1, 2, 3]
    assert sorted(paths.eval_sample_steps()) == [0, 2, 4] and sorted(paths.eval_sample_steps(adhoc=True)) == [4]
    assert sorted(p.name for p in paths.samples_dir.iterdir()) == [f"step_{s}.jsonl" for s in range(4)]
    assert sorted(p.name for p in paths.eval_samples_root().iterdir()) == ["step_0", "step_2", "step_4"]


# -- `rltools samples` -----------------------------------------------------------------------------
def kept_row(group, index, reward, completion, **extra):
    return {"group": group, "index": index, "reward": reward, "advantage": reward - 0.5, "finish_reason": "stop",
            "completion_tokens": 2, "policy_version": 2, "engine": 0, "slot": 0, "prompt": f"What is {group}?",
            "completion": completion, **extra}


def eval_completion(text, score, finish_reason="stop", **extra):
    return {"completion": text, "score": score, "correct": score > 0.5, "finish_reason": finish_reason,
            "tokens": len(text), **extra}


@pytest.fixture
def run(paths):
    write_step_samples(paths, 1, [kept_row(7, 0, 0.0, "zero")])
    write_step_samples(paths, 3, [kept_row(5, 0, 1.0, "right 14"), kept_row(5, 1, 0.0, "wrong 41"),
                                  kept_row(9, 0, 0.5, "half 9", scores={"format": 1.0})])
    problems = [{"prompt": "What is 1+1?=", "answer": 2, "accuracy": 0.5,
                 "completions": [eval_completion("2", 1.0, extracted=2), eval_completion("3", 0.0, extracted=3)]},
                {"prompt": "What is 2+2?=", "answer": 4, "accuracy": 0.0,
                 "completions": [eval_completion("5" * 30, 0.0, "length")]}]
    write_eval_completions(paths.eval_samples_dir(4), {"held_out": problems, "greedy": problems[:1]})
    paths.eval_dir.joinpath("step_4.json").write_text(json.dumps({"step": 4, "sets": {"held_out": {}, "greedy": {}}}))
    return paths


def samples(capsys, paths, *argv):
    capsys.readouterr()
    code = main(["samples", str(paths.root), *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_samples_prints_the_latest_step_and_sorts_by_reward(run, capsys):
    code, out, _ = samples(capsys, run, "--worst")
    assert code == 0 and out.startswith("step 3 (samples/step_3.jsonl): 3 samples of 2 groups kept; showing 3, worst")
    assert out.index("wrong 41") < out.index("half 9") < out.index("right 14")
    assert "reward 0.500 format 1.000 | advantage +0.000 | stop, 2 tokens | engine 0, policy version 2" in out
    assert out.count("What is 5?") == 2  # a prompt is shown again when another group's samples came between
    code, out, _ = samples(capsys, run, "--best", "-n", "1")
    assert "right 14" in out and "wrong 41" not in out and "(1 of 3 samples shown: -n 3 shows all)" in out
    code, out, _ = samples(capsys, run, "--grep", r"\d{2}$", "--json")
    assert [json.loads(line)["completion"] for line in out.splitlines()] == ["right 14", "wrong 41"]
    assert json.loads(out.splitlines()[0])["step"] == 3
    code, out, _ = samples(capsys, run)
    assert out.count("What is 5?") == 1 and out.index("right 14") < out.index("wrong 41")  # in group order
    code, out, _ = samples(capsys, run, "--step", "1")
    assert "zero" in out and "What is 7?" in out


def test_samples_of_an_evaluation_worst_problems_first(run, capsys):
    code, out, _ = samples(capsys, run, "--eval", "held_out", "--worst", "--chars", "20")
    assert code == 0 and out.startswith("eval after 4 steps, held_out (eval/samples/step_4/held_out.jsonl): 2 problems")
    assert out.index("What is 2+2?") < out.index("What is 1+1?")  # the lower accuracy first
    assert "accuracy 0.000 (0 of 1 correct) | answer 4" in out and "characters cut" in out
    assert out.index("sample 1: score 0.000 | extracted 3") < out.index("sample 0: score 1.000 | extracted 2")
    code, out, _ = samples(capsys, run, "--eval")
    assert out.index("held_out (") < out.index("greedy (")  # every set, in the result's (config) order, not by name
    code, out, _ = samples(capsys, run, "--eval", "held_out", "--grep", "^3$", "--json")
    (line,) = out.splitlines()
    assert json.loads(line)["set"] == "held_out" and [c["completion"] for c in json.loads(line)["completions"]] == ["3"]


def test_samples_errors_say_what_exists(run, capsys, tmp_path):
    code, _, err = samples(capsys, run, "--step", "2")
    assert code == 2 and "no samples of step 2" in err and "steps that have some: 1, 3" in err
    code, _, err = samples(capsys, run, "--eval", "aime")
    assert code == 2 and "no eval set 'aime'" in err and "its sets: held_out, greedy" in err
    code, _, err = samples(capsys, run, "--eval", "--adhoc")
    assert code == 2 and "rltools eval RUN" in err
    code, _, err = samples(capsys, run, "--grep", "(")
    assert code == 2 and "not a regular expression" in err
    empty = RunPaths(tmp_path / "empty")
    empty.create()
    empty.config.write_text("run: {name: x}\n")
    code, _, err = samples(capsys, empty, "--worst")
    assert code == 2 and "keeps no step samples" in err and "run.samples_per_step is 0" in err


def test_samples_is_login_node_light(run, repo):
    result = run_light("samples", str(run.root), "--worst", cwd=repo)  # this tree's rltools
    assert result.returncode == 0, result.stderr
    result = run_light("samples", str(run.root), "--eval", "held_out", cwd=repo)
    assert result.returncode == 0 and "What is 1+1?" in result.stdout, result.stderr
