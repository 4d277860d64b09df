import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rltools.config.schema import DataConfig, RewardConfig
from rltools.data.files import load_problems
from rltools.data.order import Cursor, DataOrder
from rltools.data.prompts import prompt_format
from rltools.data.tasks import make_task as make_any_task
from rltools.errors import UserError
from tests.unit.aime_fixture import PROBLEMS, write_jsonl

TEMPLATE = "{prompt}\n\nPut your final answer within \\boxed{{}}."
TINY = Path(__file__).resolve().parents[2] / "rltools" / "assets" / "tiny-arith"


def make_task(data, reward, seed):
    return make_any_task(data, reward, seed, TINY)


def load(path, kind="jsonl", integer=True, dedupe=True, template="{prompt}", prompt_key="problem",
         answer_key="answer", chat="none", **keys):
    data = DataConfig(type=kind, train_path=str(path), eval_path=str(path), prompt_key=prompt_key,
                      answer_key=answer_key, prompt_template=template, dedupe=dedupe, chat_template=chat, **keys)
    return load_problems(path, data, prompt_format(data, TINY), integer)


def test_jsonl_problems_with_template_and_integer_answers(tmp_path):
    write_jsonl(tmp_path / "aime.jsonl")
    problems = load(tmp_path / "aime.jsonl", template=TEMPLATE)
    assert [p.answer for p in problems] == [25, 1, 42, 18, 400]
    assert problems[0].prompt == PROBLEMS[0]["problem"] + "\n\nPut your final answer within \\boxed{}."


def test_parquet_reads_like_jsonl(tmp_path):
    write_jsonl(tmp_path / "aime.jsonl")
    pq.write_table(pa.Table.from_pylist([{**r, "answer": str(r["answer"])} for r in PROBLEMS]), tmp_path / "aime.parquet")
    assert load(tmp_path / "aime.parquet", kind="parquet") == load(tmp_path / "aime.jsonl")


def test_dedupe_keeps_the_first_of_each_repeated_problem(tmp_path):
    write_jsonl(tmp_path / "aime.jsonl", repeat=32)  # like the public copy that repeats every problem 32 times
    assert len(load(tmp_path / "aime.jsonl")) == len(PROBLEMS)
    assert len(load(tmp_path / "aime.jsonl", dedupe=False)) == 32 * len(PROBLEMS)


def test_text_answers_stay_text_for_non_integer_rewards(tmp_path):
    (tmp_path / "p.jsonl").write_text(json.dumps({"problem": "Simplify 2/4.", "answer": "\\frac{1}{2}"}) + "\n")
    assert load(tmp_path / "p.jsonl", integer=False)[0].answer == "\\frac{1}{2}"


@pytest.mark.parametrize("content, message", [
    ("", "holds no problems"),
    ("\n\n", "holds no problems"),
    ('{"problem": "a", "answer": 1}\n{"problem": "b", "answer": 2\n', "p.jsonl:2: not valid JSON"),
    ('[1, 2]\n', "p.jsonl:1: expected a JSON object"),
    ('{"problem": "a", "answer": 1}\n{"question": "b", "answer": 2}\n', "p.jsonl:2: no key 'problem'"),
    ('{"problem": "a", "solution": 1}\n', "p.jsonl:1: no key 'answer'"),
    ('{"problem": "a", "answer": "one half"}\n', "p.jsonl:1: 'answer' is 'one half', not an integer"),
    ('{"problem": 7, "answer": 1}\n', "p.jsonl:1: 'problem' must be non-empty text"),
])
def test_bad_input_names_the_file_line_and_key(tmp_path, content, message):
    (tmp_path / "p.jsonl").write_text(content)
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load(tmp_path / "p.jsonl")


def test_missing_file_and_broken_parquet_and_template(tmp_path):
    with pytest.raises(UserError, match="no such data file"):
        load(tmp_path / "missing.jsonl")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(UserError, match="bad.parquet: not a readable Parquet file"):
        load(tmp_path / "bad.parquet", kind="parquet")
    write_jsonl(tmp_path / "aime.jsonl")
    with pytest.raises(UserError, match="data.prompt_template"):
        load(tmp_path / "aime.jsonl", template="{prompt} \\boxed{}")


def test_each_epoch_is_a_permutation_and_orders_differ():
    order = DataOrder(10, seed=3)
    assert sorted(order.permutation(0)) == list(range(10))
    assert order.permutation(0) != order.permutation(1)
    assert DataOrder(10, seed=3).permutation(1) == order.permutation(1)  # pure function of (seed, epoch, size)
    assert DataOrder(10, seed=4).permutation(0) != order.permutation(0)


def test_cursor_resumes_exactly_and_crosses_epochs():
    order = DataOrder(7, seed=0)
    straight, cursor = order.take(Cursor(), 20)
    first, saved = order.take(Cursor(), 9)
    resumed, end = DataOrder(7, seed=0).take(Cursor.from_dict(json.loads(json.dumps(saved.to_dict()))), 11)
    assert first + resumed == straight and end == cursor == Cursor(2, 6)
    assert straight[:7] == order.permutation(0) and straight[7:14] == order.permutation(1)
    assert order.cursor_at(step=3, count=3) == saved == Cursor(1, 2)


def test_file_task_steps_are_a_pure_function_of_the_step(tmp_path):
    write_jsonl(tmp_path / "aime.jsonl")
    data = DataConfig(type="jsonl", train_path=str(tmp_path / "aime.jsonl"), eval_path=str(tmp_path / "aime.jsonl"))
    task = make_task(data, RewardConfig(type="boxed_integer"), seed=1)
    again = make_task(data, RewardConfig(type="boxed_integer"), seed=1)
    steps = [task.train_problems(step, 2) for step in range(5)]  # 10 problems: two epochs of 5
    assert [again.train_problems(step, 2) for step in reversed(range(5))] == steps[::-1]
    first_epoch = [p.answer for s in steps[:2] for p in s] + [steps[2][0].answer]
    assert sorted(first_epoch) == [1, 18, 25, 42, 400]  # every problem once per epoch
    order = DataOrder(5, seed=1)  # one source: the single file's order of shuffled epochs, from the step alone
    assert [p.answer for s in steps for p in s] == [task.sources[0][i].answer for i in order.take(Cursor(), 10)[0]]
    assert task.eval_problems(3) == task.eval[:3] and [p.answer for p in task.eval] == [25, 1, 42, 18, 400]
    assert task.reward.score(["so \\boxed{025}."], [25]) == [1.0]


def test_dynamic_sampling_replacements_are_a_pure_function_of_step_and_draw(tmp_path):
    """A restarted generator redraws the same replacements; rounds differ from the step's own
    prompts and from each other (arithmetic: other problems; files: another order of the file)."""
    write_jsonl(tmp_path / "aime.jsonl")
    data = DataConfig(type="jsonl", train_path=str(tmp_path / "aime.jsonl"), eval_path=str(tmp_path / "aime.jsonl"))
    for task, again in ((make_task(data, RewardConfig(type="boxed_integer"), seed=1),
                         make_task(data, RewardConfig(type="boxed_integer"), seed=1)),
                        (make_task(DataConfig(), RewardConfig(), 1), make_task(DataConfig(), RewardConfig(), 1))):
        rounds = [task.replacement_problems(3, draw, 5) for draw in (1, 2)]
        assert rounds == [again.replacement_problems(3, draw, 5) for draw in (1, 2)]
        assert rounds[0] != rounds[1] and task.train_problems(3, 5) not in rounds


def test_file_data_needs_both_paths():
    with pytest.raises(ValueError, match="data.eval_path"):
        DataConfig(type="jsonl", train_path="train.jsonl")


def test_arithmetic_needs_exact_integer():
    with pytest.raises(UserError, match="exact_integer"):
        make_task(DataConfig(), RewardConfig(type="boxed_integer"), seed=0)


def test_a_mixture_takes_each_source_by_weight_in_its_own_epochs(tmp_path):
    """data.train_mix: sources drawn by weight per position, a pure function of (seed, step); each source
    in its own shuffled epochs; a source with keys of its own."""
    from collections import Counter

    big, small = tmp_path / "big.jsonl", tmp_path / "small.parquet"
    big.write_text("".join(json.dumps({"problem": f"big {i}", "answer": i}) + "\n" for i in range(40)))
    pq.write_table(pa.Table.from_pylist([{"q": f"small {i}", "a": {"n": 1000 + i}} for i in range(7)]), small)
    data = DataConfig(train_mix=[{"path": str(big), "weight": 3}, {"path": str(small), "prompt_key": "q",
                                                                   "answer_key": "a.n"}], eval_path=str(big))
    task, again = make_task(data, RewardConfig(type="boxed_integer"), seed=2), make_task(data, RewardConfig(), 2)
    steps = [task.train_problems(step, 8) for step in range(50)]
    assert [again.train_problems(step, 8) for step in reversed(range(50))] == steps[::-1]  # any order, same steps
    drawn = [p.answer for s in steps for p in s]
    small_share = sum(a >= 1000 for a in drawn) / len(drawn)
    assert 0.2 < small_share < 0.3, small_share  # weight 1 of 4
    smalls = [a for a in drawn if a >= 1000]
    for epoch in range(len(smalls) // 7):  # every problem of the small source once per epoch of it
        assert sorted(smalls[7 * epoch:7 * epoch + 7]) == list(range(1000, 1007))
    assert max(Counter(a for a in drawn if a < 1000).values()) - min(Counter(a for a in drawn if a < 1000).values()) <= 1
    assert task.replacement_problems(3, 1, 8) != task.train_problems(3, 8)


def test_mixture_keys_that_contradict_are_refused():
    with pytest.raises(ValueError, match="data.train_path and data.train_mix are both set"):
        DataConfig(train_path="a.jsonl", train_mix=[{"path": "b.jsonl"}], eval_path="a.jsonl")
    with pytest.raises(ValueError, match=r"data.train_mix\[1\].path b.jsonl reads as jsonl, but data.type is parquet"):
        DataConfig(type="parquet", train_mix=[{"path": "a.parquet"}, {"path": "b.jsonl"}], eval_path="a.parquet")
    assert DataConfig(train_mix=[{"path": "a.parquet"}, {"path": "b.jsonl"}], eval_path="e.jsonl").type == "parquet"
