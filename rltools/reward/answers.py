"""The final answer a completion commits to, per built-in `reward.type`: the votes of maj@k.

Invariants:
- `extract_answer` never raises and costs microseconds whatever the completion (the helpers of
  extract.py read only its tail); an unknown type or a completion without an answer gives None.
- For the integer rewards the answer is the integer the reward compares with the reference, so a
  sample's vote and its score agree: `exact_integer` the whole completion in canonical decimal,
  `boxed_integer` the last \\boxed{..}, `answer_line` the last `Answer:` line.
- For `math_verify` it is the last \\boxed{..}'s content with whitespace normalised, a string: votes
  match by text, not by mathematical equivalence, so `\\frac{1}{2}` and `0.5` split the vote.
- `custom` rewards have no extractor (`answer_extractor` gives None): maj@k is not reported for them.
"""

from typing import Callable

from .extract import answer_line, boxed_text, canonical_integer, last_boxed, parse_integer


def boxed_integer_answer(completion: str) -> int | None:
    """The integer the last balanced \\boxed{...} of the completion's tail spells."""
    return parse_integer(last_boxed(completion))


def answer_line_answer(completion: str) -> int | None:
    """The integer the last 'Answer: N' line (DAPO style) spells."""
    return parse_integer(answer_line(completion))


EXTRACTORS: dict[str, Callable[[str], int | str | None]] = {
    "exact_integer": canonical_integer,
    "boxed_integer": boxed_integer_answer,
    "answer_line": answer_line_answer,
    "math_verify": boxed_text,
}


def answer_extractor(reward_type: str) -> Callable[[str], int | str | None] | None:
    """The extractor of `reward_type`, None where maj@k is not reported (custom rewards)."""
    return EXTRACTORS.get(reward_type)


def extract_answer(reward_type: str, completion: str) -> int | str | None:
    """The final answer `completion` gives under `reward_type`, None if it gives none."""
    extractor = EXTRACTORS.get(reward_type)
    return extractor(completion) if extractor is not None else None
