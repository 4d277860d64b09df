"""A task = where problems come from (`data.type`) + how completions are scored (`reward.type`).

Invariant: training problems of a step are a pure function of (seed, step), so any generator
rank can regenerate its share after a restart; so are the replacements dynamic sampling draws
(seed, step, draw). The step is the whole data position: a checkpoint
records the step, and the cursor of a file task is `DataOrder.cursor_at(step, prompts_per_step)`.
"""

from dataclasses import dataclass

from ..config.schema import DataConfig, RewardConfig
from ..errors import UserError
from ..reward import Reward, make_reward
from ..reward.verifiers import INTEGER_TYPES
from . import arithmetic
from .arithmetic import Problem
from .files import load_problems
from .order import DataOrder


@dataclass
class ArithmeticTask:
    seed: int
    reward: Reward
    family: str = "arithmetic"  # data.type: arithmetic or products

    def train_problems(self, step: int, count: int) -> list[Problem]:
        return arithmetic.train_prompts(self.seed, epoch=0, step=step, count=count, family=self.family)

    def replacement_problems(self, step: int, draw: int, count: int) -> list[Problem]:
        """Draw `draw` (1, 2, ...) of step `step`'s replacements for groups that taught nothing."""
        return arithmetic.train_prompts(self.seed, epoch=draw, step=step, count=count, family=self.family)

    def eval_problems(self, count: int) -> list[Problem]:
        return arithmetic.problems(self.seed, "eval", count, self.family)


@dataclass
class FileTask:
    train: list[Problem]
    eval: list[Problem]
    order: DataOrder
    reward: Reward

    def train_problems(self, step: int, count: int) -> list[Problem]:
        indices, _ = self.order.take(self.order.cursor_at(step, count), count)
        return [self.train[i] for i in indices]

    def replacement_problems(self, step: int, draw: int, count: int) -> list[Problem]:
        """Draw `draw` (1, 2, ...) of step `step`'s replacements: from an order of the training
        problems of its own (the main order's next problems belong to the next steps)."""
        order = DataOrder(len(self.train), self.order.seed * 1_000_003 + draw)
        indices, _ = order.take(order.cursor_at(step, count), count)
        return [self.train[i] for i in indices]

    def eval_problems(self, count: int) -> list[Problem]:
        """The first `count` held-out problems, in file order."""
        return self.eval[:count]


def make_task(data: DataConfig, reward: RewardConfig, seed: int) -> ArithmeticTask | FileTask:
    if data.type in arithmetic.FAMILIES:
        if reward.type != "exact_integer":
            raise UserError(f"data.type {data.type} is scored by reward.type exact_integer, not {reward.type}")
        return ArithmeticTask(seed, make_reward(reward), data.type)
    integer = reward.type in INTEGER_TYPES

    def load(path):
        return load_problems(
            path, data.type, data.prompt_key, data.answer_key, data.prompt_template, data.dedupe, integer
        )

    train = load(data.train_path)
    held_out = train if data.eval_path == data.train_path else load(data.eval_path)
    return FileTask(train, held_out, DataOrder(len(train), seed), make_reward(reward))
