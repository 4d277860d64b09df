"""Problems from files: JSONL (one JSON object a line) or Parquet, with configurable columns.

Invariants:
- `load_problems` returns the file's problems in file order (minus repeats with `dedupe`), each
  prompt rendered with the template; it is a pure function of the file and its arguments.
- Bad input is a UserError naming the file and the line (JSONL) or row (Parquet) and the key:
  a missing file, an empty file, a line that is not UTF-8 or not a JSON object, a missing column, a non-text
  problem, an answer that is not an integer where the reward needs one, a broken template.
"""

import json
import logging
from pathlib import Path

from ..errors import UserError
from ..reward.extract import integer_answer
from .arithmetic import Problem

log = logging.getLogger("rltools.data")


def read_rows(path: str | Path, kind: str) -> list[tuple[str, dict]]:
    """(where, row) for every record of a jsonl or parquet file; `where` names the line or row."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such data file")
    rows = _read_parquet(path) if kind == "parquet" else _read_jsonl(path)
    if not rows:
        raise UserError(f"{path}: the data file holds no problems")
    return rows


def _read_jsonl(path: Path) -> list[tuple[str, dict]]:
    rows = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise UserError(f"{path}:{number}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column {err.start + 1}); "
                                "save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{path}:{number}: not valid JSON ({err.msg} at column {err.colno})") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}:{number}: expected a JSON object per line, got {type(row).__name__}")
            rows.append((f"{path}:{number}", row))
    return rows


def _read_parquet(path: Path) -> list[tuple[str, dict]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for non-parquet bytes
        raise UserError(f"{path}: not a readable Parquet file ({err})") from None
    return [(f"{path} row {i}", row) for i, row in enumerate(table.to_pylist())]


def render_prompt(template: str, text: str) -> str:
    try:
        return template.format(prompt=text)
    except (KeyError, IndexError, ValueError) as err:
        raise UserError(
            f"data.prompt_template {template!r} cannot be filled ({type(err).__name__}: {err}); it may use only "
            "{prompt}, and literal braces are written doubled: \\boxed{{}}"
        ) from None


def problem_key(text: str) -> str:
    """What makes two problems the same for de-duplication: the text with whitespace normalised."""
    return " ".join(text.split())


def load_problems(
    path: str | Path, kind: str, prompt_key: str, answer_key: str, template: str, dedupe: bool, integer: bool
) -> list[Problem]:
    """The problems of a file; `integer` requires answers that are integers ("025" -> 25)."""
    problems, seen, dropped = [], set(), 0
    for where, row in read_rows(path, kind):
        for key in (prompt_key, answer_key):
            if key not in row:
                raise UserError(f"{where}: no key {key!r} (keys: {', '.join(map(str, row))}); set data.prompt_key / data.answer_key")
        text, answer = row[prompt_key], row[answer_key]
        if not isinstance(text, str) or not text.strip():
            raise UserError(f"{where}: {prompt_key!r} must be non-empty text, got {text!r:.80}")
        if integer:
            value = integer_answer(answer)
            if value is None:
                raise UserError(f"{where}: {answer_key!r} is {answer!r:.80}, not an integer (the reward type needs one)")
            answer = value
        elif answer is None:
            raise UserError(f"{where}: {answer_key!r} is empty")
        key = problem_key(text)
        if dedupe and key in seen:
            dropped += 1
            continue
        seen.add(key)
        problems.append(Problem(prompt=render_prompt(template, text), answer=answer))
    if dropped:
        log.info("%s: dropped %d repeated problems (data.dedupe), %d left", path, dropped, len(problems))
    return problems
