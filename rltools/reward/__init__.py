"""Verifiable rewards, chosen by `reward.type`: score completions against reference answers.

Invariant: `score` returns one float per completion whatever its text, and which calls failed. The
built-in integer verifiers run inline (microseconds a call) and never fail; math_verify and custom
functions run in a TimeoutPool of worker processes with a hard per-call deadline (reward.timeout_s),
so neither a hanging checker nor a crashing user function can stall or kill the generator: a failed
call scores 0 and is counted, and too many of them raise RewardFailing (rltools/reward/failures.py).
"""

from .answers import answer_extractor, extract_answer
from .verifiers import Reward, make_reward

__all__ = ["Reward", "answer_extractor", "extract_answer", "make_reward"]
