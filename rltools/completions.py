"""The completions a run keeps for people to read: a sample of each trained step's rollouts and the
completions of every evaluation. Rewards and accuracies say how much; these files say what the
policy wrote (reward hacking, a verifier that misreads answers, truncation) — `rltools samples`.

Files (paths: `RunPaths`), JSON lines of plain data:
- `samples/step_<k>.jsonl`: one line per completion of step k (0-based: metrics.jsonl's step), whole
  groups, written by trainer rank 0 (`train.samples`, which decides the fields).
- `eval/samples/step_<k>/<set>.jsonl`: one line per problem of the evaluation after k steps, its k
  completions inside, written by the generator that evaluated (`generate.evaluation`, which decides
  the fields); `eval/adhoc/step_<k>/` the same for the last `rltools eval` of that policy.

Invariants:
- Read with the standard library alone: the login side reads them (no numpy, no torch).
- A reader sees a whole file or none: a step's samples file is written atomically, an evaluation's
  directory under a temporary name and renamed whole (`durable`).
- A resume drops what the steps its checkpoint lacks wrote (`drop_after`), as it drops their metrics:
  no step's completions are kept twice, none from a policy that was trained again.
"""

import json
import shutil
from pathlib import Path

from .durable import atomic_write, publish_dir
from .paths import RunPaths


def rows_text(rows: list[dict]) -> str:
    return "".join(json.dumps(row, default=_plain) + "\n" for row in rows)


def _plain(value):
    """A numpy scalar (a dataset's answer column) as its Python value; anything else as text."""
    return value.item() if hasattr(value, "item") else str(value)


def write_step_samples(paths: RunPaths, step: int, rows: list[dict]) -> None:
    """Step `step`'s sample (one dict per completion) to samples/step_<step>.jsonl, atomically."""
    paths.samples_dir.mkdir(exist_ok=True)
    atomic_write(paths.step_samples(step), rows_text(rows))


def write_eval_completions(directory: Path, by_set: dict[str, list[dict]]) -> None:
    """One evaluation's completions, a `<set>.jsonl` of problem rows per set, as the directory
    `directory` (replacing an older one) whole."""
    tmp = directory.with_name(f".{directory.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a crashed writer's
    tmp.mkdir(parents=True)
    for name, rows in by_set.items():
        atomic_write(tmp / f"{name}.jsonl", rows_text(rows))
    publish_dir(tmp, directory)


def read_rows(path: Path) -> list[dict]:
    """The JSON objects of a completions file, in order."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [row for row in rows if isinstance(row, dict)]


def eval_set_names(directory: Path) -> list[str]:
    """The eval sets an evaluation's completions directory holds, by name."""
    return sorted(p.stem for p in directory.glob("*.jsonl")) if directory.is_dir() else []


def drop_after(paths: RunPaths, steps_done: int) -> None:
    """A resume from the checkpoint after `steps_done` steps: delete the samples of the steps it trains
    again (step >= steps_done) and the completions of the evaluations of later policies, its own and
    `rltools eval`'s (step > steps_done), whose exports are deleted too."""
    for step, path in paths.sample_steps().items():
        if step >= steps_done:
            path.unlink()
    for debris in paths.samples_dir.glob(".step_*.tmp") if paths.samples_dir.is_dir() else ():
        debris.unlink(missing_ok=True)  # a killed writer's (`durable.atomic_path`)
    for adhoc in (False, True):
        root = paths.eval_samples_root(adhoc)
        for step, directory in paths.eval_sample_steps(adhoc).items():
            if step > steps_done:
                shutil.rmtree(directory)
        for debris in root.glob(".step_*.tmp") if root.is_dir() else ():
            shutil.rmtree(debris, ignore_errors=True)
