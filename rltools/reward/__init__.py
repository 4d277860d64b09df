"""Verifiable rewards, chosen by `reward.type`: score completions against reference answers.

Invariant: `score` returns one float per completion and never raises on any completion text. The
built-in integer verifiers run inline (microseconds a call); math_verify and custom functions run
in a TimeoutPool of worker processes with a hard per-call deadline (reward.timeout_s), so neither
a hanging checker nor a crashing user function can stall or kill the generator.
"""

from .answers import answer_extractor, extract_answer
from .verifiers import Reward, make_reward

__all__ = ["Reward", "answer_extractor", "extract_answer", "make_reward"]
