"""Preparing a run directory for a job: private dir, secret, resolved config, job script.

Invariants:
- A run directory holds one config for its whole life; re-preparing it with a different config is
  refused, because its checkpoints and shards belong to the config that made them. Only the
  sections a caller names may change (cluster, on a resume), and run.dir, which follows the
  directory when it is moved or copied.
- The config and the job script are replaced atomically: a job starting meanwhile reads the old
  or the new file, never half of one.
"""

from pathlib import Path

import yaml

from ..config import RLConfig, dump_config
from ..durable import atomic_write
from ..errors import UserError
from ..paths import RunPaths


def create_run_dir(config: RLConfig) -> RunPaths:
    """The run directory of `config`, created (0700, with its secret) if it does not exist."""
    paths = RunPaths(config.run.dir)
    try:
        paths.create()
    except OSError as err:
        raise UserError(f"cannot create the run directory {paths.root}: {err.strerror} ({err.filename}); "
                        "set run.dir to a writable directory on a filesystem the job's nodes share") from None
    return paths


def prepare_run_dir(config: RLConfig, script: str, may_change: tuple[str, ...] = ()) -> RunPaths:
    """Create or reuse the run directory of `config` and write its config and job script; sections
    named in `may_change` (e.g. cluster, for a resume on more nodes or with more time) may differ
    from the config it already holds."""
    paths = create_run_dir(config)
    text = dump_config(config)
    if paths.config.exists() and paths.config.read_text() != text:
        old, new = yaml.safe_load(paths.config.read_text()), yaml.safe_load(text)
        for section in (old, new):
            section.get("run", {}).pop("dir", None)  # where the directory is now, not what made it
        differ = sorted(key for key in old.keys() | new.keys() if old.get(key) != new.get(key) and key not in may_change)
        if differ:
            raise UserError(
                f"{paths.config} already holds a different config (sections {', '.join(differ)} differ); choose "
                "another run.name or run.dir (e.g. --set run.name=NEW) or remove that run directory"
            )
    try:
        atomic_write(paths.config, text)
        atomic_write(paths.sbatch_script, script)
    except OSError as err:
        raise UserError(f"cannot write into the run directory {paths.root}: {err.strerror} ({err.filename})") from None
    return paths


def recorded_run_dir(paths: RunPaths) -> Path | None:
    """The run.dir that the config in `paths` was written for (it differs once the directory moved)."""
    try:
        recorded = yaml.safe_load(paths.config.read_text())["run"]["dir"]
    except (FileNotFoundError, KeyError, TypeError, yaml.YAMLError):
        return None
    return Path(recorded) if recorded else None
