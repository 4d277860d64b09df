"""Reward functions with bad behaviour, for TimeoutPool tests (imported by its worker processes)."""

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
