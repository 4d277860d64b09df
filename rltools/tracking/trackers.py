"""Trainer rank 0's trackers: opened after the resume, given each trained step and every evaluation
the generators wrote, closed at the end. Every other process holds `Trackers()`, which logs nothing.

Invariants:
- trackers.json (`RunPaths.trackers`) holds each tracker's run id and the evaluations (by step) it
  has logged, rewritten atomically after each change. A start from the checkpoint after k steps keeps
  those up to k: the evaluations after k are made again (`metrics.resume_metrics` deleted them), and
  logged again.
- An evaluation is logged once its eval/step_<v>.json is complete: at the next step trainer rank 0
  logs (the generators evaluate while training goes on), and after the last step within
  trackers.final_eval_timeout_s.
- A tracker that fails while the run goes on is dropped, with a warning, for the rest of this start:
  the run does not die for its tracker, and metrics.jsonl and eval/ keep every number.
- A tracker new to a run that has trained steps (turned on at a resume) first gets its records so far.
"""

import json
import logging
import re
import time
from collections.abc import Callable

import yaml

from ..config.trackers import TrackersConfig
from ..durable import atomic_write
from ..paths import RunPaths
from ..records import eval_files, read_json, read_metrics, set_results
from . import Tracker, check_installed, enabled
from .mlflow_tracker import MlflowTracker
from .wandb_tracker import WandbTracker

log = logging.getLogger("rltools.tracking")

KINDS = {"wandb": WandbTracker, "mlflow": MlflowTracker}
SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)
"""cluster.environment variables whose values the trackers get masked."""


class Trackers:
    """The trackers trainer rank 0 opened with `Trackers.start`; `Trackers()` has none and logs nothing."""

    def __init__(self, paths: RunPaths | None = None):
        self.paths = paths
        self.opened: dict[str, Tracker] = {}
        self.state: dict[str, dict] = {}
        """Per tracker: {"run_id", "evals": the steps of the evaluations it has logged} (trackers.json)."""
        if paths is not None:
            self.state = read_json(paths.trackers) or {}

    @classmethod
    def start(cls, section: TrackersConfig, paths: RunPaths, run_name: str, done: int) -> "Trackers":
        """The trackers of `section`, each continuing the run's tracker run (or starting one), given the
        config and, when new to a run with `done` steps, its records so far; a UserError when one cannot
        start (its package missing, W&B online without a key, an MLflow server that does not answer)."""
        check_installed(section)
        trackers = cls(paths)
        config = loggable(yaml.safe_load(paths.config.read_text()))
        for name in enabled(section):
            tracker = KINDS[name](getattr(section, name), paths, run_name, trackers.state.get(name, {}).get("run_id"))
            continued = trackers._add(name, tracker, done)
            trackers._call(name, "config", config)
            for record in [] if continued else read_metrics(paths):
                trackers._call(name, "scalars", train_scalars(record), record["step"] + 1)
        trackers.log_evals()
        return trackers

    def log_step(self, record: dict) -> None:
        """A trained step's record as metrics.jsonl holds it (`step` 0-based), then the evaluations
        written since the last call."""
        self._each("scalars", train_scalars(record), record["step"] + 1)
        self.log_evals()

    def table(self, name: str, rows: list[dict], step: int) -> None:
        """`rows` (the keys are the columns) as table `name` at `step` (steps done), in every tracker:
        e.g. a step's completions with their prompt, reward and advantage. W&B keeps one table per call;
        MLflow writes tables/<name>/step_<step>.json (a step logged again after a crash replaces it)."""
        self._each("table", name, rows, step)

    def log_evals(self) -> None:
        """Every complete evaluation result a tracker has not logged yet, oldest first."""
        found = sorted(eval_files(self.paths)) if self.opened else []
        for name in list(self.opened):
            for step in [s for s in found if s not in self.state[name]["evals"]]:
                result = read_json(self.paths.eval_result(step))
                if result is None:  # still being written
                    continue
                if not all(self._call(name, method, *args, step) for method, *args in eval_calls(result)):
                    break  # the tracker failed: dropped
                self.state[name]["evals"].append(step)
                self._save()

    def wait_for_eval(self, step: int, timeout_s: float, give_up: Callable[[], bool]) -> None:
        """Log the evaluation of policy version `step` (the final one), waiting up to `timeout_s` for
        it; `give_up()` true (a stop signal) ends the wait early."""
        self.log_evals()
        if all(step in self.state[name]["evals"] for name in self.opened):  # none open, or logged already
            return
        path = self.paths.eval_result(step)
        log.info("waiting up to %.0f s for the final evaluation (%s) to log it to %s", timeout_s, path,
                 ", ".join(self.opened))
        begin = time.monotonic()
        while read_json(path) is None and time.monotonic() < begin + timeout_s and not give_up():
            time.sleep(1.0)
        self.log_evals()
        if read_json(path) is not None:
            log.info("the final evaluation is logged (after %.0f s)", time.monotonic() - begin)
        else:
            log.warning("the final evaluation %s did not come within trackers.final_eval_timeout_s (%.0f s): the "
                        "trackers get it at the next start of this run (rltools resume %s --set schedule.steps=N)",
                        path, timeout_s, self.paths.root)

    def close(self, outcome: str) -> None:
        """End every tracker's run: finished, stopped (at a checkpoint, to be resumed) or failed."""
        self._each("finish", outcome)
        self.opened = {}

    def _add(self, name: str, tracker: Tracker, done: int) -> bool:
        """Add an opened tracker; returns whether it continues the run's tracker run (else: a new one)."""
        known = self.state.get(name, {})
        continued = tracker.run_id == known.get("run_id")
        evals = [step for step in known.get("evals", []) if step <= done] if continued else []
        self.state[name] = {"run_id": tracker.run_id, "evals": evals}
        self.opened[name] = tracker
        self._save()
        log.info("trackers.%s: %s %s", name, "continuing" if continued else "started", tracker.where)
        return continued

    def _each(self, method: str, *args) -> None:
        for name in list(self.opened):
            self._call(name, method, *args)

    def _call(self, name: str, method: str, *args) -> bool:
        """Call one tracker; False when it failed (it is dropped then) or was dropped before."""
        tracker = self.opened.get(name)
        if tracker is None:
            return False
        try:
            getattr(tracker, method)(*args)
        except Exception:
            log.warning("trackers.%s failed (%s): it is off for the rest of this start; metrics.jsonl and eval/ keep "
                        "every number, and the next start continues its run", name, method, exc_info=True)
            del self.opened[name]
            return False
        return True

    def _save(self) -> None:
        atomic_write(self.paths.trackers, json.dumps(self.state, indent=1))


def train_scalars(record: dict) -> dict[str, float]:
    return numbers({k: v for k, v in record.items() if k not in ("step", "time")}, "train/")


def eval_calls(result: dict) -> list[tuple]:
    """The tracker calls (method, arguments but the step) that log an evaluation result: each set's
    numbers as scalars eval/<set>/<metric>, and its problems as table eval/<set>/problems."""
    calls = []
    for name, summary in set_results(result).items():
        calls.append(("scalars", numbers(summary, f"eval/{name}/")))
        rows = [{"problem": i, "accuracy": a} for i, a in enumerate(summary.get("per_problem_accuracy", []))]
        calls += [("table", f"eval/{name}/problems", rows)] if rows else []
    return calls


def numbers(values: dict, prefix: str) -> dict[str, float]:
    """The numeric entries of `values` (not flags, lists or text), their names prefixed."""
    return {f"{prefix}{k}": v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def loggable(config: dict) -> dict:
    """The resolved config as the trackers get it: cluster.environment values that look like secrets masked."""
    cluster = config.get("cluster", {})
    environment = {k: "***" if SECRET.search(k) else v for k, v in cluster.get("environment", {}).items()}
    return {**config, "cluster": {**cluster, "environment": environment}}
