"""Answer extraction for math completions (integer answers AIME-style; the boxed text for math_verify):
pure string functions, no imports beyond `re`.

Invariants:
- Every function here never raises and costs microseconds whatever its input: the completion is
  cut to its last TAIL_CHARS characters first (the final answer is at the end), brace matching is
  one linear scan, and a candidate longer than MAX_INTEGER_CHARS is not an answer.
- An answer counts only if its text is an integer after removing presentation: `$`, `\\text{..}`
  (and \\textbf, \\mathrm, \\mathbf), surrounding spaces, a trailing period, leading zeros
  ("025" -> 25). "12.5", "1/2", "1 2", "x=3", "10^{100}" are not integers and score 0.
- An `Answer:` line may also wrap its whole value in a few layers of markdown (`**`, backticks),
  math delimiters (`$..$`, `\\(..\\)`, `\\[..\\]`) and `\\boxed{..}`, as peer RL frameworks accept;
  layers are peeled only from the ends, so what is left must still be a whole integer
  (`Answer: \\boxed{60} or 61` and `Answer: **4**5` score 0).
"""

import re

TAIL_CHARS = 4096
MAX_INTEGER_CHARS = 24  # 999 needs 3; a longer "number" is garbage, not an answer
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_WRAPPER = re.compile(r"\\(?:text|textbf|mathrm|mathbf)\s*\{([^{}]*)\}")
_BRACE = re.compile(r"[{}]")
_INTEGER = re.compile(r"[+-]?[0-9]+")  # ASCII digits only: int() would accept "８１" too
_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]*)", re.IGNORECASE)
_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
_MARKDOWN = "*`"  # bold or code around the label or the value: **Answer:** 45, **Answer: 45**, Answer: `45`
MAX_ANSWER_CHARS = 18  # the longest canonical answer exact_integer reads
_CANONICAL = re.compile(r"0|[1-9][0-9]*")  # [0-9], not \d: int() would accept "８１" too
_MAX_LAYERS = 8  # `**Answer:** $\boxed{45}$.` has three; the bound keeps a hostile line linear


def last_boxed(text: str) -> str | None:
    """Content of the last balanced \\boxed{...} in the tail of `text` (nested braces kept), else None.

    An unclosed last box (a truncated completion) falls back to the previous complete one.
    """
    if not isinstance(text, str):
        return None
    tail = text[-TAIL_CHARS:]
    starts = [m.end() for m in _BOXED.finditer(tail)]
    if not starts:
        return None
    closing = _matching_braces(tail)
    for start in reversed(starts):
        end = closing.get(start - 1)
        if end is not None:
            return tail[start:end]
    return None


def _matching_braces(text: str) -> dict[int, int]:
    """Position of each balanced `{` -> position of its `}`; one pass over the braces only."""
    open_at: list[int] = []
    closing = {}
    for match in _BRACE.finditer(text):
        if match.group() == "{":
            open_at.append(match.start())
        elif open_at:
            closing[open_at.pop()] = match.start()
    return closing


def answer_line(text: str) -> str | None:
    """What follows the last `Answer:` (DAPO style, case-insensitive) up to the end of its line,
    with the markup wrapped around all of it removed (see _unwrap)."""
    if not isinstance(text, str):
        return None
    matches = _ANSWER_LINE.findall(text[-TAIL_CHARS:])
    return _unwrap(matches[-1]) if matches else None


def _unwrap(value: str) -> str:
    """`value` without the layers wrapped around all of it: spaces and a trailing period, markdown
    `*` and backticks, a pair of math delimiters, a balanced \\boxed{..} spanning all of it; at
    most _MAX_LAYERS rounds.

    Only the ends are touched, so "\\boxed{6}0" and "**4**5" keep their inner markup and are not integers.
    """
    for _ in range(_MAX_LAYERS):
        peeled = value.strip().removesuffix(".").strip().strip(_MARKDOWN).strip()
        for left, right in _DELIMITERS:
            if len(peeled) >= len(left) + len(right) and peeled.startswith(left) and peeled.endswith(right):
                peeled = peeled[len(left):-len(right)]
                break
        box = _BOXED.match(peeled)
        if box and _matching_braces(peeled).get(box.end() - 1) == len(peeled) - 1:  # the box spans it all
            peeled = peeled[box.end():-1]
        if peeled == value:
            return value
        value = peeled
    return value


def parse_integer(candidate: str | None) -> int | None:
    """The integer `candidate` spells once presentation is removed, else None."""
    if candidate is None:
        return None
    text = candidate[:256]
    for _ in range(3):  # \text{\textbf{7}} and the like
        text = _WRAPPER.sub(r"\1", text)
    text = text.replace("$", "").replace("\\!", "").strip()
    text = text.removesuffix(".").strip().removeprefix("{").removesuffix("}").strip()
    if len(text) > MAX_INTEGER_CHARS or not _INTEGER.fullmatch(text):
        return None
    return int(text)


def integer_answer(answer) -> int | None:
    """A reference answer as an integer ("025" -> 25, 25 -> 25, 25.0 -> 25), else None."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, int):
        return answer
    if isinstance(answer, float):
        return int(answer) if answer.is_integer() else None
    return parse_integer(str(answer)) if isinstance(answer, str) else None


def exact_integer(completion_text: str, answer: int) -> float:
    """1.0 iff the completion, stripped of surrounding whitespace, is `answer` in canonical decimal.

    "81", " 81\\n" -> 1.0; "081", "+81", "81.0", "8 1", "81 is it" -> 0.0. Leading zeros are
    rejected: the model is trained to write canonical answers, and accepting "081" would reward a
    format no evaluator downstream expects. Never raises (non-strings score 0.0).
    """
    value = canonical_integer(completion_text)
    return 1.0 if value is not None and value == answer else 0.0


def canonical_integer(completion_text: str) -> int | None:
    """The integer the whole completion spells in canonical decimal (what exact_integer compares), else None."""
    if not isinstance(completion_text, str):
        return None
    text = completion_text.strip()
    if len(text) > MAX_ANSWER_CHARS or not _CANONICAL.fullmatch(text):
        return None
    return int(text)


def boxed_text(text: str) -> str | None:
    """The last balanced \\boxed{...}'s content with runs of whitespace made one space, else None
    (an empty box too): math_verify's final answer as a string, for voting."""
    content = last_boxed(text)
    normalised = " ".join(content.split()) if content is not None else ""
    return normalised or None
