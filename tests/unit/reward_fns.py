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
