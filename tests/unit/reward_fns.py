"""Reward functions with bad behaviour (hanging, raising, crashing, slow to start), for TimeoutPool
tests (imported by its worker processes)."""

import os
import time


def hang(completion, answer):
    time.sleep(3600)


def raise_error(completion, answer):
    raise RuntimeError("boom")


def crash(completion, answer):
    os._exit(3)


def not_a_number(completion, answer):
    return "yes"


def length_is_answer(completion, answer):
    return float(len(completion) == answer)


NOT_CALLABLE = 3


_calls_in_this_process = 0


def slow_first_call(completion, answer):
    """1.0 iff completion == str(answer), like a checker with a lazy import: the first call in a
    worker process takes 1.5 s. 'hang' hangs and 'crash' kills the process, to get a worker replaced."""
    global _calls_in_this_process
    _calls_in_this_process += 1
    if _calls_in_this_process == 1:
        time.sleep(1.5)
    if completion == "hang":
        time.sleep(3600)
    if completion == "crash":
        os._exit(3)
    return float(completion == str(answer))


def fails_on_odd_answers(completion, answer):
    """exact_integer's score, but it raises on every odd answer: a reward that fails on some calls."""
    if int(answer) % 2:
        raise KeyError("data_source")
    return float(completion.strip() == str(answer))


def infinite(completion, answer):
    return float("inf")


def format_and_correct(completion, answer, prompt, data_source=None):
    """Two named scores from the row: the answer's correctness, and a format score that rows of
    data_source 'arith' (with a prompt) grant to a completion of digits alone."""
    return {"correct": float(completion.strip() == str(answer)),
            "format": float(bool(prompt) and data_source == "arith" and completion.strip().isdigit())}


def sees_the_row(completion, answer, **row):
    """1.0 iff the call carried the prompt and the column 'level' (any keyword is taken)."""
    return float("prompt" in row and row.get("level") == 3)


def batched_exact(completions, answers, prompts, level):
    """A batched function: lists in, one score per completion out."""
    return [float(c == str(a)) + 0 * len(p) + 0 * (lv or 0) for c, a, p, lv in zip(completions, answers, prompts, level)]


def batched_too_few(completions, answers):
    return [1.0]


async def async_exact(completion, answer):
    import asyncio

    await asyncio.sleep(0)
    return float(completion == str(answer))
