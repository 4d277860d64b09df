"""Build a math evaluation file (JSONL, one problem a line) from the public copies of AIME 2024/2025, MATH-500, GSM8K.

    python scripts/prepare_math.py --set aime_2024 --out data/aime_2024.jsonl         # online: HF datasets
    python scripts/prepare_math.py --set aime_2025 --source aime2025-I.jsonl aime2025-II.jsonl --out data/aime_2025.jsonl
    python scripts/prepare_math.py --set math500 --source test.jsonl --out data/math500.jsonl
    python scripts/prepare_math.py --set gsm8k --source test-00000-of-00001.parquet --out data/gsm8k.jsonl

A source is a local .jsonl / .parquet / .csv file, a directory written by `save_to_disk`, or otherwise
anything `datasets.load_dataset` accepts (a Hub name, a local directory of data files); without
--source the set's Hub copy is loaded (SETS). Several sources are concatenated (AIME 2025 I and II).

Invariants:
- Every output row has `problem` (the text, stripped) and `answer`: an integer for AIME (0..999 unless
  --any-integer) and GSM8K (the number after the last '####', commas removed; the worked answer is
  kept as `solution`), the answer text as written (stripped) for MATH-500, which math_verify compares.
- Columns are found case-insensitively (problem or question; answer) unless --problem-key /
  --answer-key name them; the EXTRA_COLUMNS are kept under lower-case names, the others are dropped,
  and both are printed for each source.
- A row that does not fit its set is a UserError naming the file and line (or row) and the column;
  nothing is written then. The output is written to a temporary file, then renamed.
- Repeated problems (same text, whitespace normalised) are dropped and counted (one public AIME copy
  repeats its 30 problems 32 times); a count other than the set's size is warned about.
"""

import argparse
import csv
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rltools.data.files import problem_key, read_rows  # noqa: E402
from rltools.errors import UserError  # noqa: E402
from rltools.reward.extract import integer_answer  # noqa: E402

PROBLEM_COLUMNS = ("problem", "question")
ANSWER_COLUMNS = ("answer",)
EXTRA_COLUMNS = ("id", "unique_id", "subject", "level", "solution", "year", "url")


def aime_answer(raw) -> int | None:
    value = integer_answer(raw)
    return value if value is not None and 0 <= value <= 999 else None


def gsm8k_answer(raw) -> int | None:
    """The integer after the last '####' of a worked answer ("... #### 1,234" -> 1234); a prepared
    file's integer as it is."""
    if isinstance(raw, str):
        return integer_answer(raw.rsplit("####", 1)[1].replace(",", "")) if "####" in raw else None
    return integer_answer(raw)


def math_answer(raw) -> str | None:
    """A MATH answer as written (LaTeX: "\\frac{14}{3}", "(3, \\frac{\\pi}{2})"), stripped."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        return str(raw)
    return raw.strip() if isinstance(raw, str) and raw.strip() else None


@dataclass(frozen=True)
class EvalSet:
    title: str
    source: str
    """The Hub copy loaded without --source."""
    split: str
    subset: str | None
    """The Hub copy's configuration name (load_dataset's `name`)."""
    size: int | None
    """Problems in the real set; another count is warned about."""
    parse: Callable[[object], int | str | None]
    """The answer in a raw answer cell, None if the cell does not hold one."""
    shape: str
    """What a valid answer cell is, for the error."""
    answer_text_as: str | None = None
    """Also keep the raw answer text under this column (GSM8K's worked solution)."""


AIME_SHAPE = "an AIME answer (an integer 0..999)"
SETS = {
    "aime_2024": EvalSet("AIME 2024", "HuggingFaceH4/aime_2024", "train", None, 30, aime_answer, AIME_SHAPE),
    "aime_2025": EvalSet("AIME 2025", "yentinglin/aime_2025", "train", None, 30, aime_answer, AIME_SHAPE),
    "math500": EvalSet("MATH-500", "HuggingFaceH4/MATH-500", "test", None, 500, math_answer,
                       "a MATH-500 answer (non-empty LaTeX text)"),
    "gsm8k": EvalSet("GSM8K", "openai/gsm8k", "test", "main", 1319, gsm8k_answer,
                     "a GSM8K answer (a worked solution ending in '#### N', N an integer)", answer_text_as="solution"),
}


@dataclass(frozen=True)
class Columns:
    problem: str
    answer: str
    extras: dict[str, str]
    """Output name -> source column."""
    dropped: list[str]


def source_rows(source: str, split: str, subset: str | None) -> list[tuple[str, dict]]:
    """(where, row) for every row of a local file, else of a datasets source."""
    path = Path(source)
    if path.is_file():
        if path.suffix == ".csv":
            with open(path, newline="", encoding="utf-8") as f:
                return [(f"{path}:{i + 2}", row) for i, row in enumerate(csv.DictReader(f))]
        return read_rows(path, "parquet" if path.suffix == ".parquet" else "jsonl")
    try:
        import datasets
    except ImportError:
        raise UserError(f"{source} is not a local file, and the `datasets` package is missing: pip install datasets") from None
    try:
        if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():  # save_to_disk
            dataset = datasets.load_from_disk(str(path))
            dataset = dataset[split] if isinstance(dataset, datasets.DatasetDict) else dataset
        else:
            dataset = datasets.load_dataset(source, subset, split=split)
    except Exception as err:  # offline, unknown name, bad split: datasets raises many types
        raise UserError(f"cannot load {source!r} (split {split!r}) with datasets: {err!r:.300}; offline, pass a local "
                        "copy of its files with --source") from None
    rows = [(f"{source}[{split}] row {i}", row) for i, row in enumerate(dataset.to_list())]
    if not rows:
        raise UserError(f"{source!r} (split {split!r}) holds no rows")
    return rows


def find_key(row: dict, wanted: str | None, candidates: tuple[str, ...], where: str) -> str:
    if wanted is not None:
        if wanted not in row:
            raise UserError(f"{where}: no column {wanted!r} (columns: {', '.join(map(str, row))})")
        return wanted
    lowered = {str(k).lower(): k for k in row}
    for candidate in candidates:
        if candidate in lowered:
            return lowered[candidate]
    raise UserError(f"{where}: none of the columns {', '.join(map(str, row))} looks like {candidates[0]}; "
                    "name it with a --*-key flag")


def find_columns(row: dict, where: str, problem_col: str | None, answer_col: str | None) -> Columns:
    problem = find_key(row, problem_col, PROBLEM_COLUMNS, where)
    answer = find_key(row, answer_col, ANSWER_COLUMNS, where)
    extras, dropped = {}, []
    for key in row:
        if key in (problem, answer):
            continue
        name = str(key).lower()
        if name in EXTRA_COLUMNS and name not in extras:
            extras[name] = key
        else:
            dropped.append(str(key))
    return Columns(problem, answer, extras, dropped)


def to_record(where: str, row: dict, columns: Columns, spec: EvalSet) -> dict:
    text, raw = row.get(columns.problem), row.get(columns.answer)
    if not isinstance(text, str) or not text.strip():
        raise UserError(f"{where}: column {columns.problem!r} is {text!r:.80}, not a problem's text")
    answer = spec.parse(raw)
    if answer is None:
        raise UserError(f"{where}: answer {raw!r:.80} is not {spec.shape} (column {columns.answer!r})")
    record = {"problem": text.strip(), "answer": answer}
    record.update({name: row[key] for name, key in columns.extras.items() if row.get(key) is not None})
    if spec.answer_text_as is not None and isinstance(raw, str):
        record.setdefault(spec.answer_text_as, raw.strip())
    return record


def describe(label: str, rows: int, columns: Columns, spec: EvalSet) -> str:
    kept = [f"{name} <- {key!r}" for name, key in columns.extras.items()]
    if spec.answer_text_as is not None and spec.answer_text_as not in columns.extras:
        kept.append(f"{spec.answer_text_as} <- {columns.answer!r} (the worked answer)")
    return (f"{label}: {rows} rows; problem <- {columns.problem!r}, answer <- {columns.answer!r}; "
            f"kept {', '.join(kept) or 'no other column'}; dropped {', '.join(columns.dropped) or 'no column'}")


def prepare(sources: list[tuple[str, list[tuple[str, dict]]]], spec: EvalSet, problem_col: str | None = None,
            answer_col: str | None = None) -> tuple[list[dict], int, list[str]]:
    """(the set's records in source order, number of repeats dropped, a line about each source's columns)."""
    out, seen, repeats, notes = [], set(), 0, []
    for label, rows in sources:
        first_where, first = rows[0]
        columns = find_columns(first, first_where, problem_col, answer_col)
        notes.append(describe(label, len(rows), columns, spec))
        for where, row in rows:
            record = to_record(where, row, columns, spec)
            key = problem_key(record["problem"])
            if key in seen:
                repeats += 1
                continue
            seen.add(key)
            out.append(record)
    return out, repeats, notes


def parse_args(argv: list[str] | None, fixed_set: str | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    if fixed_set is None:
        parser.add_argument("--set", required=True, choices=sorted(SETS), help="which evaluation set")
    else:
        parser.set_defaults(set=fixed_set)
    parser.add_argument("--source", nargs="+", help="local files or a datasets name (default: the set's Hub copy)")
    parser.add_argument("--split", help="split of a datasets source (default: the set's, train or test)")
    parser.add_argument("--subset", help="configuration of a datasets source (default: main for the Hub's gsm8k)")
    parser.add_argument("--out", type=Path, required=True, help="output JSONL")
    parser.add_argument("--problem-key", help="column of the problem text (default: problem or question)")
    parser.add_argument("--answer-key", help="column of the answer (default: answer)")
    parser.add_argument("--any-integer", action="store_true", help="AIME sets: accept integers outside 0..999")
    return parser.parse_args(argv)


def load_sources(args: argparse.Namespace, spec: EvalSet) -> list[tuple[str, list[tuple[str, dict]]]]:
    split = args.split or spec.split
    sources = args.source or [spec.source]
    # the default subset belongs to the set's own Hub copy; another copy may not have it
    return [(s, source_rows(s, split, args.subset or (spec.subset if s == spec.source else None))) for s in sources]


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    tmp.replace(path)


def main(argv: list[str] | None = None, fixed_set: str | None = None) -> int:
    """The command line; `fixed_set` serves a script for one set (prepare_aime.py), without --set."""
    args = parse_args(argv, fixed_set)
    spec = SETS[args.set]
    try:
        if args.any_integer:
            if spec.parse is not aime_answer:
                raise UserError(f"--any-integer is for the AIME sets; {args.set}'s answers are {spec.shape}")
            spec = replace(spec, parse=integer_answer, shape="an integer", size=None)
        problems, repeats, notes = prepare(load_sources(args, spec), spec, args.problem_key, args.answer_key)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n".join(notes))
    write_jsonl(args.out, problems)
    print(f"wrote {len(problems)} problems to {args.out} ({repeats} repeats dropped)")
    if spec.size is not None and len(problems) != spec.size:
        print(f"warning: {spec.title} has {spec.size} problems; the source gave {len(problems)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
