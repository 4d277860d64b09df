"""Publishing policy versions from the trainers: the weight-sync broadcast and the policy exports.

Invariant: every trainer rank takes part in each export (under FSDP2 or Megatron gathering the
weights is a collective of the trainers); only trainer rank 0 hosts the weight-sync group, sends,
and writes a policy export while the tensors pass. A broadcast that fails because the generators
left on a stop signal is not an error: the checkpoint written next holds that version.
"""

import logging
import socket
from pathlib import Path

from ..paths import RunPaths
from ..policy_exports import PolicyWriter
from ..runtime import faults
from ..runtime.preempt import StopFlag
from ..runtime.probe import check_gap, probe_tokens, write_probe
from ..runtime.role_env import RoleEnv
from ..runtime.roles import sync_backend, sync_world_size
from ..weight_formats import weight_format
from ..weight_sync import TensorStream, WeightSyncError
from .backend import Backend

log = logging.getLogger("rltools.trainer")


class Publisher:
    def __init__(self, env: RoleEnv, paths: RunPaths, config, backend: Backend, stop: StopFlag):
        self.env, self.config, self.backend, self.stop = env, config, backend, stop
        self.format = weight_format(config)
        self.paths = paths
        self.probe = probe_tokens(_tokenizer(config.model.path))
        self.tp = config.generator.tensor_parallel_size
        # Generators join only now (after the resume): they never see shards or checkpoints in flux.
        self.sender = host_weight_sync(env, paths, config) if env.rank == 0 else None

    def send(self, version: int, export_to: Path | None = None) -> tuple[float, list[float] | None]:
        """Broadcast `version`'s weights (collective over the trainer ranks); with `export_to`, rank 0
        also writes them there as a policy export while they pass. Returns the seconds rank 0 waited
        for the generators to take them (a generator evaluating makes it wait) and the logprob gap
        each engine measured under it (`runtime.probe`); (0, None) on other ranks. A gap beyond
        generator.max_logprob_gap stops the run (RuntimeError naming it)."""
        faults.point("trainer.sync", version)
        probe = self.backend.trainer.probe_logprobs(self.probe)  # every rank: a forward pass of the trainers
        if self.env.rank == 0 and probe is not None:
            write_probe(self.paths, version, self.probe, probe)
        weights = self.format.export(self.backend)
        writer, waited, gap = None, 0.0, None
        if export_to is not None and self.env.rank == 0:
            writer = PolicyWriter(export_to, self.format, version)
            weights = _tee(weights, writer.add)
        if self.sender is None:
            for _ in weights:
                pass
        else:
            try:
                waited = self.sender.broadcast(weights, version=version, kind=self.format.name).waited_s
                gap = self._judge(version, self.sender.probe_gaps(version))
            except WeightSyncError:
                if not self.stop.requested:
                    raise
                # SIGTERM reached the generators too and they left mid-broadcast; the checkpoint about
                # to be written holds this version, and they receive it from there when the run resumes.
                log.warning("generators left during the broadcast of version %d: stopping", version)
                for _ in weights:  # finish the export: under FSDP2 it is a collective of the trainers
                    pass
        if writer is not None:
            writer.close()
        return waited, gap

    def _judge(self, version: int, gaps: dict[int, float]) -> list[float] | None:
        """Each engine's gap (the largest over its TP workers), in engine order; beyond
        generator.max_logprob_gap, stop naming who. None when no probe was scored (a backend that
        scores none reports nan)."""
        gaps = {rank: gap for rank, gap in gaps.items() if gap == gap}
        if not gaps:
            return None
        worst = max(gaps, key=gaps.get)
        check_gap(version, gaps[worst], f"sync rank {worst} (generator {self._engine(worst)})",
                  self.config.generator.max_logprob_gap)
        engines: dict[int, float] = {}
        for rank, gap in gaps.items():
            engines[self._engine(rank)] = max(gap, engines.get(self._engine(rank), 0.0))
        return [engines[engine] for engine in sorted(engines)]

    def _engine(self, sync_rank: int) -> int:
        return (sync_rank - 1) // self.tp


def _tokenizer(model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)


def host_weight_sync(env: RoleEnv, paths: RunPaths, config):
    from ..weight_sync import SyncOptions, WeightSender, host_group

    timeout = config.generator.sync_timeout_s
    options = SyncOptions(backend=sync_backend(), join_timeout_s=timeout, collective_timeout_s=timeout)
    group = host_group(
        paths,
        world_size=sync_world_size(config),
        address=socket.gethostbyname(env.trainer_host),
        attempt=env.attempt,
        options=options,
    )
    return WeightSender(group)


def _tee(weights, add):
    """`weights` (a TensorStream keeps its specs) with `add(name, tensor)` called on each as it passes."""

    def passing():
        for name, tensor in weights:
            add(name, tensor)
            yield name, tensor

    return TensorStream(weights.specs, passing()) if isinstance(weights, TensorStream) else passing()
