"""The judge's wire and scoring (rltools/reward/judge.py): the real HTTP server and client, with a Python
function in place of the vLLM engine (tests/integration/test_judge.py runs the engines)."""

import logging
import threading
import time

import pytest

from rltools.config.loader import validate
from rltools.config.schema import RewardConfig
from rltools.errors import UserError
from rltools.launch.plan import plan
from rltools.reward import make_reward
from rltools.reward.failures import ERROR, NOT_A_NUMBER, TIMEOUT, FailureLimit
from rltools.reward.judge import JudgeClient, JudgeLost, JudgeScorer, JudgeServer
from rltools.reward.scorer import Call

SECRET = b"s" * 32


class Judge:
    """A judge engine on a real HTTP server whose 'model' replies SCORE: <the number in the prompt>."""

    def __init__(self, delay_s: float = 0.0, secret: bytes = SECRET):
        self.prompts: list[str] = []
        self.delay_s = delay_s

        def complete(prompts):
            time.sleep(self.delay_s)
            self.prompts += prompts
            return [f"I think... SCORE: {p.split('|')[1]}" for p in prompts]

        self.server = JudgeServer(complete, secret, "127.0.0.1")
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self):
        self.server.stop()
        self.server.close()


@pytest.fixture
def judges():
    started = []

    def start(n, **kwargs):
        started.extend(Judge(**kwargs) for _ in range(n))
        return started[-n:]

    yield start
    for judge in started:
        judge.stop()


def scorer(judges, **config):
    reward = RewardConfig(type="judge", judge={"model": "/judge", "template": "{{ completion }}|{{ answer }}|{{ tests }}",
                                                "timeout_s": 5, **config})
    made = JudgeScorer(reward.judge)
    made.client = JudgeClient(lambda: {i: j.server.address for i, j in enumerate(judges)}, SECRET, start_timeout_s=2)
    return made


def calls(answers, tests="t"):
    return [Call(f"c{i}", answer, "What is it?", {"tests": tests}) for i, answer in enumerate(answers)]


def test_each_call_is_rendered_with_its_row_and_scored_from_the_judges_reply(judges):
    two = judges(2)
    scores = scorer(two).results(calls([7, 10, 0, 3]), FailureLimit(0.5, "judge"))
    assert list(scores) == [0.7, 1.0, 0.0, 0.3] and not scores.failures.count
    assert sorted(two[0].prompts + two[1].prompts) == ["c0|7|t", "c1|10|t", "c2|0|t", "c3|3|t"]
    assert two[0].prompts and two[1].prompts, "the batch is split across the engines"


def test_a_reply_without_a_score_in_range_and_a_row_the_template_fails_on_are_failed_calls(judges):
    [one] = judges(1)
    batch = calls(["x", 11, 5]) + [Call("c3", 5, "p", {})]  # no tests column: StrictUndefined
    scores = scorer([one]).results(batch, FailureLimit(1.0, "judge"))
    assert list(scores) == [0.0, 0.0, 0.5, 0.0]
    assert scores.failures.failed == {0: NOT_A_NUMBER, 1: NOT_A_NUMBER, 3: ERROR}
    assert "'tests' is undefined" in scores.failures.first  # rendering comes first: the template's failure


def test_a_lost_judge_engine_is_left_out_and_its_share_goes_to_the_others(judges, caplog):
    first, second = judges(2)
    made = scorer([first, second])
    second.stop()
    with caplog.at_level(logging.WARNING, "rltools.reward"):
        scores = made.results(calls([1, 2, 3, 4]), FailureLimit(0.5, "judge"))
    assert list(scores) == [0.1, 0.2, 0.3, 0.4] and not scores.failures.count
    assert sorted(first.prompts) == ["c0|1|t", "c1|2|t", "c2|3|t", "c3|4|t"]
    assert "judge 1 is lost" in caplog.text and set(made.client.lost) == {1}
    first.stop()
    with pytest.raises(JudgeLost, match="every judge engine is gone: judge 0: .*judge 1: "):
        made.results(calls([1]), FailureLimit(0.5, "judge"))


def test_calls_without_a_reply_by_the_deadline_time_out(judges):
    [slow] = judges(1, delay_s=2.0)
    start = time.monotonic()
    scores = scorer([slow], timeout_s=0.5).results(calls([1, 2]), FailureLimit(1.0, "judge"))
    assert time.monotonic() - start < 1.9
    assert scores.failures.failed == {0: TIMEOUT, 1: TIMEOUT} and "timeout_s" in scores.failures.first


def test_a_judge_refuses_a_caller_without_the_runs_secret(judges):
    [other] = judges(1, secret=b"o" * 32)
    with pytest.raises(JudgeLost, match="refused this generator.*secret"):
        scorer([other]).results(calls([1]), FailureLimit(0.5, "judge"))


def test_no_judge_coming_up_in_time_is_named():
    made = JudgeScorer(RewardConfig(type="judge", judge={"model": "/judge"}).judge)
    with pytest.raises(UserError, match="only the run's own job has"):
        made.results(calls([1]), FailureLimit(0.5, "judge"))
    made.client = JudgeClient(lambda: {}, SECRET, start_timeout_s=0.1)
    with pytest.raises(JudgeLost, match="no judge engine came up within reward.judge.start_timeout_s"):
        made.results(calls([1]), FailureLimit(0.5, "judge"))


def test_the_judge_is_one_weighted_named_function_of_the_reward(judges):
    [one] = judges(1)
    reward = make_reward(RewardConfig(functions=[{"type": "exact_integer"}, {"type": "judge", "weight": 0.5}],
                                      judge={"model": "/judge", "template": "{{ completion }}|{{ answer }}|"}))
    reward.connect_judge(JudgeClient(lambda: {0: one.server.address}, SECRET, start_timeout_s=2))
    scores = reward.score(["4", "5"], [4, 4])
    assert list(scores) == [1.0 + 0.5 * 0.4, 0.5 * 0.4]
    assert scores.named == {"exact_integer": [1.0, 0.0], "judge": [0.4, 0.4]}


@pytest.mark.parametrize("reward, message", [
    ({"type": "judge"}, "needs reward.judge.model"),
    ({"judge": {"model": "/j"}}, "reward.judge.model set, but no reward function is of type judge"),
    ({"type": "judge", "judge": {"model": "/j", "score_pattern": "SCORE: \\d+"}}, "needs a group around the score"),
    ({"type": "judge", "judge": {"model": "/j", "score_pattern": "("}}, "not a regular expression"),
    ({"type": "judge", "judge": {"model": "/j", "template": "{{ completion "}}, "reward.judge.template, line 1"),
])
def test_a_judge_config_that_cannot_work_is_refused_at_load(reward, message):
    with pytest.raises(UserError, match=message):
        validate({"run": {"name": "r"}, "model": {"path": "/m"}, "reward": reward}, "c.yaml")


def test_the_judges_are_component_2_only_with_a_judge():
    base = {"run": {"name": "r"}, "model": {"path": "/m"}, "data": {"type": "arithmetic"}}
    assert [c.name for c in plan(validate(base, "c.yaml"))] == ["generators", "trainers"]
    with pytest.raises(UserError, match="cluster.judges is set, but no reward function is of type judge"):
        validate({**base, "cluster": {"judges": {"nodes": 2}}}, "c.yaml")
    judged = validate({**base, "reward": {"functions": [{"type": "exact_integer"}, {"type": "judge"}],
                                          "judge": {"model": "/j", "tensor_parallel_size": 2}},
                       "cluster": {"judges": {"nodes": 2, "ntasks_per_node": 2, "gpus_per_node": 4}}}, "c.yaml")
    [*_, judges] = plan(judged)
    assert (judges.index, judges.role, judges.entry, judges.resources.ntasks) == (2, "judge", "rltools.jobs.judge", 4)
    with pytest.raises(UserError, match="set cluster.judges.ntasks_per_node to 1"):
        plan(judged.model_copy(update={"cluster": judged.cluster.model_copy(update={
            "judges": judged.cluster.judges.model_copy(update={"gpus_per_node": 2})})}))


def judged_demo(repo, tmp_path, *overrides):
    sets = [f"run.dir={tmp_path / 'run'}", "reward.functions=[{type: exact_integer}, {type: judge}]",
            "reward.judge.model=../rltools/assets/tiny-arith", *overrides]
    return [str(repo / "configs" / "demo.yaml"), *(word for s in sets for word in ("--set", s))]


def test_submit_refuses_a_judge_model_that_is_not_there_and_eval_a_judged_reward(repo, tmp_path, capsys):
    from rltools.cli import main

    assert main(["submit", *judged_demo(repo, tmp_path, "reward.judge.model=/nowhere"), "--dry-run"]) == 2
    assert "reward.judge.model /nowhere does not exist; point reward.judge.model" in capsys.readouterr().err
    assert main(["submit", *judged_demo(repo, tmp_path), "--dry-run"]) == 0
    shown = capsys.readouterr()
    assert "component 2 judges: 1 node(s) x 1 task(s)" in shown.out + shown.err
    assert "srun --het-group=2 --kill-on-bad-exit=0 --export=ALL,RLTOOLS_ROLE=judge" in shown.out
    assert main(["eval", *judged_demo(repo, tmp_path)]) == 2
    assert "held_out are scored with the run's reward, which has a judge" in capsys.readouterr().err
