"""Preparing a run directory for a job: private dir, secret, resolved config, job script.

Invariants:
- A run directory holds one config for its whole life; re-preparing it with a different config is
  refused, because its checkpoints and shards belong to the config that made them. Only the
  sections and keys a caller names may change (`RESUMABLE`, on a resume), and run.dir, which
  follows the directory when it is moved or copied.
- The config and the job script are replaced atomically: a job starting meanwhile reads the old
  or the new file, never half of one.
"""

from pathlib import Path

import yaml

from ..config import RLConfig, dump_config
from ..durable import atomic_write
from ..errors import UserError
from ..paths import RunPaths

# What `rltools resume --set` may change: keys that made no checkpoint, rollout or evaluation of the
# run, read only as limits, cadences and retention by what runs from then on. Everything else (model,
# lora, data, reward, algorithm, env, the generator's sampling, the batch shape, max_staleness, eval.k
# and eval.problems, which the run's earlier evaluations were made with) stays as the run began.
RESUMABLE = (
    "cluster",  # where and how long the job runs
    "schedule.steps",  # the run's length (not below its latest checkpoint: `rltools resume` checks)
    "schedule.checkpoint_every", "schedule.keep_checkpoints", "schedule.keep_rollout_steps",  # cadence, retention
    "schedule.eval_every", "eval.keep_full_exports", "run.samples_per_step",
    "schedule.rollout_timeout_s", "trainer.sync_timeout_s", "generator.sync_timeout_s",  # deadlines
    "generator.heartbeat_timeout_s", "generator.max_engine_restarts", "generator.min_engines",  # lost engines
    "reward.timeout_s", "reward.max_failure_fraction",  # a reward that failed too often (`reward.failures`)
    "trackers",  # where the numbers are also logged (a tracker turned on later gets the run's records so far)
)


def may_change(key: str, keys: tuple[str, ...]) -> bool:
    """Whether the dotted `key` is one of `keys` or inside one of them (a section)."""
    return any(key == allowed or key.startswith(allowed + ".") for allowed in keys)


def create_run_dir(config: RLConfig) -> RunPaths:
    """The run directory of `config`, created (0700, with its secret) if it does not exist."""
    paths = RunPaths(config.run.dir)
    try:
        paths.create()
    except OSError as err:
        raise UserError(f"cannot create the run directory {paths.root}: {err.strerror} ({err.filename}); "
                        "set run.dir to a writable directory on a filesystem the job's nodes share") from None
    return paths


def prepare_run_dir(config: RLConfig, script: str, changeable: tuple[str, ...] = ()) -> RunPaths:
    """Create or reuse the run directory of `config` and write its config and job script; the sections
    and dotted keys named in `changeable` (`RESUMABLE`, on a resume) may differ from the config it
    already holds."""
    paths = create_run_dir(config)
    text = dump_config(config)
    if paths.config.exists() and paths.config.read_text() != text:
        old, new = yaml.safe_load(paths.config.read_text()), yaml.safe_load(text)
        for section in (old, new):
            section.get("run", {}).pop("dir", None)  # where the directory is now, not what made it
        differ = [key for key in differing_keys(old, new) if not may_change(key, changeable)]
        if differ:
            raise UserError(
                f"{paths.config} already holds a different config ({', '.join(differ[:8])} differ); choose "
                "another run.name or run.dir (e.g. --set run.name=NEW) or remove that run directory"
            )
    try:
        atomic_write(paths.config, text)
        atomic_write(paths.sbatch_script, script)
    except OSError as err:
        raise UserError(f"cannot write into the run directory {paths.root}: {err.strerror} ({err.filename})") from None
    return paths


def differing_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two configs as YAML loads them (sections recursed)."""
    keys = []
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += differing_keys(a, b, f"{prefix}{key}.")
        elif a != b:
            keys.append(f"{prefix}{key}")
    return keys


def recorded_run_dir(paths: RunPaths) -> Path | None:
    """The run.dir that the config in `paths` was written for (it differs once the directory moved)."""
    try:
        recorded = yaml.safe_load(paths.config.read_text())["run"]["dir"]
    except (FileNotFoundError, KeyError, TypeError, yaml.YAMLError):
        return None
    return Path(recorded) if recorded else None
