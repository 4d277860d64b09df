"""RunPaths: the one owner of every path inside a run directory.

Invariant: no other module builds a run-directory path by hand; a layout change happens here only.
The run directory is private to its owner (0700) and holds a 0600 secret used to authenticate
the weight-sync rendezvous.
"""

import os
import re
import secrets
from pathlib import Path

ROLES = ("generator", "trainer", "judge")
"""Roles of a job's tasks; a judge only where a reward function is one (reward.judge)."""
_SHARD_NAME = re.compile(r"gen_(\d+)\.h5")
CHECKPOINT_MARKER = "COMPLETE"
"""Written last into a checkpoint directory: without it the directory is debris of a crashed save."""
CHECKPOINT_PROBE = "probe.json"
"""The trainer's probe of the checkpoint's policy version, kept in the checkpoint (`runtime.probe`)."""
_STEP_NAME = re.compile(r"step_(\d+)")
_ATTEMPT_NAME = re.compile(r"attempt_(\d+)")
_STEP_FILE = re.compile(r"step_(\d+)\.jsonl")


class RunPaths:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    # -- files at the top -------------------------------------------------------------------
    @property
    def config(self) -> Path:
        """The resolved config every role reads."""
        return self.root / "config.yaml"

    @property
    def secret(self) -> Path:
        return self.root / "secret"

    @property
    def run_id_file(self) -> Path:
        return self.root / "run_id"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    # -- Slurm ------------------------------------------------------------------------------
    @property
    def slurm_dir(self) -> Path:
        return self.root / "slurm"

    @property
    def sbatch_script(self) -> Path:
        return self.slurm_dir / "job.sbatch"

    @property
    def lock_file(self) -> Path:
        """Held (flock) by whatever runs the job, with the holder's host and pid inside: the local
        launcher and its roles, or the Slurm job script (see rltools/launch/run_lock.py)."""
        return self.root / "run.lock"

    @property
    def job_id_file(self) -> Path:
        """The Slurm job id (the hetjob leader's), written at submission and by the job script."""
        return self.slurm_dir / "job_id"

    def submitit_dir(self, role: str) -> Path:
        """submitit's job folder for a role's tasks: pickled call, per-task results.

        One folder per component: both number their tasks from 0, and submitit names a task's result
        after its number alone.
        """
        return self.slurm_dir / "submitit" / role

    @property
    def log_dir(self) -> Path:
        return self.slurm_dir / "logs"

    def component_log(self, component: str, stream: str) -> Path:
        """The batch-level log of a hetjob component (`generators`/`trainers`, `out`/`err`)."""
        return self.log_dir / f"{component}.{stream}"

    def attempt_log_dir(self, attempt: int | str) -> Path:
        """Per-task logs of one attempt (0 = first start, +1 per requeue)."""
        return self.log_dir / f"attempt_{attempt}"

    def task_log(self, attempt: int | str, role: str, rank: int | str) -> Path:
        return self.attempt_log_dir(attempt) / f"{role}_{rank}.log"

    def component_exit(self, attempt: int | str, role: str) -> Path:
        """Exit status of a role's job step in one attempt, written by the job script as it ends."""
        return self.attempt_log_dir(attempt) / f"{role}.exit"

    def attempts(self) -> list[int]:
        """Attempts that started (each makes its log directory), oldest first."""
        found = [int(m.group(1)) for m in (_ATTEMPT_NAME.fullmatch(p.name) for p in self._entries(self.log_dir)) if m]
        return sorted(found)

    # -- data planes (used by later stages) -------------------------------------------------
    @property
    def rollouts(self) -> Path:
        return self.root / "rollouts"

    def rollout_step(self, step: int) -> Path:
        return self.rollouts / f"step_{step}"

    def rollout_shard(self, step: int, rank: int) -> Path:
        """Generator `rank`'s shard of `step`; written under a temporary name, then renamed to this."""
        return self.rollout_step(step) / f"gen_{rank}.h5"

    @staticmethod
    def shard_rank(name: str) -> int | None:
        """The generator rank of a final shard file name, None for anything else (temporaries)."""
        match = _SHARD_NAME.fullmatch(name)
        return int(match.group(1)) if match else None

    def rollout_steps(self) -> dict[int, Path]:
        """Existing step directories by step number."""
        return self._steps_in(self.rollouts)

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint_dir(self, step: int) -> Path:
        """The trainer's state after `step` optimizer steps; valid only with its completion marker."""
        return self.checkpoints / f"step_{step}"

    def checkpoint_tmp(self, step: int) -> Path:
        """Where a checkpoint is written before the rename that publishes it."""
        return self.checkpoints / f".step_{step}.tmp"

    @property
    def rejected_checkpoints(self) -> Path:
        """Where a resume moves checkpoints that fail verification (kept for inspection, never loaded)."""
        return self.root / "checkpoints.rejected"

    def checkpoint_steps(self) -> dict[int, Path]:
        """Published checkpoint directories by step (valid or not: see rltools/train/checkpoints.py)."""
        return self._steps_in(self.checkpoints)

    def valid_checkpoints(self) -> dict[int, Path]:
        """Checkpoints that hold their completion marker, by step, oldest first (found by scanning)."""
        return {k: d for k, d in sorted(self.checkpoint_steps().items()) if (d / CHECKPOINT_MARKER).is_file()}

    def latest_checkpoint(self) -> int:
        """Steps done by the latest valid checkpoint; 0 when there is none (a fresh start)."""
        return max(self.valid_checkpoints(), default=0)

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    def adapter_dir(self, version: int) -> Path:
        """The LoRA adapter of a policy version, in PEFT layout, as the generator serves it."""
        return self.weights / f"adapter_v{version}"

    def probe_file(self, version: int) -> Path:
        """The trainer's log-probabilities of the probe sequence under policy version `version`,
        written before that version is broadcast; each generator compares its own after loading it."""
        return self.root / "probes" / f"probe_v{version}.json"

    def policy_dir(self, step: int) -> Path:
        """The policy after `step` optimizer steps, exported for evaluation (rltools.policy_exports)."""
        return self.weights / f"step_{step}"

    def policy_steps(self) -> dict[int, Path]:
        """Existing policy exports by step (temporaries excluded; completeness is checked by the reader)."""
        return self._steps_in(self.weights)

    @property
    def exports(self) -> Path:
        """Where `rltools export` writes by default (rltools.export)."""
        return self.root / "exports"

    def export_dir(self, name: str) -> Path:
        """The default directory of one export of `rltools export`, e.g. exports/step_40-merged."""
        return self.exports / name

    @property
    def eval_dir(self) -> Path:
        return self.root / "eval"

    def eval_result(self, step: int) -> Path:
        """Held-out evaluation after `step` optimizer steps (0 = the base model)."""
        return self.eval_dir / f"step_{step}.json"

    @property
    def eval_log(self) -> Path:
        """One JSON line per held-out evaluation during training (written by generator rank 0 only)."""
        return self.root / "eval.jsonl"

    # -- completions people read (rltools.completions) ---------------------------------------
    @property
    def samples_dir(self) -> Path:
        return self.root / "samples"

    def step_samples(self, step: int) -> Path:
        """A sample of the rollouts trained at `step` (0-based, metrics.jsonl's step), one JSON line each."""
        return self.samples_dir / f"step_{step}.jsonl"

    def sample_steps(self) -> dict[int, Path]:
        """Existing step sample files by step (temporaries excluded)."""
        matches = ((_STEP_FILE.fullmatch(entry.name), entry) for entry in self._entries(self.samples_dir))
        return {int(match.group(1)): entry for match, entry in matches if match}

    def eval_samples_root(self, adhoc: bool = False) -> Path:
        """The evaluations' completions: the run's own, or (adhoc) those `rltools eval` kept."""
        return self.eval_dir / ("adhoc" if adhoc else "samples")

    def eval_samples_dir(self, step: int, adhoc: bool = False) -> Path:
        """The completions of the evaluation after `step` optimizer steps, a `<set>.jsonl` per eval set."""
        return self.eval_samples_root(adhoc) / f"step_{step}"

    def eval_sample_steps(self, adhoc: bool = False) -> dict[int, Path]:
        return self._steps_in(self.eval_samples_root(adhoc))

    @property
    def tensorboard(self) -> Path:
        return self.root / "tb"

    @property
    def trackers(self) -> Path:
        """The experiment trackers' run ids, so that a resume continues the same tracker runs, and the
        evaluations each has logged (`rltools.tracking`); written by trainer rank 0."""
        return self.root / "trackers.json"

    @property
    def wandb(self) -> Path:
        """Where W&B writes its runs (offline-run-*/ to upload with `wandb sync`): W&B is given the run
        directory and makes this folder in it."""
        return self.root / "wandb"

    @property
    def mlruns(self) -> Path:
        """MLflow's default file store: trackers.mlflow.tracking_uri null logs here."""
        return self.root / "mlruns"

    @property
    def sync_address(self) -> Path:
        """Where trainer rank 0 publishes the weight-sync store's host:port for generator workers."""
        return self.root / "weight_sync.json"

    @property
    def fleet(self) -> Path:
        """The generator fleet: live engines, which engine generates each slot of a step, losses (`runtime.fleet`)."""
        return self.root / "fleet.json"

    @property
    def resumed(self) -> Path:
        """What the trainers of the latest start loaded: {"step", "set_aside": [notes], "time"}."""
        return self.root / "resumed.json"

    @property
    def joins(self) -> Path:
        """The Slurm jobs `rltools join` added to the fleet, and the engine numbers each one took."""
        return self.root / "joins.json"

    @property
    def trainer_address(self) -> Path:
        """Where trainer rank 0 publishes the trainers' own process-group store."""
        return self.root / "trainer_group.json"

    def judge_address(self, engine: int) -> Path:
        """Where judge engine `engine` publishes the host:port it answers scoring requests on (reward.judge)."""
        return self.root / "judges" / f"judge_{engine}.json"

    @property
    def selfcheck_address(self) -> Path:
        """Where trainer rank 0 of the cluster self-check publishes host:port."""
        return self.slurm_dir / "selfcheck_address.json"

    @classmethod
    def _steps_in(cls, directory: Path) -> dict[int, Path]:
        matches = ((_STEP_NAME.fullmatch(entry.name), entry) for entry in cls._entries(directory))
        return {int(match.group(1)): entry for match, entry in matches if match}

    @staticmethod
    def _entries(directory: Path) -> list[Path]:
        return list(directory.iterdir()) if directory.is_dir() else []

    def relative(self, path: Path) -> str:
        return str(path.relative_to(self.root))

    # -- creation ---------------------------------------------------------------------------
    def create(self) -> None:
        """Create the run directory (0700) and its secret (0600, kept if it already exists)."""
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        for sub in (self.slurm_dir, self.log_dir):
            sub.mkdir(mode=0o700, exist_ok=True)
        for path, value in ((self.secret, secrets.token_hex(32)), (self.run_id_file, secrets.token_hex(8))):
            if not path.exists():
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(value)

    def read_secret(self) -> bytes:
        """The run's secret: proves a process may join the weight-sync group."""
        return bytes.fromhex(self.secret.read_text().strip())

    def read_run_id(self) -> str:
        """A random id fixed at creation: shards of another run are refused by it."""
        return self.run_id_file.read_text().strip()
