"""Reward calls that failed, counted, and the limit above which a run stops rather than train on them.

A failed call (it timed out, raised, crashed its worker process, or returned something that is not
a finite number) scores 0 like a wrong answer, so a reward that fails on every call would train on
zero advantages and look like a model that learns nothing.

Invariants:
- Every scoring batch says which of its calls failed and how (`Scores.failures`); the generator
  counts them per step (metrics.jsonl `reward_failures`).
- `FailureLimit` judges windows of at least MIN_WINDOW_CALLS calls: one scoring batch (a step's, an
  evaluation's), or consecutive smaller batches added up, so a single flaky call never stops a run.
  Above `reward.max_failure_fraction` of a window's calls it raises RewardFailing, a UserError naming
  the reward, how its calls failed and what the first failure said.
- The decision never depends on how fast workers answer: a batch stopped early (`allowed`) is one
  whose failures already exceed the fraction of all the calls it was to make.
"""

import math
from dataclasses import dataclass, field

from ..errors import UserError

MIN_WINDOW_CALLS = 32
TIMEOUT, ERROR, NOT_A_NUMBER = "timed out", "raised or crashed", "returned no finite number"


@dataclass
class RewardFailures:
    """The calls of a scoring batch whose function failed (each scored the fallback, 0)."""

    calls: int = 0
    """Calls made."""
    failed: dict[int, str] = field(default_factory=dict)
    """Index of each failed call -> how: TIMEOUT, ERROR (it raised, or its worker process died) or NOT_A_NUMBER."""
    first: str = ""
    """What the first failure said (the exception, the value returned)."""

    def add(self, index: int, kind: str, message: str) -> None:
        self.failed[index] = kind
        self.first = self.first or message

    @property
    def count(self) -> int:
        return len(self.failed)

    def kinds(self) -> str:
        """'65 raised or crashed, 2 timed out': how many failed each way, the most frequent first."""
        counts = {kind: list(self.failed.values()).count(kind) for kind in (ERROR, TIMEOUT, NOT_A_NUMBER)}
        return ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items(), key=lambda item: -item[1]) if n)

    def __add__(self, other: "RewardFailures") -> "RewardFailures":
        """Both batches as one window (`other`'s indices follow this one's calls)."""
        return RewardFailures(self.calls + other.calls,
                              {**self.failed, **{self.calls + i: kind for i, kind in other.failed.items()}},
                              self.first or other.first)


class Scores(list):
    """One reward per call, in order (a list of floats), and `failures`: which calls failed and how;
    a reward of several functions (or one returning named scores) also gives each score by name
    (`named`: nan where a call did not give it) and the calls of each function that failed (`failed_by`)."""

    def __init__(self, values, failures: RewardFailures | None = None, named: dict[str, list[float]] | None = None,
                 failed_by: dict[str, set[int]] | None = None):
        super().__init__(values)
        self.failures = failures if failures is not None else RewardFailures(calls=len(self))
        self.named = named or {}
        self.failed_by = failed_by or {}

    def outcome(self, k: int) -> dict:
        """Whether call k failed and, for a reward of several scores, each score by name and the functions
        that failed on it (keywords of a rollout Sample besides its reward)."""
        outcome = {"reward_failed": k in self.failures.failed}
        if self.named or self.failed_by:
            outcome["scores"] = {name: values[k] for name, values in self.named.items()}
            outcome["failed_functions"] = tuple(name for name, calls in self.failed_by.items() if k in calls)
        return outcome


class RewardFailing(UserError):
    """The reward failed on more than reward.max_failure_fraction of its calls: the run stops."""


class FailureLimit:
    """reward.max_failure_fraction, judged over windows of at least MIN_WINDOW_CALLS calls.

    `what` names the reward in the error ("reward.function pkg.mod:f (reward.type custom)")."""

    def __init__(self, max_fraction: float, what: str):
        self.max_fraction, self.what = max_fraction, what
        self.carried = RewardFailures()
        """Calls of earlier batches too small to judge alone: they open the next window."""

    def allowed(self, calls: int) -> int | None:
        """How many of a batch of `calls` calls may fail before its window is surely above the limit
        (the scorer may stop sending calls past that); None while the window is too small to judge."""
        total = self.carried.calls + calls
        if total < MIN_WINDOW_CALLS:
            return None
        return math.floor(self.max_fraction * total) - self.carried.count

    def judge(self, failures: RewardFailures, calls: int) -> None:
        """After a batch that was to make `calls` calls (`failures.calls` made): RewardFailing when its
        window failed on more than max_fraction of them."""
        window = self.carried + failures
        total = self.carried.calls + calls
        if total < MIN_WINDOW_CALLS:
            self.carried = window
            return
        self.carried = RewardFailures()
        if window.count > self.max_fraction * total:
            made = f"{window.count} of {window.calls} calls" + (f" (of {total} to make)" * (window.calls < total))
            raise RewardFailing(
                f"{self.what} failed on {made}: {window.kinds()}; more than reward.max_failure_fraction "
                f"{self.max_fraction:g} of them. The first failure: {window.first}. A failed call scores 0: the run "
                "stopped rather than train on such scores. Call the function on a completion and an answer of your "
                "data to see why, fix it (its module is imported again when the run resumes), then continue the run "
                "with `rltools resume RUN_DIR` (calls that time out: add --set reward.timeout_s=SECONDS)."
            )
