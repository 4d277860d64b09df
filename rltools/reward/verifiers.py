"""The reward types of `reward.type` and the factory that picks one (see rltools/reward/__init__.py)."""

import abc
import importlib.util
import logging
from dataclasses import dataclass
from typing import Callable, Sequence

from ..config.schema import RewardConfig
from ..errors import UserError
from .answers import answer_line_answer, boxed_integer_answer
from .extract import TAIL_CHARS, exact_integer
from .failures import FailureLimit, Scores
from .pool import TimeoutPool, Warmup, default_workers

log = logging.getLogger("rltools.reward")

MATH_VERIFY = "rltools.reward.math:math_verify_score"
MATH_VERIFY_WARMUP = Warmup(("\\boxed{1}", 1), 1.0)  # known correct: proves the checker works, builds its parser
INTEGER_TYPES = ("exact_integer", "boxed_integer", "answer_line")


def boxed_integer(completion: str, answer: int) -> float:
    """1.0 iff the last balanced \\boxed{...} of the completion's tail spells `answer`."""
    value = boxed_integer_answer(completion)
    return 1.0 if value is not None and value == answer else 0.0


def answer_line_integer(completion: str, answer: int) -> float:
    """1.0 iff the last 'Answer: N' line (DAPO style) spells `answer`."""
    value = answer_line_answer(completion)
    return 1.0 if value is not None and value == answer else 0.0


INLINE: dict[str, Callable[[str, int], float]] = {
    "exact_integer": exact_integer,
    "boxed_integer": boxed_integer,
    "answer_line": answer_line_integer,
}


class Reward(abc.ABC):
    """Scores completions; `close` releases worker processes (a no-op for inline verifiers)."""

    @abc.abstractmethod
    def score(self, completions: Sequence[str], answers: Sequence) -> Scores:
        """One reward per (completion, answer) pair, in order, with the calls that failed (scored 0);
        RewardFailing when too many failed (rltools/reward/failures.py)."""

    def close(self) -> None:
        pass


@dataclass
class InlineReward(Reward):
    function: Callable[[str, int], float]

    def score(self, completions: Sequence[str], answers: Sequence) -> Scores:
        return Scores(self.function(c, a) for c, a in zip(completions, answers, strict=True))  # they never fail


@dataclass
class PooledReward(Reward):
    pool: TimeoutPool
    tail_only: bool
    """Send only the completion's last TAIL_CHARS characters (math_verify reads the final answer)."""
    limit: FailureLimit

    def score(self, completions: Sequence[str], answers: Sequence) -> Scores:
        texts = [c[-TAIL_CHARS:] if self.tail_only and isinstance(c, str) else c for c in completions]
        calls = list(zip(texts, answers, strict=True))
        scores = self.pool.map(calls, max_failures=self.limit.allowed(len(calls)))
        failures = scores.failures
        self.limit.judge(failures, len(calls))  # RewardFailing says it all
        if failures.count:  # one line a batch, not one a call (a broken function fails thousands)
            log.warning("%s: %d of %d calls failed (%s) and scored 0; the first: %s", self.limit.what, failures.count,
                        failures.calls, failures.kinds(), failures.first)
        return scores

    def close(self) -> None:
        self.pool.close()


def make_reward(config: RewardConfig) -> Reward:
    """The verifier `config.type` names; UserError if it cannot run here.

    Pooled rewards get workers that are ready before the first call: math_verify's workers import
    math-verify and score MATH_VERIFY_WARMUP (a start-up failure if it is not 1.0); a custom
    function's workers import its module but make no call, so what the function itself does
    lazily on its first call still counts against that call's reward.timeout_s.
    """
    if config.type in INLINE:
        return InlineReward(INLINE[config.type])
    # find_spec, not an import: only the workers need math-verify (and sympy) in memory
    if config.type == "math_verify" and importlib.util.find_spec("math_verify") is None:
        raise UserError("reward.type math_verify needs the math-verify package: pip install 'rltools[math]'")
    reference, warmup = (MATH_VERIFY, MATH_VERIFY_WARMUP) if config.type == "math_verify" else (config.function, None)
    try:
        pool = TimeoutPool(reference, config.timeout_s, config.workers or default_workers(), warmup=warmup)
    except ValueError as err:
        raise UserError(f"reward.type {config.type}: {err}") from None
    named = ("reward.type math_verify" if config.type == "math_verify"
             else f"reward.function {config.function} (reward.type custom)")
    limit = FailureLimit(config.max_failure_fraction, named)
    return PooledReward(pool, tail_only=config.type == "math_verify", limit=limit)
