"""Reward calls that fail are counted (by kind, per step), and too many of them stop the run with an
error naming the reward, instead of training on their zeros (rltools/reward/failures.py)."""

import json
import math

import numpy as np
import pytest

from rltools.config import load_config
from rltools.config.schema import RewardConfig
from rltools.launch.run_dir import prepare_run_dir
from rltools.launch.sbatch import render_sbatch
from rltools.monitor.progress import step_line
from rltools.monitor.status import format_status, run_status
from rltools.reward import make_reward
from rltools.reward.failures import (ERROR, MIN_WINDOW_CALLS, NOT_A_NUMBER, TIMEOUT, FailureLimit, RewardFailing,
                                     RewardFailures)
from rltools.reward.worker import as_reward
from rltools.rollout import FinishReason, RolloutBatch, Sample
from rltools.rollout.shard import read_shard, write_shard


def failures(calls: int, failed: int, kind: str = ERROR) -> RewardFailures:
    batch = RewardFailures(calls=calls)
    for index in range(failed):
        batch.add(index, kind, f"KeyError: 'data_source' (call {index})")
    return batch


def test_a_window_above_the_fraction_stops_naming_the_reward_how_it_failed_and_the_first_failure():
    limit = FailureLimit(0.5, "reward.function my.rewards:score (reward.type custom)")
    limit.judge(failures(64, 32), 64)  # half: not more than half
    with pytest.raises(RewardFailing) as stop:
        limit.judge(failures(64, 33), 64)
    message = str(stop.value)
    assert message.startswith("reward.function my.rewards:score (reward.type custom) failed on 33 of 64 calls: "
                              "33 raised or crashed; more than reward.max_failure_fraction 0.5 of them.")
    assert "The first failure: KeyError: 'data_source' (call 0)." in message and "rltools resume" in message


def test_batches_smaller_than_the_window_add_up_so_one_flaky_call_never_stops_a_run():
    limit = FailureLimit(0.0, "reward.type math_verify")  # even 0: no failure at all is tolerated
    limit.judge(failures(1, 1, TIMEOUT), 1)  # one call, failed: too few to judge
    assert limit.allowed(8) is None
    limit.judge(failures(8, 0), 8)
    assert limit.allowed(MIN_WINDOW_CALLS - 9) == -1  # the window is full with it; one failure carried already
    with pytest.raises(RewardFailing, match=r"failed on 1 of 32 calls: 1 timed out"):
        limit.judge(failures(MIN_WINDOW_CALLS - 9, 0), MIN_WINDOW_CALLS - 9)
    limit.judge(failures(MIN_WINDOW_CALLS, 0), MIN_WINDOW_CALLS)  # a new window


def test_a_failing_custom_reward_stops_once_its_batch_is_surely_above_the_fraction():
    reward = make_reward(RewardConfig(type="custom", function="tests.unit.reward_fns:raise_error", workers=1))
    try:
        with pytest.raises(RewardFailing) as stop:
            reward.score(["7"] * 100, [7] * 100)
    finally:
        reward.close()
    # 51 failures of 100 calls are above 0.5 whatever the other 49 would do: those are not made
    assert str(stop.value).startswith("reward.function tests.unit.reward_fns:raise_error (reward.type custom) failed "
                                      "on 51 of 51 calls (of 100 to make): 51 raised or crashed;")
    assert "The first failure: RuntimeError: boom." in str(stop.value)


def test_a_reward_that_fails_on_some_calls_scores_them_zero_and_says_which():
    reward = make_reward(RewardConfig(type="custom", function="tests.unit.reward_fns:fails_on_odd_answers", workers=1))
    try:
        answers = list(range(40))
        scores = reward.score([str(a) for a in answers], answers)
    finally:
        reward.close()
    assert scores == [float(a % 2 == 0) for a in answers]
    assert scores.failures.calls == 40 and sorted(scores.failures.failed) == list(range(1, 40, 2))
    assert scores.failures.kinds() == "20 raised or crashed" and scores.failures.first == "KeyError: 'data_source'"
    built_in = make_reward(RewardConfig(type="exact_integer")).score(["3", "4"], [3, 3])
    assert built_in == [1.0, 0.0] and built_in.failures.calls == 2 and built_in.failures.count == 0


@pytest.mark.parametrize("value, expected", [
    (1, ("ok", 1.0)), (True, ("ok", 1.0)), (np.float32(0.5), ("ok", 0.5)),
    (None, ("not a number", "returned None, not a finite number")),
    (math.inf, ("not a number", "returned inf, not a finite number")),  # its group's advantages would be nan
    (math.nan, ("not a number", "returned nan, not a finite number")),
    ("yes", ("not a number", "returned 'yes', not a finite number")),
    (10 ** 400, ("not a number", "returned 1" + "0" * 119 + "..., not a finite number")),
])
def test_a_worker_accepts_finite_numbers_only(value, expected):
    assert as_reward(value) == expected


def test_kinds_are_counted_apart_and_windows_keep_the_first_message():
    first, second = failures(4, 1, TIMEOUT), RewardFailures(calls=4)
    second.add(2, NOT_A_NUMBER, "it returned None, not a finite number")
    second.add(3, NOT_A_NUMBER, "it returned None, not a finite number")
    window = first + second
    assert window.calls == 8 and window.failed == {0: TIMEOUT, 6: NOT_A_NUMBER, 7: NOT_A_NUMBER}
    assert window.kinds() == "2 returned no finite number, 1 timed out" and window.first.startswith("KeyError")


def sample(failed: bool) -> Sample:
    return Sample([1, 2], [3], [-0.5], 0.0 if failed else 1.0, 0, 0, FinishReason.STOP, reward_failed=failed)


def test_a_rollout_batch_carries_its_failed_samples_to_the_trainer(tmp_path):
    shards = [RolloutBatch.from_samples([sample(True), sample(False), sample(True)], policy_version=0),
              RolloutBatch.from_samples([sample(False)], policy_version=0)]
    assert [b.reward_failures for b in shards] == [2, 0]
    write_shard(tmp_path / "gen_0.h5", shards[0], run_id="r", step=3, rank=0)
    assert read_shard(tmp_path / "gen_0.h5", run_id="r", step=3, rank=0).reward_failures == 2
    assert RolloutBatch.concat(shards).reward_failures == 2  # the step's, in metrics.jsonl


def test_status_shows_the_steps_whose_reward_calls_failed(repo, tmp_path):
    config = load_config(repo / "configs" / "demo.yaml", [f"run.dir={tmp_path / 'run'}", "schedule.steps=3"])
    paths = prepare_run_dir(config, render_sbatch(config))
    lines = [{"step": s, "reward_mean": 0.1, "accuracy": 0.1, "samples": 128, "reward_failures": failed,
              "time": 10.0 + s} for s, failed in enumerate((40, 0))]
    paths.metrics.write_text("".join(json.dumps(m) + "\n" for m in lines))
    status = run_status(paths)
    assert status.reward_failures == {0: 40}
    assert "reward calls that failed and scored 0: 40 samples in 1 step(s), the latest in step 1/3" in \
        format_status(status)
    assert "reward failures" not in step_line(2, 3, lines[1])
    assert "reward 0.100 acc 0.100 kl 0.0000 | reward failures 40/128" in step_line(1, 3, lines[0])
