"""Experiment trackers (Weights & Biases, MLflow): where trainer rank 0 also logs what the run records
in metrics.jsonl and eval/ (`trackers:` in the config; `rltools.tracking.trackers` drives them).

Invariants:
- metrics.jsonl and eval/ stay the record; a tracker gets the same numbers: the training scalars as
  `train/<name>` at the steps done (as in TensorBoard), each evaluation as `eval/<set>/<metric>` and a
  table of its problems at the policy version evaluated, the resolved config once per start.
- One tracker run per run directory: its id is kept in RUN_DIR/trackers.json from the first start on,
  and every later start (resume, requeue) continues that run.
- Light at import, like `config`: W&B and MLflow are imported when a tracker opens, in the trainer.
  The login side asks `check_installed`, which looks for the packages without importing them.
"""

import sys
from importlib.util import find_spec
from typing import Protocol

from ..config.trackers import TrackersConfig
from ..errors import UserError

PACKAGES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow-skinny")}
"""Tracker (its key under `trackers`) -> (the module it imports, the package that installs it)."""


class Tracker(Protocol):
    """One tracker's run. `step` is the run's steps done (0: before training); `outcome` is finished,
    stopped (at a checkpoint, to be resumed) or failed."""

    run_id: str
    where: str
    """Where the run is, for the log: its id, and its folder or server."""

    def config(self, values: dict) -> None: ...

    def scalars(self, values: dict[str, float], step: int) -> None: ...

    def table(self, name: str, rows: list[dict], step: int) -> None: ...

    def finish(self, outcome: str) -> None: ...


def enabled(section: TrackersConfig) -> list[str]:
    """The trackers turned on, in PACKAGES order."""
    return [name for name in PACKAGES if getattr(section, name) is not None]


def check_installed(section: TrackersConfig) -> None:
    """A UserError naming each tracker turned on whose package this Python lacks, and the pip command."""
    missing = [name for name in enabled(section) if find_spec(PACKAGES[name][0]) is None]
    if missing:
        keys = " and ".join(f"trackers.{name}" for name in missing)
        packages = " ".join(PACKAGES[name][1] for name in missing)
        raise UserError(f"{keys} {'is' if len(missing) == 1 else 'are'} set, but {sys.executable} lacks {packages}: "
                        f"pip install 'rltools[trackers]' (or pip install {packages}) in the environment the job "
                        f"runs in, or remove {keys} from the config")
