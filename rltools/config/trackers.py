"""The experiment-tracker section: Weights & Biases and MLflow, each off unless its key is present.
Declared here, re-exported by `schema`.

Invariant: as in `schema`: every key declared with its type and default and a docstring; unknown keys
are errors. A tracker's section being absent (null) is the tracker being off; `trackers: {wandb: {}}`
turns W&B on with every default.
"""

from typing import Literal

from pydantic import Field

from .types import Section


class WandbConfig(Section):
    project: str = "rltools"
    """The W&B project the run is logged to."""
    entity: str | None = None
    """The W&B team or user; null: your default entity (known when the run is synced)."""
    name: str | None = None
    """The W&B run's display name; null: run.name."""
    mode: Literal["offline", "online"] = "offline"
    """offline (compute nodes seldom reach the internet): the run is written under RUN_DIR/wandb and
    uploaded later with `wandb sync RUN_DIR/wandb/offline-run-*` from a login node; online: streamed as
    it runs (needs WANDB_API_KEY and the network on the trainer's node)."""
    tags: list[str] = []
    """Tags of the W&B run."""


class MlflowConfig(Section):
    tracking_uri: str | None = None
    """Where the run is logged: an MLflow server (http://host:5000), a database (sqlite:///...), or a
    file store (file:///path); null: a file store in the run directory, RUN_DIR/mlruns
    (`mlflow ui --backend-store-uri RUN_DIR/mlruns` shows it)."""
    experiment: str = "rltools"
    """The MLflow experiment the run belongs to (created if missing)."""
    run_name: str | None = None
    """The MLflow run's name; null: run.name."""


class TrackersConfig(Section):
    wandb: WandbConfig | None = None
    """Weights & Biases (pip install 'rltools[trackers]'); null: off."""
    mlflow: MlflowConfig | None = None
    """MLflow (pip install 'rltools[trackers]': mlflow-skinny); null: off."""
    final_eval_timeout_s: float = Field(1800.0, ge=0)
    """After the last step, how long trainer rank 0 waits for the generators' final evaluation
    (eval/step_<schedule.steps>.json) to log it to the trackers; it is logged at the next start of the
    run (a resume with more steps) when it comes later. 0: no wait."""
