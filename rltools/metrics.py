"""Run metrics: metrics.jsonl (one line per trained step) and TensorBoard event files under tb/.

Invariant: metrics.jsonl is the record (status, plot and tests read it); TensorBoard gets the same
numbers for people who watch runs there (`tensorboard --logdir RUN_DIR/tb`). Trainer rank 0 writes
the training metrics, generator rank 0 the evaluations, each to its own event file in tb/.
"""

import json

from .durable import append_line, atomic_write
from .paths import RunPaths

_writers: dict[str, object] = {}


def resume_metrics(paths: RunPaths, steps_done: int) -> None:
    """A resume from the checkpoint after `steps_done` steps: forget what later steps recorded, so
    each step appears exactly once in metrics.jsonl (and TensorBoard) across restarts."""
    _keep_lines(paths.metrics, lambda record: record["step"] < steps_done)  # step = the step trained
    _keep_lines(paths.eval_log, lambda record: record["step"] <= steps_done)  # step = steps done
    for step in [s for s in _eval_steps(paths) if s > steps_done]:
        paths.eval_result(step).unlink()
    _writer(paths, purge_step=steps_done + 1)


def _keep_lines(path, keep) -> None:
    """Rewrite a JSON-lines file with the complete lines `keep` accepts (a cut last line goes)."""
    if not path.exists():
        return
    lines = [line for line in path.read_text(errors="replace").splitlines(keepends=True) if line.endswith("\n")]
    atomic_write(path, "".join(line for line in lines if _parses(line) and keep(json.loads(line))))


def _parses(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:  # a line a crash left half-written and a later append completed
        return False


def _eval_steps(paths: RunPaths) -> list[int]:
    return [int(p.stem.split("_")[1]) for p in paths.eval_dir.glob("step_*.json")] if paths.eval_dir.is_dir() else []


def append_metrics(paths: RunPaths, metrics: dict) -> None:
    """One step's metrics (`metrics["step"]` 0-based) to metrics.jsonl and TensorBoard."""
    append_line(paths.metrics, json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in metrics.items()}))
    scalars = {k: v for k, v in metrics.items() if k not in ("step", "time")}
    write_scalars(paths, metrics["step"] + 1, scalars, prefix="train")


def write_scalars(paths: RunPaths, steps_done: int, scalars: dict, prefix: str) -> None:
    """Numeric entries of `scalars` as TensorBoard scalars `prefix/name` at `steps_done`."""
    writer = _writer(paths)
    for name, value in scalars.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            writer.add_scalar(f"{prefix}/{name}", value, steps_done)
    writer.flush()


def _writer(paths: RunPaths, purge_step: int | None = None):
    """This process's event-file writer; `purge_step` hides older events at or after that step."""
    key = str(paths.tensorboard)
    if key not in _writers:
        from tensorboardX import SummaryWriter

        _writers[key] = SummaryWriter(logdir=key, purge_step=purge_step)
    return _writers[key]
