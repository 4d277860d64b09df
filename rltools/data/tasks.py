"""A task = where problems come from (`data.type`) + how completions are scored (`reward.type`).

Invariant: training problems of a step are a pure function of (seed, step), so any generator
rank can regenerate its share after a restart; so are the replacements dynamic sampling draws
(seed, step, draw). The step is the whole data position: a checkpoint
records the step, and a file task's position is step x prompts_per_step in its Mixture of sources.
Every problem a task hands out is rendered by the run's PromptFormat and, in the job (a tokenizer
given), tokenized: `Problem.prompt_ids` are the tokens vLLM samples from and the trainer trains on.
"""

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from ..config.schema import DataConfig, RewardConfig
from ..errors import UserError
from ..reward import Reward, make_reward
from . import arithmetic
from .arithmetic import Problem
from .files import load_problems
from .mixture import Mixture
from .prompts import PromptFormat, prompt_format

log = logging.getLogger("rltools.data")


@dataclass
class Prompts:
    """Renders and tokenizes problems; drops those longer than `max_tokens` (counted, never cut)."""

    format: PromptFormat
    tokenizer: object | None = None
    max_tokens: int | None = None

    def __call__(self, problems: list[Problem]) -> list[Problem]:
        """Generated problems (their prompt the question): rendered and tokenized."""
        return self.tokenized([replace(p, prompt=self.format.render(p.prompt)) for p in problems])

    def tokenized(self, problems: list[Problem]) -> list[Problem]:
        if self.tokenizer is None:
            return problems
        return [replace(p, prompt_ids=tuple(self.format.tokenize(self.tokenizer, p.prompt))) for p in problems]

    def fitting(self, problems: list[Problem], what: str) -> list[Problem]:
        """Tokenized `problems` within data.max_prompt_tokens; says how many were dropped."""
        problems = self.tokenized(problems)
        if self.max_tokens is None or self.tokenizer is None:
            return problems
        kept = [p for p in problems if len(p.prompt_ids) <= self.max_tokens]
        if len(kept) < len(problems):
            longest = max(len(p.prompt_ids) for p in problems)
            log.warning("%s: dropped %d of %d problems longer than data.max_prompt_tokens %d (the longest: %d tokens)",
                        what, len(problems) - len(kept), len(problems), self.max_tokens, longest)
        if not kept:
            raise UserError(f"{what}: every problem is longer than data.max_prompt_tokens {self.max_tokens}: raise it")
        return kept


@dataclass
class ArithmeticTask:
    seed: int
    reward: Reward
    prompts: Prompts
    family: str = "arithmetic"  # data.type: arithmetic or products

    def train_problems(self, step: int, count: int) -> list[Problem]:
        return self.prompts(arithmetic.train_prompts(self.seed, epoch=0, step=step, count=count, family=self.family))

    def replacement_problems(self, step: int, draw: int, count: int) -> list[Problem]:
        """Draw `draw` (1, 2, ...) of step `step`'s replacements for groups that taught nothing."""
        return self.prompts(arithmetic.train_prompts(self.seed, epoch=draw, step=step, count=count, family=self.family))

    def eval_problems(self, count: int) -> list[Problem]:
        return self.prompts(arithmetic.problems(self.seed, "eval", count, self.family))


@dataclass
class FileTask:
    sources: list[list[Problem]]
    """The training problems of each source (data.train_path, or data.train_mix in order)."""
    weights: list[float]
    eval: list[Problem]
    seed: int
    reward: Reward
    prompts: Prompts

    def __post_init__(self):
        self.mixture = self._mixture(self.seed)
        self._draws: dict[int, Mixture] = {}  # kept: a mixture computes its positions once

    def _mixture(self, seed: int) -> Mixture:
        return Mixture([len(problems) for problems in self.sources], self.weights, seed)

    def train_problems(self, step: int, count: int) -> list[Problem]:
        return [self.sources[s][i] for s, i in self.mixture.take(step, count)]

    def replacement_problems(self, step: int, draw: int, count: int) -> list[Problem]:
        """Draw `draw` (1, 2, ...) of step `step`'s replacements: from a mixture of the training
        problems of its own (the main stream's next problems belong to the next steps)."""
        if draw not in self._draws:
            self._draws[draw] = self._mixture(self.seed * 1_000_003 + draw)
        return [self.sources[s][i] for s, i in self._draws[draw].take(step, count)]

    def eval_problems(self, count: int) -> list[Problem]:
        """The first `count` held-out problems, in file order."""
        return self.eval[:count]


def make_task(data: DataConfig, reward: RewardConfig, seed: int, model_path: str | Path,
              tokenizer=None) -> ArithmeticTask | FileTask:
    """The run's task; with `tokenizer` (in the job) every problem carries its prompt tokens."""
    prompts = Prompts(prompt_format(data, model_path), tokenizer, data.max_prompt_tokens)
    if data.type in arithmetic.FAMILIES:
        if reward.kind not in ("exact_integer", "functions"):
            raise UserError(f"data.type {data.type} is scored by reward.type exact_integer, not {reward.type}")
        return ArithmeticTask(seed, make_reward(reward), prompts, data.type)
    sources, held_out = file_problems(data, reward, prompts.format)
    specs = data.train_sources()
    sources = [prompts.fitting(problems, f"{key} {spec.path}")
               for (key, _), spec, problems in zip(train_keys(data), specs, sources)]
    held_out = sources[0] if held_out is None else prompts.fitting(held_out, f"data.eval_path {data.eval_path}")
    return FileTask(sources, [spec.weight for spec in specs], held_out, seed, make_reward(reward), prompts)


def train_keys(data: DataConfig) -> list[tuple[str, str]]:
    """(key, path) of each training source, as a message names it."""
    if data.train_path is not None:
        return [("data.train_path", str(data.train_path))]
    return [(f"data.train_mix[{i}].path", str(spec.path)) for i, spec in enumerate(data.train_mix)]


def file_problems(data: DataConfig, reward: RewardConfig, fmt: PromptFormat | None) -> tuple[list[list[Problem]], list[Problem] | None]:
    """Each training source's problems and the held-out problems of a file task, rendered (held-out None:
    the one training file is the held-out file too)."""
    integer = reward.integer_answers
    sources = []
    for spec in data.train_sources():
        keys = {"prompt_key": spec.prompt_key or data.prompt_key, "answer_key": spec.answer_key or data.answer_key}
        sources.append(load_problems(spec.path, data.model_copy(update=keys), fmt, integer))
    same = data.train_path is not None and data.eval_path == data.train_path
    return sources, None if same else load_problems(data.eval_path, data, fmt, integer)


def load_tokenizer(model_path: str | Path):
    """The model's tokenizer as vLLM loads it (transformers' AutoTokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))
