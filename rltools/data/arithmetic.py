"""Arithmetic problems with integer answers: the task of the embedded CPU demo.

Format (fixed: the tiny model in rltools/assets/tiny-arith was pretrained on exactly this text):

    prompt      "What is 23+58?"    the question (Problem.prompt before rendering)
    model text  "What is 23+58?="   the question, then PROMPT_SUFFIX, the answer cue: the tiny models'
                                    chat template writes it as the assistant's turn, a raw format's
                                    default prompt_template appends it; the model answers right after it
    completion  "81" + EOS          the answer in canonical decimal: ASCII digits only, no sign,
                                    no leading zeros ("0" is the only answer that starts with "0")

Templates (data.type arithmetic), one picked uniformly per problem: a+b and a-b (a, b <= 99, b <= a for a-b), a*b
(a, b <= 12), a*b+c (1 <= a, b <= 9, c <= 20). Answers are 0..198; prompts at most 16 characters.
16,920 distinct questions; 1,633 held out (942 a+b, 517 a-b, 15 a*b, 159 a*b+c). Eval lists
are distinct, so the small a*b and a*b+c pools run dry and longer lists lean towards a+b and a-b,
the hardest for the tiny model: compare accuracies only across lists of the same length.

Invariants:
- Every answer is a non-negative integer.
- A question is in the eval split iff blake2b(question) % EVAL_BUCKETS == 0 (not Python's salted
  `hash`), so train and eval never share a question, for any seed, step or count.
- `problems` and `train_prompts` are pure functions of their arguments and return distinct
  problems: a restarted process regenerates exactly the same list.
- `reward` (reward.extract.exact_integer) never raises and costs microseconds, whatever the
  completion (it looks at no more than 18 characters after stripping whitespace).
"""

import hashlib
import random
from dataclasses import dataclass, field
from typing import Callable

from ..reward.extract import exact_integer as reward  # noqa: F401  (the demo's verifier: `rltools.data.arithmetic:reward`)

PROMPT_SUFFIX = "="
EVAL_BUCKETS = 10  # one question in ten is held out
MAX_MISSES = 20_000  # draws in a row that find no new problem of the split
SPLITS = ("train", "eval")


@dataclass(frozen=True)
class Problem:
    prompt: str
    """Exactly the text given to the model once rendered by the run's PromptFormat (`data.prompts`);
    an arithmetic problem before rendering: the question."""
    answer: int | str
    """The reference answer: an integer for arithmetic problems and the integer rewards (here the
    non-negative integer the completion must spell, in canonical decimal); text for math_verify and
    custom rewards on file datasets."""
    columns: dict = field(default_factory=dict, compare=False)
    """The row's other columns (file datasets), for rewards that read them."""
    source_prompt: str | list | None = field(default=None, compare=False)
    """The row's prompt as the file gives it, before rendering (text or messages), for rewards that
    read it (an arithmetic problem: its question); None: `prompt` is it."""
    prompt_ids: tuple[int, ...] | None = None
    """The prompt's tokens as the job tokenized the rendered text (`PromptFormat.tokenize`): what vLLM
    is given and the trainer trains on. None: vLLM tokenizes `prompt` itself."""


def _add(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"{a}+{b}", a + b


def _sub(rng: random.Random) -> tuple[str, int]:
    a = rng.randint(0, 99)
    b = rng.randint(0, a)  # keeps the answer non-negative
    return f"{a}-{b}", a - b


def _mul(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(0, 12), rng.randint(0, 12)
    return f"{a}*{b}", a * b


def _mul_add(rng: random.Random) -> tuple[str, int]:
    a, b, c = rng.randint(1, 9), rng.randint(1, 9), rng.randint(0, 20)
    return f"{a}*{b}+{c}", a * b + c


def _product(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"{a}*{b}", a * b


# Harder mixes (three operands, wider ranges) left the ~1M-parameter model far below 30% after
# minutes of pretraining; these four reach it in ~3 CPU minutes.
TEMPLATES: tuple[Callable[[random.Random], tuple[str, int]], ...] = (_add, _sub, _mul, _mul_add)
# data.type products: two-digit products (8,100 questions, ~810 held out), too hard for a tiny model
# to do in its head; the tool demo's model learns to call a calculator for them.
FAMILIES = {"arithmetic": TEMPLATES, "products": (_product,)}


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def split_of(question: str) -> str:
    """The split a question belongs to ("train" or "eval"); the same on every machine and run."""
    return "eval" if _digest(question) % EVAL_BUCKETS == 0 else "train"


def _draw(key: str, split: str, n: int, family: str = "arithmetic") -> list[Problem]:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(_digest(key))
    seen: dict[str, Problem] = {}
    misses = 0
    while len(seen) < n:
        expression, answer = rng.choice(FAMILIES[family])(rng)
        question = f"What is {expression}?"
        if question in seen or split_of(question) != split:
            misses += 1
            if misses > MAX_MISSES:  # the split's pool is (nearly) exhausted
                raise ValueError(f"could not draw {n} distinct {split} problems; ask for fewer")
            continue
        seen[question] = Problem(prompt=question, answer=answer, source_prompt=question)
        misses = 0
    return list(seen.values())


def problems(seed: int, split: str, n: int, family: str = "arithmetic") -> list[Problem]:
    """`n` distinct problems of `split` from `family` (a FAMILIES key), a pure function of its arguments.

    The first k of problems(s, split, n) are problems(s, split, k): a longer list extends a
    shorter one. Raises ValueError when the split holds fewer than `n` questions.
    """
    return _draw(f"problems/{seed}/{split}", split, n, family)


def train_prompts(seed: int, epoch: int, step: int, count: int, family: str = "arithmetic") -> list[Problem]:
    """Step `step`'s `count` distinct training problems, a pure function of (seed, epoch, step, family)."""
    return _draw(f"train_prompts/{seed}/{epoch}/{step}", "train", count, family)


def model_text(problem: Problem) -> str:
    """The text the tiny models read for an arithmetic problem before rendering: question + PROMPT_SUFFIX."""
    return problem.prompt + PROMPT_SUFFIX


def format_answer(answer: int) -> str:
    """The completion text (before EOS) that earns reward 1.0: canonical decimal."""
    if answer < 0:
        raise ValueError(f"answers are non-negative, got {answer}")
    return str(answer)
