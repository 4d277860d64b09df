"""What a reward function is given (`Call`) and what scores it (`Scorer`): shared by the verifiers
(rltools/reward/verifiers.py) and the code verifier (rltools/reward/code.py)."""

import abc
from dataclasses import dataclass, field

from .failures import FailureLimit, Scores


@dataclass(frozen=True)
class Call:
    """What a reward function is given about one completion."""

    completion: str
    answer: object
    prompt: object = None
    """The row's prompt as the data gives it: text, or a list of {role, content} messages."""
    columns: dict = field(default_factory=dict)
    """The row's other columns (data_source, tests, extra_info, ...)."""

    @staticmethod
    def of(completion: str, answer, row=None) -> "Call":
        """The call for `completion` of `row` (a Problem; None: only the answer is known)."""
        if row is None:
            return Call(completion, answer)
        return Call(completion, answer, row.source_prompt if row.source_prompt is not None else row.prompt, row.columns)


class Scorer(abc.ABC):
    """One function's results: a float or a dict of named floats per call, the fallback 0.0 where it failed."""

    @abc.abstractmethod
    def results(self, calls: list[Call], limit: FailureLimit) -> Scores:
        """One result per call, in order, and which calls failed (it may stop early past `limit.allowed`)."""

    def close(self) -> None:
        pass
