"""eval.sets: each set's problems, keys, verifier, k and sampling, resolved as the generator evaluates them."""

import json
import logging

import pytest

from rltools.config.schema import RLConfig
from rltools.data.eval_sets import eval_sets
from rltools.data.tasks import make_task
from tests.unit.test_prompts import TINY


def config(tmp_path, **eval_keys) -> RLConfig:
    (tmp_path / "held.jsonl").write_text("".join(json.dumps({"problem": f"What is {i}+1?", "answer": i + 1}) + "\n"
                                                 for i in range(10)))
    (tmp_path / "other.jsonl").write_text("".join(json.dumps({"q": f"What is {i}*2?", "meta": {"a": 2 * i}}) + "\n"
                                                  for i in range(6)))
    held = str(tmp_path / "held.jsonl")
    return RLConfig.model_validate({
        "run": {"name": "t"}, "model": {"path": str(TINY)}, "data": {"train_path": held, "eval_path": held},
        "generator": {"temperature": 0.9, "top_p": 0.8, "max_new_tokens": 6}, "eval": {"k": 4, **eval_keys}})


def resolve(c: RLConfig, **overrides):
    task = make_task(c.data, c.reward, 0, TINY)
    return eval_sets(c.eval, c.data, c.reward, c.generator, task, **overrides)


def test_without_sets_the_held_out_problems_at_the_generator_s_sampling(tmp_path):
    [s] = resolve(config(tmp_path))
    assert (s.name, len(s.problems), s.available, s.k, s.temperature, s.top_p, s.max_tokens) == \
        ("held_out", 10, 10, 4, 0.9, 0.8, 6)
    assert s.problems[0].prompt == "<s>What is 0+1?="  # rendered as the training problems are


def test_sets_keep_their_own_file_keys_verifier_k_and_sampling(tmp_path, caplog):
    c = config(tmp_path, problems=8, sets={
        "held": {"k": 2, "temperature": 0.6, "top_p": 0.95, "max_new_tokens": 32},
        "other": {"path": str(tmp_path / "other.jsonl"), "prompt_key": "q", "answer_key": "meta.a",
                  "reward": "boxed_integer", "greedy": True, "problems": 3}})
    with caplog.at_level(logging.WARNING, "rltools.data"):
        sets = resolve(c)
    held, other = sets
    assert [s.name for s in sets] == ["held", "other"]
    assert (held.k, held.temperature, held.top_p, held.max_tokens, len(held.problems), held.available) == \
        (2, 0.6, 0.95, 32, 8, 10)
    assert (other.k, other.temperature, other.top_p, len(other.problems), other.available) == (1, 0.0, 1.0, 3, 6)
    assert [p.answer for p in other.problems] == [0, 2, 4] and other.reward_type == "boxed_integer"
    assert other.reward.score(["\\boxed{2}"], [2]) == [1.0] and held.reward.score(["2"], [2]) == [1.0]
    assert "eval set held: evaluating the first 8 of its 10 problems" in caplog.text
    assert "eval set other: evaluating the first 3 of its 6 problems" in caplog.text
    sets.close()
    fewer = resolve(c, k=1, count=2)  # rltools eval --k 1 --problems 2
    assert [(s.k, len(s.problems)) for s in fewer] == [(1, 2), (1, 2)]


@pytest.mark.parametrize("keys, message", [
    ({"sets": {"g": {"greedy": True, "k": 4}}}, "a greedy eval set samples once"),
    ({"sets": {"a b": {}}}, "String should match pattern"),
    ({"sets": {"x": {"path": "x.txt"}}}, "eval.sets.x.path x.txt: cannot tell its format"),
    ({"sets": {"x": {"reward": "custom", "path": "x.jsonl"}}}, "eval.sets.x.reward custom calls reward.function"),
])
def test_bad_sets_are_refused_naming_the_key(tmp_path, keys, message):
    with pytest.raises(ValueError, match=message):
        config(tmp_path, **keys)
