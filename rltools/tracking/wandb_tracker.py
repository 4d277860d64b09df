"""The Weights & Biases tracker: one W&B run per run directory, written under RUN_DIR/wandb.

Invariants:
- Offline (the default) reaches no network: the run is written to RUN_DIR/wandb/offline-run-<time>-<id>,
  one folder per start, and W&B's own error reporting (which looks up its server) is off unless
  WANDB_ERROR_REPORTING says otherwise. `wandb sync RUN_DIR/wandb/offline-run-*` uploads the folders
  into the one W&B run, in the order they started.
- Every start resumes the W&B run of the id it is given (`resume="allow"`).
- Scalars are plotted against `step` (the run's steps done), not W&B's own row counter: an evaluation
  logged after later training steps still lands at its step, and a step logged again after a resume
  is a second point at the same step.
- Nothing W&B starts outlives the trainer: `finish` ends the run and W&B's service process (wandb-core),
  and its system-metrics monitor is never started (after a kill -9 of its parent it lived on for
  seconds; wandb-core itself watches the trainer's pid).
"""

import os

from ..config.trackers import WandbConfig
from ..errors import UserError
from ..paths import RunPaths

STEP = "step"
"""The x-axis of every chart: the run's steps done."""


class WandbTracker:
    def __init__(self, section: WandbConfig, paths: RunPaths, run_name: str, run_id: str | None):
        if section.mode == "offline":
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")  # read as W&B loads and starts its service
        import wandb

        self._wandb = wandb
        try:
            # quiet: no 50-line panel of history and summary at the end of the trainer's log;
            # x_disable_stats: one of W&B's experimental settings (checked with wandb 0.31.0)
            settings = wandb.Settings(console="off", disable_git=True, x_disable_stats=True, quiet=True)
            self.run = wandb.init(project=section.project, entity=section.entity, name=section.name or run_name,
                                  tags=section.tags, mode=section.mode, id=run_id, resume="allow", settings=settings,
                                  dir=str(paths.root))  # W&B writes under dir/wandb: paths.wandb
        except Exception as err:  # online without a key or a network: say which key decides
            raise UserError(f"trackers.wandb: W&B could not start its run in {section.mode} mode ({err}); "
                            "set trackers.wandb.mode: offline, or WANDB_API_KEY and a network for online") from None
        self.run_id = self.run.id
        self.where = f"W&B run {self.run_id} ({section.mode}) in {paths.wandb}" + (
            f"; upload it with: wandb sync {paths.wandb}/offline-run-*" if section.mode == "offline" else "")
        for logged in ("train/*", "eval/*"):
            self.run.define_metric(logged, step_metric=STEP)

    def config(self, values: dict) -> None:
        self.run.config.update(values, allow_val_change=True)  # a resume may have changed a few keys

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log({**values, STEP: step})

    def table(self, name: str, rows: list[dict], step: int) -> None:
        columns = list(dict.fromkeys(key for row in rows for key in row))
        table = self._wandb.Table(columns=columns, data=[[row.get(column) for column in columns] for row in rows])
        self.run.log({name: table, STEP: step})

    def finish(self, outcome: str) -> None:
        self.run.finish(exit_code=1 if outcome == "failed" else 0)
        self._wandb.teardown()  # ends wandb-core now rather than at interpreter exit
