"""The arithmetic task: deterministic problem lists, an honest held-out split, a strict cheap reward."""

import time

import pytest

from rltools.data.arithmetic import (
    PROMPT_SUFFIX,
    Problem,
    format_answer,
    model_text,
    problems,
    reward,
    split_of,
    train_prompts,
)


def question(problem: Problem) -> str:
    assert model_text(problem) == problem.prompt + PROMPT_SUFFIX and problem.prompt.endswith("?")
    return problem.prompt


def test_problems_are_deterministic_and_seeded():
    assert problems(0, "eval", 50) == problems(0, "eval", 50)
    assert problems(0, "eval", 50) != problems(1, "eval", 50)
    assert problems(3, "train", 20) == problems(3, "train", 40)[:20]  # a longer list extends a shorter one


def test_problem_lists_are_pinned():
    """The shipped model was pretrained on this stream and its accuracy measured on this eval list:
    a change to the generator or the split must be deliberate (and retrain the model)."""
    assert problems(0, "eval", 3) == [
        Problem("What is 7*4?", 28), Problem("What is 93+27?", 120), Problem("What is 7*7+2?", 51)
    ]
    assert train_prompts(0, 0, 1, 3) == [
        Problem("What is 73+71?", 144), Problem("What is 3+4?", 7), Problem("What is 3+22?", 25)
    ]


def test_train_prompts_are_a_function_of_seed_epoch_step():
    assert train_prompts(0, 0, 7, 16) == train_prompts(0, 0, 7, 16)  # a restarted generator agrees
    others = [train_prompts(0, 0, 8, 16), train_prompts(0, 1, 7, 16), train_prompts(1, 0, 7, 16)]
    assert all(other != train_prompts(0, 0, 7, 16) for other in others)


def test_splits_are_disjoint_and_problems_distinct():
    train = {question(p) for step in range(50) for p in train_prompts(0, 0, step, 64)}
    train |= {question(p) for p in problems(0, "train", 2000)}
    held_out = [question(p) for p in problems(0, "eval", 1000)]
    assert len(set(held_out)) == len(held_out)
    assert not train & set(held_out)
    assert all(split_of(q) == "train" for q in train) and all(split_of(q) == "eval" for q in held_out)


def test_problem_format_and_answers():
    for p in problems(0, "eval", 300) + train_prompts(0, 0, 0, 300):
        assert p.prompt.startswith("What is ") and model_text(p).endswith("?" + PROMPT_SUFFIX)
        assert p.answer >= 0
        assert eval(question(p)[len("What is "):-1]) == p.answer  # the expression is plain Python


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="split"):
        problems(0, "test", 3)
    with pytest.raises(ValueError, match="fewer"):
        problems(0, "eval", 10**6)  # more than the held-out pool holds


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("81", 1.0),
        ("81 ", 1.0),
        (" 81\n", 1.0),  # surrounding whitespace is stripped
        ("80", 0.0),
        ("081", 0.0),  # leading zeros are not canonical: rejected
        ("+81", 0.0),
        ("-81", 0.0),
        ("81.0", 0.0),
        ("8 1", 0.0),
        ("81 is the answer", 0.0),
        ("８１", 0.0),  # fullwidth digits: int() would take them, the format does not
        ("", 0.0),
        ("</s>", 0.0),
    ],
)
def test_reward(completion, expected):
    assert reward(completion, 81) == expected


def test_reward_of_zero_and_format_answer():
    assert reward("0", 0) == 1.0
    assert reward("00", 0) == 0.0
    assert reward("-0", 0) == 0.0
    assert format_answer(81) == "81" and reward(format_answer(0), 0) == 1.0


def test_reward_never_raises_and_is_fast_on_garbage():
    garbage = ["9" * 100_000, "81" + "x" * 100_000, "\x00\uffff" * 50_000, None, 81, b"81"]
    start = time.perf_counter()
    for text in garbage:
        assert reward(text, 81) == 0.0  # an int or bytes "completion" is garbage, not an answer
    assert reward(" " * 100_000 + "81", 81) == 1.0  # only surrounding whitespace: still the answer
    assert time.perf_counter() - start < 0.05
    start = time.perf_counter()
    for _ in range(10_000):
        reward("128", 128)
    assert time.perf_counter() - start < 0.5  # ~0.3 us per call here; generous under load
