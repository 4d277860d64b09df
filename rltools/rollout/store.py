"""RolloutStore: the hand-off of rollouts from generators to trainers through the run directory.

Invariants:
- Generator rank r writes `rollouts/step_<k>/gen_<r>.h5` once (see shard.py for atomicity).
- The trainer waits for a step's expected ranks with a deadline; polling costs one directory
  listing per poll with exponential back-off (cheap on Lustre/GPFS/NFS, no busy loop).
- Retention never deletes a step before it is both consumed and covered by a checkpoint.
"""

import logging
import shutil
import time
from pathlib import Path
from typing import Sequence

from ..paths import RunPaths
from .batch import RolloutBatch
from .shard import ShardError, read_shard, write_shard

log = logging.getLogger("rltools.rollout")

FIRST_POLL_S = 0.02
MAX_POLL_S = 2.0


class RolloutTimeout(TimeoutError):
    """A step's shards did not all appear before the deadline; the message names the missing ranks."""


class RolloutStore:
    def __init__(self, paths: RunPaths, run_id: str, keep_steps: int = 2):
        self.paths = paths
        self.run_id = run_id
        self.keep_steps = keep_steps

    # -- generator side ---------------------------------------------------------------------
    def write(self, step: int, rank: int, batch: RolloutBatch) -> Path:
        path = self.paths.rollout_shard(step, rank)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        for leftover in path.parent.glob(f".{path.name}.*.tmp"):
            leftover.unlink(missing_ok=True)  # a previous attempt of this rank died mid-write
        write_shard(path, batch, run_id=self.run_id, step=step, rank=rank)
        return path

    # -- trainer side -----------------------------------------------------------------------
    def ready_ranks(self, step: int) -> set[int]:
        """Ranks whose final shard of `step` exists: one directory listing."""
        try:
            names = [entry.name for entry in self.paths.rollout_step(step).iterdir()]
        except FileNotFoundError:
            return set()
        return {rank for rank in map(RunPaths.shard_rank, names) if rank is not None}

    def wait(self, step: int, ranks: Sequence[int], timeout_s: float, check=None) -> list[RolloutBatch]:
        """The shards of `step` from `ranks`, in rank order, once all exist; RolloutTimeout otherwise.

        `check()` runs on every poll and may raise to abandon the wait (a stop signal)."""
        deadline = time.monotonic() + timeout_s
        poll = FIRST_POLL_S
        while True:
            if check is not None:
                check()
            missing = sorted(set(ranks) - self.ready_ranks(step))
            if not missing:
                return [self.read(step, rank) for rank in ranks]
            if time.monotonic() + poll > deadline:
                raise RolloutTimeout(
                    f"step {step}: no shard from generator rank(s) {missing} in {self.paths.rollout_step(step)} "
                    f"after {timeout_s:.0f} s; check those generators' logs"
                )
            time.sleep(poll)
            poll = min(poll * 1.5, MAX_POLL_S)

    def read(self, step: int, rank: int) -> RolloutBatch:
        return read_shard(self.paths.rollout_shard(step, rank), run_id=self.run_id, step=step, rank=rank)

    # -- resume -----------------------------------------------------------------------------
    def discard_unusable(self, resumed_at: int, max_staleness: int) -> list[Path]:
        """Before a resume from the checkpoint of step `resumed_at`: delete the shards of later steps
        that the resumed run may not train on, and return them.

        Step k's shard of policy version v is kept only if v is a version the resumed run has (v <=
        resumed_at; later versions came from training that the checkpoint does not contain), within
        the staleness bound (k - v <= max_staleness), and whole: a shard that fails its checks
        (truncated, a flipped byte, another run's) is deleted with a warning, and its generator
        writes it again. Kept shards are not generated again.
        """
        discarded = []
        for step, directory in sorted(self.paths.rollout_steps().items()):
            if step < resumed_at:
                continue  # trained on before the checkpoint; retention deletes them
            for shard in sorted(directory.iterdir()):
                rank = RunPaths.shard_rank(shard.name)
                if rank is None:
                    shard.unlink()  # a temporary left by a writer that was killed
                    continue
                try:
                    version = read_shard(shard, run_id=self.run_id, step=step, rank=rank).policy_version
                except ShardError as err:
                    log.warning("deleted a damaged rollout shard, its generator writes it again: %s", err)
                    version = None
                if version is None or not (step - max_staleness <= version <= resumed_at):
                    shard.unlink()
                    discarded.append(shard)
        return discarded

    # -- retention --------------------------------------------------------------------------
    def prune(self, consumed_through: int, checkpointed_through: int) -> list[int]:
        """Delete step directories older than the last `keep_steps` safe ones; return the steps deleted.

        A step is safe to delete only when it was trained on (consumed) and a checkpoint taken after
        it exists, so a restart never needs its rollouts again.
        """
        safe = min(consumed_through, checkpointed_through)
        deleted = []
        for step, directory in sorted(self.paths.rollout_steps().items()):
            if step <= safe - self.keep_steps:
                shutil.rmtree(directory)
                deleted.append(step)
        return deleted
