"""Build the AIME 2024 evaluation file (JSONL: {"problem": ..., "answer": <int>, "id": ...}) for configs/aime.yaml.

    python scripts/prepare_aime.py --out data/aime_2024.jsonl                          # online: HF datasets
    python scripts/prepare_aime.py --source HuggingFaceH4/aime_2024 --split train --out ...
    python scripts/prepare_aime.py --source my_copy.parquet --out data/aime_2024.jsonl # offline: a local file

The source is a local .jsonl / .parquet / .csv file, or otherwise anything `datasets.load_dataset`
accepts (a Hub name, a local directory of data files). Columns are found case-insensitively
(problem or question; answer) unless --problem-key / --answer-key name them. Answers are normalised
to integers ("025" -> 25) and must lie in 0..999 (--any-integer lifts that); repeated problems are
dropped (one public copy repeats the 30 problems 32 times). Prints what it kept and dropped.
"""

import argparse
import csv
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rltools.data.files import problem_key, read_rows  # noqa: E402
from rltools.errors import UserError  # noqa: E402
from rltools.reward.extract import integer_answer  # noqa: E402

DEFAULT_SOURCE = "HuggingFaceH4/aime_2024"
AIME_PROBLEMS = 30


def source_rows(source: str, split: str) -> list[tuple[str, dict]]:
    path = Path(source)
    if path.is_file():
        if path.suffix == ".csv":
            with open(path, newline="", encoding="utf-8") as f:
                return [(f"{path}:{i + 2}", row) for i, row in enumerate(csv.DictReader(f))]
        return read_rows(path, "parquet" if path.suffix == ".parquet" else "jsonl")
    try:
        from datasets import load_dataset
    except ImportError:
        raise UserError(f"{source} is not a local file, and the `datasets` package is missing: pip install datasets") from None
    try:
        dataset = load_dataset(source, split=split)
    except Exception as err:  # offline, unknown name, bad split: datasets raises many types
        raise UserError(f"cannot load {source!r} (split {split!r}) with datasets: {err}; offline, pass a local file") from None
    return [(f"{source}[{split}] row {i}", row) for i, row in enumerate(dataset.to_list())]


def find_key(row: dict, wanted: str | None, candidates: tuple[str, ...], where: str) -> str:
    if wanted is not None:
        if wanted not in row:
            raise UserError(f"{where}: no column {wanted!r} (columns: {', '.join(row)})")
        return wanted
    lowered = {str(k).lower(): k for k in row}
    for candidate in candidates:
        if candidate in lowered:
            return lowered[candidate]
    raise UserError(f"{where}: none of the columns {', '.join(row)} looks like {candidates[0]}; name it with a --*-key flag")


def prepare(rows: list[tuple[str, dict]], problem_col: str | None, answer_col: str | None, any_integer: bool) -> tuple[list[dict], int]:
    """(normalised problems, number of repeats dropped)."""
    out, seen, dropped = [], set(), 0
    first_where, first = rows[0]
    problem_col = find_key(first, problem_col, ("problem", "question"), first_where)
    answer_col = find_key(first, answer_col, ("answer",), first_where)
    id_col = next((k for k in first if str(k).lower() == "id"), None)
    for where, row in rows:
        text, answer = row.get(problem_col), integer_answer(row.get(answer_col))
        if not isinstance(text, str) or not text.strip():
            raise UserError(f"{where}: {problem_col!r} is empty")
        if answer is None or not (any_integer or 0 <= answer <= 999):
            raise UserError(f"{where}: answer {row.get(answer_col)!r} is not an AIME answer (an integer 0..999)")
        if problem_key(text) in seen:
            dropped += 1
            continue
        seen.add(problem_key(text))
        record = {"problem": text.strip(), "answer": answer}
        if id_col is not None and row.get(id_col) is not None:
            record["id"] = row[id_col]
        out.append(record)
    return out, dropped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=DEFAULT_SOURCE, help=f"local file or datasets name (default {DEFAULT_SOURCE})")
    parser.add_argument("--split", default="train", help="split of a datasets source (default train)")
    parser.add_argument("--out", type=Path, required=True, help="output JSONL")
    parser.add_argument("--problem-key", help="column of the problem text (default: problem or question)")
    parser.add_argument("--answer-key", help="column of the answer (default: answer)")
    parser.add_argument("--any-integer", action="store_true", help="accept integers outside 0..999 (non-AIME sets)")
    args = parser.parse_args(argv)
    try:
        problems, dropped = prepare(source_rows(args.source, args.split), args.problem_key, args.answer_key, args.any_integer)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in problems))
    tmp.replace(args.out)
    print(f"wrote {len(problems)} problems to {args.out} ({dropped} repeats dropped)")
    if len(problems) != AIME_PROBLEMS and not args.any_integer:
        print(f"warning: AIME 2024 has {AIME_PROBLEMS} problems; this source gave {len(problems)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
