"""reward.functions: several reward functions with the row, named scores, weights, batched and async
calls; the code verifier's unit tests in the sandbox; named scores from the generator to metrics."""

import json
import math

import numpy as np
import pytest
from pydantic import ValidationError

from rltools.config.schema import RewardConfig
from rltools.data.arithmetic import Problem
from rltools.errors import UserError
from rltools.reward import make_reward
from rltools.reward.code import passed, program_of, read_tests
from rltools.rollout import RolloutBatch, Sample
from rltools.rollout.batch import FinishReason
from rltools.rollout.shard import read_shard, write_shard

pytestmark = pytest.mark.unit

FNS = "tests.unit.reward_fns"


def rows(*columns, prompt="What is 1+2?"):
    return [Problem(prompt, 3, columns=c, source_prompt=prompt) for c in columns]


def reward(**keys):
    return make_reward(RewardConfig(workers=1, **keys))


def test_one_function_gets_the_row_and_gives_two_named_scores_weighted():
    r = reward(functions=[{"function": f"{FNS}:format_and_correct", "weight": {"correct": 1.0, "format": 0.5}},
                          {"type": "exact_integer", "weight": 0.25}])
    try:
        scores = r.score(["3", "3", "4"], [3, 3, 3],
                         rows({"data_source": "arith"}, {"data_source": "other"}, {"data_source": "arith"}))
    finally:
        r.close()
    assert list(scores) == [1.75, 1.25, 0.5]  # correct + 0.5 format + 0.25 exact_integer
    assert scores.named == {"correct": [1.0, 1.0, 0.0], "format": [1.0, 0.0, 1.0], "exact_integer": [1.0, 1.0, 0.0]}
    assert scores.outcome(2) == {"reward_failed": False, "scores": {"correct": 0.0, "format": 1.0, "exact_integer": 0.0},
                                 "failed_functions": ()}


def test_keywords_reach_a_function_that_takes_any_and_only_declared_ones_reach_others():
    r = reward(functions=[{"function": f"{FNS}:sees_the_row"}, {"function": f"{FNS}:length_is_answer"}])
    try:
        scores = r.score(["abc", "abc"], [3, 3], rows({"level": 3}, {"level": 2}))
    finally:
        r.close()
    assert scores.named == {"sees_the_row": [1.0, 0.0], "length_is_answer": [1.0, 1.0]}  # no TypeError: no keywords


@pytest.mark.parametrize("function", ["batched_exact", "async_exact"])
def test_batched_and_async_functions(function):
    r = reward(type="custom", function=f"{FNS}:{function}")
    r2 = reward(functions=[{"function": f"{FNS}:{function}", "batched": function.startswith("batched")}])
    try:
        for each in (r2,) if function.startswith("batched") else (r, r2):
            scores = each.score(["3", "4", "3"], [3, 3, 3], rows({"level": 1}, {}, {"level": 2}))
            assert list(scores) == [1.0, 0.0, 1.0] and not scores.failures.count
    finally:
        r.close()
        r2.close()


def test_a_batched_function_that_returns_too_few_fails_every_call_of_its_batch():
    r = reward(functions=[{"function": f"{FNS}:batched_too_few", "batched": True}, {"type": "exact_integer"}],
               max_failure_fraction=1.0)
    try:
        scores = r.score(["3", "4"], [3, 3], rows({}, {}))
    finally:
        r.close()
    assert list(scores) == [1.0, 0.0] and scores.failures.count == 2
    assert "returned 1 values for 2 completions" in scores.failures.first
    assert scores.outcome(0)["failed_functions"] == ("batched_too_few",)


def test_a_weight_naming_a_score_the_function_does_not_return_fails_its_calls_naming_it():
    r = reward(functions=[{"function": f"{FNS}:format_and_correct", "weight": {"style": 1.0}}],
               max_failure_fraction=1.0)
    try:
        scores = r.score(["3"], [3], rows({}))
    finally:
        r.close()
    assert scores.failures.count == 1 and "without 'style'" in scores.failures.first


def test_two_functions_giving_one_name_are_refused():
    r = reward(functions=[{"function": f"{FNS}:format_and_correct"}, {"type": "exact_integer", "name": "correct"}])
    try:
        with pytest.raises(UserError, match="both return a score named 'correct'"):
            r.score(["3"], [3], rows({}))
    finally:
        r.close()


@pytest.mark.parametrize("keys, message", [
    ({"type": "boxed_integer", "functions": [{"type": "exact_integer"}]}, "reward.functions replaces reward.type and reward.function: list that verifier among reward.functions \\(- type: boxed_integer\\)"),
    ({"functions": [{"type": "exact_integer"}, {"type": "exact_integer"}]}, "two functions are named exact_integer"),
    ({"functions": [{"type": "custom"}]}, "needs function"),
    ({"functions": [{"type": "math_verify", "batched": True}]}, "batched is for custom functions"),
])
def test_bad_function_lists_are_refused_naming_the_key(keys, message):
    with pytest.raises(ValidationError, match=message):
        RewardConfig(**keys)


def test_answers_are_integers_when_an_integer_verifier_is_among_the_functions():
    assert RewardConfig(functions=[{"function": "m:f"}, {"type": "boxed_integer"}]).integer_answers
    assert not RewardConfig(functions=[{"function": "m:f"}]).integer_answers


def test_named_scores_and_failures_travel_from_samples_through_a_shard_to_the_step_metrics(tmp_path):
    def sample(reward, scores, failed=()):
        return Sample([1], [2, 3], [-0.1, -0.2], reward, 0, 0, FinishReason.STOP, text="x", scores=scores,
                      failed_functions=failed, reward_failed=bool(failed))

    batch = RolloutBatch.from_samples([sample(1.5, {"correct": 1.0, "format": 1.0}),
                                       sample(0.0, {"correct": 0.0}, failed=("format",))], policy_version=0)
    write_shard(tmp_path / "s.h5", batch, run_id="r", step=0, rank=0)
    other = RolloutBatch.from_samples([sample(1.0, {"correct": 1.0, "length": 0.5})], policy_version=0)
    joined = RolloutBatch.concat([read_shard(tmp_path / "s.h5", run_id="r", step=0, rank=0), other])
    assert joined.score_names == ("correct", "format", "length")
    metrics = joined.score_metrics()
    assert metrics == {"reward/correct": pytest.approx(2 / 3), "reward/format": 1.0, "reward/length": 0.5,
                       "reward_failures/format": 1}
    json.dumps(metrics)
    assert math.isnan(joined.scores[2, 1]) and joined.reward_failures == 1
    plain = RolloutBatch.from_samples([sample(1.0, None)], policy_version=0)
    assert plain.scores is None and plain.score_metrics() == {}


def test_the_code_verifier_reads_fences_tests_and_only_its_own_report_lines():
    assert program_of("so:\n```python\nx = 1\n```\nthen\n```py\nx = 2\n```") == "x = 2\n"
    assert program_of("x = 3") == "x = 3"
    assert read_tests('{"inputs": ["1"], "outputs": ["2"]}', "tests") == (None, [("1", "2")])
    assert read_tests("assert f() == 1", "tests") == (["assert f() == 1"], None)
    with pytest.raises(ValueError, match="reward.code.tests_key"):
        read_tests(7, "tests")
    assert passed("t 0 1\nt 1 1\nfake 2 1\nt 0 0\nt 9 1\n", "t", 3) == 2  # each test once, its token only


@pytest.mark.parametrize("score, expected", [("fraction", [1.0, 0.5, 0.0, 0.0, 0.0, 1.0]),
                                             ("all", [1.0, 0.0, 0.0, 0.0, 0.0, 1.0])])
def test_the_code_verifier_runs_row_tests_in_the_sandbox_and_hostile_programs_pass_nothing(score, expected):
    good = "```python\ndef add(a, b):\n    return a + b\n```"
    half = "```python\ndef add(a, b):\n    return 3\n```"
    exits = "```python\nimport os\nos._exit(0)\n```"  # ends before the tests
    liar = "```python\nfor i in range(2): print(f'ok {i} 1')\ndef add(a, b): return 0\n```"  # fakes report lines
    fork_bomb = "```python\nimport os\nwhile True: os.fork()\n```"
    stdio = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    asserts = {"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}
    r = reward(type="code", timeout_s=5, code={"score": score, "sandboxes": 2})
    try:
        scores = r.score([good, half, exits, liar, fork_bomb, stdio], [""] * 6,
                         rows(*[asserts] * 5, {"tests": json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3", "7"]})}))
        assert list(scores) == expected and not scores.failures.count
        missing = r.score([good], [""], rows({"other": 1}))
        assert missing.failures.count == 1 and "has no column 'tests'" in missing.failures.first
    finally:
        r.close()
