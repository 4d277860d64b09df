"""Preparing a run directory for a job: private dir, secret, resolved config, job script.

Invariant: a run directory holds one config for its whole life; re-preparing it with a different
config is refused, because its checkpoints and shards belong to the config that made them.
"""

from pathlib import Path

import yaml

from ..config import RLConfig, dump_config
from ..errors import UserError
from ..paths import RunPaths


def prepare_run_dir(config: RLConfig, script: str, may_change: tuple[str, ...] = ()) -> RunPaths:
    """Create or reuse the run directory of `config`; sections named in `may_change` (e.g. cluster,
    for a resume on more nodes or with more time) may differ from the config it already holds."""
    if not Path(config.model.path).exists():
        raise UserError(
            f"model.path {config.model.path} does not exist; point model.path (or the environment variable "
            "it expands) at a Hugging Face model directory"
        )
    paths = RunPaths(config.run.dir)
    text = dump_config(config)
    if paths.config.exists() and paths.config.read_text() != text:
        old, new = yaml.safe_load(paths.config.read_text()), yaml.safe_load(text)
        differ = sorted(key for key in old.keys() | new.keys() if old.get(key) != new.get(key) and key not in may_change)
        if differ:
            raise UserError(
                f"{paths.config} already holds a different config (sections {', '.join(differ)} differ); choose "
                "another run.name or run.dir (e.g. --set run.name=NEW) or remove that run directory"
            )
    paths.create()
    paths.config.write_text(text)
    paths.sbatch_script.write_text(script)
    return paths
