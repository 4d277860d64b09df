"""The reward of a run: the functions of `reward.functions` (or the one `reward.type` names), each
scored on every completion and summed by weight (see rltools/reward/__init__.py).

Invariants:
- A function sees each completion with its row: the reference answer, the prompt as the data gives
  it (text or messages) and the row's other columns (`Call`); it returns a float or a dict of named
  floats. Each score is kept by name (`Scores.named`), each function's failures are counted and
  judged apart (`Scores.failed_by`, one FailureLimit each), and a failed call adds 0 to the sum.
- Names are unique within a reward: a dict's key that another function also produces is refused.
"""

import importlib.util
import logging
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from ..config.schema import INTEGER_VERIFIERS, RewardConfig, RewardFunctionConfig
from ..errors import UserError
from .answers import answer_line_answer, boxed_integer_answer
from .extract import TAIL_CHARS, exact_integer
from .failures import NOT_A_NUMBER, FailureLimit, RewardFailures, Scores
from .pool import TimeoutPool, Warmup, default_workers
from .scorer import Call, Scorer

log = logging.getLogger("rltools.reward")

MATH_VERIFY = "rltools.reward.math:math_verify_score"
MATH_VERIFY_WARMUP = Warmup(("\\boxed{1}", 1), 1.0)  # known correct: proves the checker works, builds its parser
INTEGER_TYPES = INTEGER_VERIFIERS


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


@dataclass
class InlineScorer(Scorer):
    function: Callable[[str, int], float]

    def results(self, calls: list[Call], limit: FailureLimit) -> Scores:
        return Scores(self.function(c.completion, c.answer) for c in calls)  # the integer verifiers never fail


@dataclass
class PooledScorer(Scorer):
    pool: TimeoutPool
    tail_only: bool
    """Send only the completion's last TAIL_CHARS characters (math_verify reads the final answer)."""

    def results(self, calls: list[Call], limit: FailureLimit) -> Scores:
        texts = [c.completion[-TAIL_CHARS:] if self.tail_only and isinstance(c.completion, str) else c.completion
                 for c in calls]
        if self.pool.batched:
            return self._batched(calls, texts)
        return self.pool.map([((text, c.answer), {**c.columns, "prompt": c.prompt}) for text, c in zip(texts, calls)],
                             max_failures=limit.allowed(len(calls)))

    def _batched(self, calls: list[Call], texts: list[str]) -> Scores:
        """The calls in one chunk per worker, each a call of lists; a failed chunk fails all its completions."""
        size = max(1, math.ceil(len(calls) / len(self.pool._workers)))
        chunks = [range(start, min(start + size, len(calls))) for start in range(0, len(calls), size)]
        names = sorted({name for c in calls for name in c.columns})
        replies = self.pool.map([(([texts[i] for i in chunk], [calls[i].answer for i in chunk]),
                                  {**{name: [calls[i].columns.get(name) for i in chunk] for name in names},
                                   "prompts": [calls[i].prompt for i in chunk]}) for chunk in chunks])
        values, failures = [0.0] * len(calls), RewardFailures(calls=len(calls))
        for j, chunk in enumerate(chunks):
            for position, i in enumerate(chunk):
                if j in replies.failures.failed:
                    failures.add(i, replies.failures.failed[j], replies.failures.first)
                    continue
                status, value = replies[j][position]
                if status == "ok":
                    values[i] = value
                else:
                    failures.add(i, NOT_A_NUMBER, f"it {value}")
        return Scores(values, failures)

    def close(self) -> None:
        self.pool.close()


@dataclass
class Function:
    """One function of the reward: its scorer, its name, its weight and its failure limit."""

    label: str
    weight: float | dict[str, float]
    scorer: Scorer
    limit: FailureLimit

    def weigh(self, value) -> tuple[float, dict[str, float]]:
        """(weight x score, the named scores) of one result; ValueError when it does not fit the weight."""
        if isinstance(value, dict):
            if not isinstance(self.weight, dict):
                return self.weight * sum(value.values()), value
            missing = [name for name in self.weight if name not in value]
            if missing:
                raise ValueError(f"returned {sorted(value)}, without {missing[0]!r}, which its weight names")
            return sum(w * value[name] for name, w in self.weight.items()), value
        if isinstance(self.weight, dict):
            raise ValueError(f"returned a number, but its weight names scores ({', '.join(self.weight)}): "
                             "return a dict of them")
        return self.weight * value, {self.label: value}


class Reward:
    """Scores completions with every function and sums them by weight; `close` releases worker processes."""

    def __init__(self, functions: list[Function]):
        self.functions = functions

    @property
    def named(self) -> bool:
        """Whether the scores have names worth logging apart (several functions, or one's dict)."""
        return len(self.functions) > 1 or isinstance(self.functions[0].weight, dict)

    def score(self, completions: Sequence[str], answers: Sequence, rows: Sequence | None = None) -> Scores:
        """One reward per completion, in order; with `rows` (the Problems) the functions see each row's
        prompt and columns. RewardFailing when too many calls of a function failed (failures.py)."""
        calls = [Call.of(c, a, r) for c, a, r in zip(completions, answers, rows or [None] * len(completions),
                                                        strict=True)]
        total, named, owners = [0.0] * len(calls), {}, {}
        union, failed_by = RewardFailures(calls=len(calls)), {}
        for function in self.functions:
            results = function.scorer.results(calls, function.limit)
            failures = results.failures
            for i, value in enumerate(results):
                if i in failures.failed:
                    continue
                try:
                    weighted, scores = function.weigh(value)
                except ValueError as err:
                    failures.add(i, NOT_A_NUMBER, f"it {err}")
                    continue
                total[i] += weighted
                for name, score in scores.items():
                    if owners.setdefault(name, function.label) != function.label:
                        raise UserError(f"reward functions {owners[name]} and {function.label} both return a "
                                        f"score named {name!r}: rename one (reward.functions[].name, or its key)")
                    named.setdefault(name, [math.nan] * len(calls))[i] = score
            function.limit.judge(failures, len(calls))  # RewardFailing says it all
            if failures.count:  # one line a batch, not one a call (a broken function fails thousands)
                log.warning("%s: %d of %d calls failed (%s) and scored 0; the first: %s", function.limit.what,
                            failures.count, failures.calls, failures.kinds(), failures.first)
            failed_by[function.label] = set(failures.failed)
            for i, kind in failures.failed.items():
                if i not in union.failed:  # a completion fails once, however many of its functions failed
                    union.add(i, kind, failures.first)
        named, failed_by = (named, failed_by) if self.named else ({}, {})
        return Scores(total, union, named=named, failed_by=failed_by)

    def connect_judge(self, client) -> None:
        """Give the judge functions among these their way to the judge engines (a JudgeClient)."""
        from .judge import JudgeScorer

        for function in self.functions:
            if isinstance(function.scorer, JudgeScorer):
                function.scorer.client = client

    def close(self) -> None:
        for function in self.functions:
            function.scorer.close()


def make_reward(config: RewardConfig) -> Reward:
    """The reward `config` describes; UserError if one of its functions cannot run here.

    Pooled functions get workers that are ready before the first call: math_verify's workers import
    math-verify and score MATH_VERIFY_WARMUP (a start-up failure if it is not 1.0); a custom
    function's workers import its module but make no call, so what the function itself does
    lazily on its first call still counts against that call's deadline.
    """
    functions = []
    try:
        for index, entry in enumerate(entries(config)):
            what = (f"reward.functions[{index}] ({entry.label})" if config.functions
                    else f"reward.function {entry.function} (reward.type custom)" if entry.type == "custom"
                    else f"reward.type {entry.type}")
            scorer = _scorer(entry, config, what)
            functions.append(Function(entry.label, entry.weight, scorer, FailureLimit(config.max_failure_fraction, what)))
    except BaseException:
        Reward(functions).close()
        raise
    return Reward(functions)


def entries(config: RewardConfig) -> list[RewardFunctionConfig]:
    """The functions the reward sums: reward.functions, or the one reward.type (and reward.function) name."""
    if config.functions:
        return list(config.functions)
    return [RewardFunctionConfig(type=config.type, function=config.function if config.type == "custom" else None)]


def _scorer(entry: RewardFunctionConfig, config: RewardConfig, what: str) -> Scorer:
    if entry.type in INLINE:
        return InlineScorer(INLINE[entry.type])
    timeout_s = entry.timeout_s or config.timeout_s
    if entry.type == "code":
        from .code import CodeScorer  # the sandbox: only where a code reward runs

        return CodeScorer(config.code, timeout_s)
    if entry.type == "judge":
        from .judge import JudgeScorer

        return JudgeScorer(config.judge)
    # find_spec, not an import: only the workers need math-verify (and sympy) in memory
    if entry.type == "math_verify" and importlib.util.find_spec("math_verify") is None:
        raise UserError(f"{what} needs the math-verify package: pip install 'rltools[math]'")
    reference, warmup = (MATH_VERIFY, MATH_VERIFY_WARMUP) if entry.type == "math_verify" else (entry.function, None)
    try:
        pool = TimeoutPool(reference, timeout_s, config.workers or default_workers(), warmup=warmup,
                           batched=entry.batched)
    except ValueError as err:
        raise UserError(f"{what}: {err}") from None
    return PooledScorer(pool, tail_only=entry.type == "math_verify")
