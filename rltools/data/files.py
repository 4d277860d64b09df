"""Problems from the files users keep: JSONL, Parquet, or a `datasets` directory (save_to_disk).

Invariants:
- `load_problems` returns the file's problems in file order (minus repeats with `data.dedupe`), each
  prompt rendered by the run's PromptFormat and every other column of the row carried along; it is a
  pure function of the file and its arguments.
- A column is named by a key, nested keys by dots (`reward_model.ground_truth`); a prompt is text or a
  list of chat messages.
- Bad input is a UserError naming the file and the line (JSONL) or row (Parquet, datasets) and the key:
  a missing file, an empty file, a line that is not UTF-8 or not a JSON object, a missing column, a
  prompt that is neither text nor messages, an answer that is not an integer where the reward needs
  one, a broken template, a Hub name where a file was expected (with the offline way to get it).
"""

import json
import logging
from pathlib import Path

from ..config.schema import DataConfig, path_kind
from ..errors import UserError
from ..reward.extract import integer_answer
from .arithmetic import Problem
from .prompts import PromptFormat

log = logging.getLogger("rltools.data")


def read_rows(path: str | Path, kind: str) -> list[tuple[str, dict]]:
    """(where, row) for every record of a jsonl or parquet file or a datasets directory; `where`
    names the line or row."""
    path = Path(path)
    if kind == "dataset" and not path.is_dir() or kind != "dataset" and not path.is_file():
        raise UserError(f"{path}: no such data {'directory' if kind == 'dataset' else 'file'}{_hub_hint(path)}")
    rows = {"parquet": _read_parquet, "dataset": _read_dataset}.get(kind, _read_jsonl)(path)
    if not rows:
        raise UserError(f"{path}: the data file holds no problems")
    return rows


def _hub_hint(path: Path) -> str:
    """A path that does not exist and reads like a Hub name (org/name): how to bring it here."""
    text = str(path)
    if text.count("/") != 1 or text.startswith((".", "/")) or path.suffix:
        return ""
    return (f"; if {text!r} is a Hugging Face Hub dataset: rltools reads data from the filesystem the job sees "
            "(compute nodes rarely reach the Hub). On a machine that does: python -c \"import datasets; "
            f"datasets.load_dataset('{text}', split='train').save_to_disk('DIR')\" (or download its parquet "
            "files), then point the data path at DIR")


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


def _read_dataset(path: Path) -> list[tuple[str, dict]]:
    try:
        import datasets
    except ImportError:
        raise UserError(f"{path}: a datasets directory needs the `datasets` package: pip install datasets") from None
    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as err:  # FileNotFoundError for a directory save_to_disk did not write, among others
        raise UserError(f"{path}: not a directory written by datasets' save_to_disk ({err})") from None
    if isinstance(dataset, datasets.DatasetDict):
        if len(dataset) != 1:
            raise UserError(f"{path}: a DatasetDict with splits {', '.join(dataset)}: point the data path at one "
                            f"split's directory, e.g. {path / next(iter(dataset))}")
        dataset = next(iter(dataset.values()))
    return [(f"{path} row {i}", row) for i, row in enumerate(dataset.to_list())]


def lookup(row: dict, key: str, where: str):
    """The value of column `key`; dots reach into nested columns (`reward_model.ground_truth`)."""
    if key in row:
        return row[key]
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            keys = ", ".join(map(str, value)) if isinstance(value, dict) else f"{type(value).__name__}, not a mapping"
            raise UserError(f"{where}: no key {key!r} ({part!r} missing among: {keys}); set data.prompt_key / "
                            "data.answer_key (nested keys with dots: reward_model.ground_truth)")
        value = value[part]
    return value


def problem_key(text) -> str:
    """What makes two problems the same for de-duplication: the text with whitespace normalised
    (messages: their JSON)."""
    return " ".join(text.split()) if isinstance(text, str) else json.dumps(text, sort_keys=True)


def load_problems(path: str | Path, data: DataConfig, fmt: PromptFormat | None, integer: bool) -> list[Problem]:
    """The problems of a file (`data`: the DataConfig's keys and dedupe); `integer` requires answers
    that are integers ("025" -> 25). `fmt` None: prompts as the rows give them (text or messages)."""
    problems, seen, dropped = [], set(), 0
    for where, row in read_rows(path, file_kind(path, data.type)):
        prompt, answer = lookup(row, data.prompt_key, where), lookup(row, data.answer_key, where)
        if not (isinstance(prompt, str) and prompt.strip() or isinstance(prompt, list)):
            raise UserError(f"{where}: {data.prompt_key!r} must be non-empty text or a list of chat messages, "
                            f"got {prompt!r:.80}")
        if integer:
            value = integer_answer(answer)
            if value is None:
                raise UserError(f"{where}: {data.answer_key!r} is {answer!r:.80}, not an integer (the reward type needs one)")
            answer = value
        elif answer is None:
            raise UserError(f"{where}: {data.answer_key!r} is empty")
        key = problem_key(prompt)
        if data.dedupe and key in seen:
            dropped += 1
            continue
        seen.add(key)
        columns = {k: v for k, v in row.items() if k != data.prompt_key}
        problems.append(Problem(prompt=fmt.render(prompt, where) if fmt else prompt, answer=answer, columns=columns,
                                source_prompt=prompt))
    if dropped:
        log.info("%s: dropped %d repeated problems (data.dedupe), %d left", path, dropped, len(problems))
    return problems


def file_kind(path, declared: str) -> str:
    """How a data path is read: by its suffix (.jsonl/.json, .parquet), a directory (no suffix) as
    datasets' save_to_disk writes it, otherwise as `data.type` declares."""
    return path_kind(str(path)) or declared
