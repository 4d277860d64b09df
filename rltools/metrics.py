"""Run metrics: metrics.jsonl (one line per trained step) and TensorBoard event files under tb/.

Invariant: metrics.jsonl is the record (status, plot and tests read it); TensorBoard gets the same
numbers for people who watch runs there (`tensorboard --logdir RUN_DIR/tb`). Trainer rank 0 writes
the training metrics, generator rank 0 the evaluations, each to its own event file in tb/.
"""

import json

from .paths import RunPaths

_writers: dict[str, object] = {}


def append_metrics(paths: RunPaths, metrics: dict) -> None:
    """One step's metrics (`metrics["step"]` 0-based) to metrics.jsonl and TensorBoard."""
    with open(paths.metrics, "a") as f:
        f.write(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in metrics.items()}) + "\n")
    scalars = {k: v for k, v in metrics.items() if k not in ("step", "time")}
    write_scalars(paths, metrics["step"] + 1, scalars, prefix="train")


def write_scalars(paths: RunPaths, steps_done: int, scalars: dict, prefix: str) -> None:
    """Numeric entries of `scalars` as TensorBoard scalars `prefix/name` at `steps_done`."""
    writer = _writer(paths)
    for name, value in scalars.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            writer.add_scalar(f"{prefix}/{name}", value, steps_done)
    writer.flush()


def _writer(paths: RunPaths):
    key = str(paths.tensorboard)
    if key not in _writers:
        from tensorboardX import SummaryWriter

        _writers[key] = SummaryWriter(logdir=key)
    return _writers[key]
