"""The MLflow tracker: one MLflow run per run directory, by default in a file store at RUN_DIR/mlruns.

Invariants:
- Every start continues the MLflow run of the id it is given (its status RUNNING again); a run that
  tracking URI does not hold (the URI changed) is replaced by a new one, with a warning.
- The config becomes params (dotted keys), which MLflow never changes once logged: a key a resume
  changed keeps its first value there (a warning names it), and the whole config is also logged as
  config.yaml, replaced at each start.
- A table is a JSON artifact tables/<name>/step_<step>.json in `log_table`'s layout ({columns, data}).
- MLflow's usage telemetry is off unless MLFLOW_DISABLE_TELEMETRY says otherwise (compute nodes seldom
  reach the internet), and so is MLflow 3's refusal of file stores (MLFLOW_ALLOW_FILE_STORE) when the
  tracking URI is one.
"""

import json
import logging
import os
import time

from ..config.trackers import MlflowConfig
from ..errors import UserError
from ..paths import RunPaths

log = logging.getLogger("rltools.tracking")

PARAM_CHARS = 6000  # MLflow's longest param value
STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}


class MlflowTracker:
    def __init__(self, section: MlflowConfig, paths: RunPaths, run_name: str, run_id: str | None):
        uri = section.tracking_uri or paths.mlruns.as_uri()
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        if "://" not in uri or uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        try:
            self.client = MlflowClient(tracking_uri=uri)
            self.run_id = run_id if run_id and self._continues(run_id, uri) else self._create(section, run_name)
        except Exception as err:  # a server that does not answer, a URI MLflow cannot use
            raise UserError(f"trackers.mlflow: MLflow could not start its run at {uri} ({err}); check "
                            "trackers.mlflow.tracking_uri (null: a file store in the run directory)") from None
        self.where = f"MLflow run {self.run_id} at {uri}"

    def _continues(self, run_id: str, uri: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.update_run(run_id, status="RUNNING")
        except MlflowException as err:
            log.warning("trackers.mlflow: %s holds no run %s (%s): starting a new MLflow run", uri, run_id, err.message)
            return False
        return True

    def _create(self, section: MlflowConfig, run_name: str) -> str:
        experiment = self.client.get_experiment_by_name(section.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(section.experiment)
        return self.client.create_run(experiment_id, run_name=section.run_name or run_name).info.run_id

    def config(self, values: dict) -> None:
        from mlflow.entities import Param

        logged = self.client.get_run(self.run_id).data.params
        params = {key: value[:PARAM_CHARS] for key, value in flatten(values).items()}
        changed = sorted(key for key, value in params.items() if logged.get(key, value) != value)
        if changed:
            log.warning("trackers.mlflow: %s changed, but an MLflow param keeps its first value: run %s shows the old "
                        "one, its config.yaml artifact the new", ", ".join(changed), self.run_id)
        self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in params.items() if k not in logged])
        self.client.log_dict(self.run_id, values, "config.yaml")

    def scalars(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, step) for key, value in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def table(self, name: str, rows: list[dict], step: int) -> None:
        """A JSON artifact in log_table's layout ({columns, data}). Not log_table itself: each call of it
        appends the file to one run tag, which outgrows a tracking server's tag length (8000 characters)
        within a few hundred steps of per-step tables; the tracker would then be dropped mid-run."""
        columns = list(dict.fromkeys(key for row in rows for key in row))
        self.client.log_dict(self.run_id, {"columns": columns, "data": [[row.get(c) for c in columns] for row in rows]},
                             f"tables/{name}/step_{step}.json")

    def finish(self, outcome: str) -> None:
        self.client.set_terminated(self.run_id, status=STATUS[outcome])


def flatten(values: dict, prefix: str = "") -> dict[str, str]:
    """Nested config sections as dotted keys; every value as text (JSON for all but strings)."""
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict) and value:
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value)
    return flat
