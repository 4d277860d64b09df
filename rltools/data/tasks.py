"""A task = where problems come from + how completions are scored; chosen by `data.type` / `reward.type`.

Invariant: training problems of a step are a pure function of (seed, epoch, step), so any generator
rank can regenerate its share after a restart.
"""

from dataclasses import dataclass

from ..config.schema import DataConfig, RewardConfig
from ..errors import UserError
from . import arithmetic
from .arithmetic import Problem


@dataclass(frozen=True)
class ArithmeticTask:
    seed: int

    def train_problems(self, step: int, count: int) -> list[Problem]:
        return arithmetic.train_prompts(self.seed, epoch=0, step=step, count=count)

    def eval_problems(self, count: int) -> list[Problem]:
        return arithmetic.problems(self.seed, "eval", count)

    @staticmethod
    def reward(completion_text: str, answer: int) -> float:
        return arithmetic.reward(completion_text, answer)


def make_task(data: DataConfig, reward: RewardConfig, seed: int) -> ArithmeticTask:
    if data.type == "arithmetic" and reward.type == "exact_integer":
        return ArithmeticTask(seed)
    raise UserError(
        f"data.type {data.type} with reward.type {reward.type} is not available yet: this release runs "
        "data.type arithmetic with reward.type exact_integer (file datasets and math rewards come next)"
    )
