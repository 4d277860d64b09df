"""The records a run writes for its users: metrics.jsonl (one JSON object per step) and eval/.
Read on the login side (`status`, `plot`, the progress display) and in the job (trainer rank 0
hands them to the experiment trackers: `rltools.tracking`).

Invariant: a record is read only when complete: a line cut by a crash, or still being written, is
skipped, never an error, so a reader works on a running, failed or finished run alike.
"""

import json
from pathlib import Path

from .config.schema import HELD_OUT
from .paths import RunPaths


def read_metrics(paths: RunPaths) -> list[dict]:
    """The complete, readable records of metrics.jsonl (a line cut by a crash is not one)."""
    try:
        text = paths.metrics.read_text(errors="replace")
    except FileNotFoundError:
        return []
    return parse_records(text[: text.rfind("\n") + 1])


def parse_records(text: str) -> list[dict]:
    """The step records among the lines of `text`; a line that is not one is skipped."""
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records


def read_json(path: Path) -> dict | None:
    """The JSON in `path`, or None while it is missing or not yet complete."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def set_results(result: dict) -> dict[str, dict]:
    """An eval result's summaries by set name, the headline first (a result written before eval sets
    existed is one summary: the held-out set's)."""
    return result["sets"] if "sets" in result else {HELD_OUT: result}


def headline(result: dict) -> tuple[str, dict]:
    """The first set's name and summary: the run's headline evaluation."""
    return next(iter(set_results(result).items()))


def read_evals(paths: RunPaths) -> dict[int, dict]:
    """Evaluation results by step, oldest first (`set_results` reads each)."""
    found = {step: read_json(paths.eval_result(step)) for step in sorted(eval_files(paths))}
    return {step: result for step, result in found.items() if result is not None}


def eval_files(paths: RunPaths) -> dict[int, int]:
    """Evaluation result files by step, with their modification times (a rewrite is a new result)."""
    found = {}
    for path in paths.eval_dir.glob("step_*.json") if paths.eval_dir.is_dir() else ():
        try:
            found[int(path.stem.split("_")[1])] = path.stat().st_mtime_ns
        except (ValueError, FileNotFoundError):
            continue
    return found
