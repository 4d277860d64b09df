"""The run's evaluation sets (`eval.sets`): each its problems, verifier, k and sampling.

Invariants:
- Without `eval.sets` there is one set, `held_out`: the task's held-out problems (data.eval_path, or
  the generated held-out arithmetic), eval.k samples at the generator's sampling: the run's evaluation
  as it was before sets existed. The first set is the run's headline.
- A set's problems are rendered and tokenized exactly as the training problems are (the task's
  Prompts), read with the set's own keys; a set evaluates all its problems unless `problems` (or
  eval.problems) cuts it, and a cut is logged with both counts.
- A set's reward is the run's verifier unless it names another; each set's verifier is made once, and
  `EvalSets.close` releases the ones it made.
"""

import logging
from dataclasses import dataclass

from ..config.schema import HELD_OUT, DataConfig, EvalConfig, EvalSetConfig, GeneratorConfig, RewardConfig
from ..reward import Reward, make_reward
from ..reward.verifiers import INTEGER_TYPES
from .arithmetic import Problem
from .files import load_problems

log = logging.getLogger("rltools.data")
GENERATED_PROBLEMS = 256  # the generated held-out arithmetic has no natural "all"


@dataclass
class EvalSet:
    name: str
    problems: list[Problem]
    available: int
    """Problems the set holds; more than len(problems) when eval.problems or the set's cut it."""
    k: int
    temperature: float
    top_p: float
    max_tokens: int
    reward: Reward
    reward_type: str


class EvalSets(list):
    """The run's EvalSets, in config order; `close` releases the verifiers made for them."""

    def __init__(self, sets: list[EvalSet], own: list[Reward]):
        super().__init__(sets)
        self._own = own

    def close(self) -> None:
        for reward in self._own:
            reward.close()


def eval_sets(evals: EvalConfig, data: DataConfig, reward: RewardConfig, generator: GeneratorConfig, task,
              k: int | None = None, count: int | None = None) -> EvalSets:
    """The sets of `evals` over `task` (its held-out problems, its Prompts and verifier); `k` and
    `count` (`rltools eval --k/--problems`) override every set's."""
    specs = evals.sets or {HELD_OUT: EvalSetConfig()}
    rewards, own, sets = {reward.kind: task.reward}, [], []
    for name, spec in specs.items():
        kind = spec.reward or reward.kind
        if kind not in rewards:  # a set's own verifier: the one built-in type (custom: reward.function)
            rewards[kind] = make_reward(reward.model_copy(update={"type": kind, "functions": []}))
            own.append(rewards[kind])
        problems, available = _problems(name, spec, data, reward, task, count or spec.problems or evals.problems)
        sets.append(EvalSet(
            name, problems, available, k=1 if spec.greedy else k or spec.k or evals.k,
            temperature=0.0 if spec.greedy else _given(spec.temperature, generator.temperature),
            top_p=1.0 if spec.greedy else _given(spec.top_p, generator.top_p),
            max_tokens=spec.max_new_tokens or generator.max_new_tokens, reward=rewards[kind], reward_type=kind,
        ))
    return EvalSets(sets, own)


def _given(value, default):
    return default if value is None else value


def _problems(name: str, spec: EvalSetConfig, data: DataConfig, reward: RewardConfig, task,
              count: int | None) -> tuple[list[Problem], int]:
    if spec.path is None:
        if not hasattr(task, "eval"):  # generated: as many as asked
            problems = task.eval_problems(count or GENERATED_PROBLEMS)
            return problems, len(problems)
        problems = task.eval
    else:
        problems = set_problems(spec, data, reward, task.prompts.format)
        problems = task.prompts.fitting(problems, f"eval.sets.{name}.path {spec.path}")
    if count is not None and count < len(problems):
        log.warning("eval set %s: evaluating the first %d of its %d problems (eval.problems or eval.sets.%s.problems)",
                    name, count, len(problems), name)
        return problems[:count], len(problems)
    return problems, len(problems)


def set_problems(spec: EvalSetConfig, data: DataConfig, reward: RewardConfig, fmt) -> list[Problem]:
    """The problems of a set with a path of its own, read with its keys (default: data's) and rendered
    by `fmt` (None: as the rows give them); integer answers for an integer verifier (the set's, else the run's)."""
    keys = {"prompt_key": spec.prompt_key or data.prompt_key, "answer_key": spec.answer_key or data.answer_key}
    integer = spec.reward in INTEGER_TYPES if spec.reward else reward.integer_answers
    return load_problems(spec.path, data.model_copy(update=keys), fmt, integer)
