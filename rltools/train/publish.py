"""Publishing policy versions from the trainers: the weight-sync broadcast and the policy exports.

Invariant: every trainer rank takes part in each export (under FSDP2 or Megatron gathering the
weights is a collective of the trainers), also when a version is exported again because the fleet
lost an engine mid-broadcast; only trainer rank 0 hosts the weight-sync group (`fleet`), sends,
and writes a policy export while the tensors pass. A broadcast that fails because the generators
left on a stop signal is not an error: the checkpoint written next holds that version.
"""

import logging
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from ..paths import RunPaths
from ..policy_exports import PolicyWriter
from ..runtime import faults
from ..runtime.preempt import StopFlag
from ..runtime.probe import check_gap, probe_tokens, write_probe
from ..runtime.role_env import RoleEnv
from ..runtime.roles import sync_backend
from ..weight_formats import weight_format
from ..weight_sync import TensorStream, WeightSyncError
from .backend import Backend
from .fleet import Fleet, FleetTooSmall

log = logging.getLogger("rltools.trainer")


class Publisher:
    def __init__(self, env: RoleEnv, paths: RunPaths, config, backend: Backend, stop: StopFlag):
        self.env, self.config, self.backend, self.stop = env, config, backend, stop
        self.format = weight_format(config)
        self.paths = paths
        self.probe = probe_tokens(_tokenizer(config.model.path))
        # Generators join only now (after the resume): they never see shards or checkpoints in flux.
        self.fleet = host_fleet(env, paths, config, stop) if env.rank == 0 else None

    def send(self, version: int, export_to: Path | None = None) -> tuple[float, list[float] | None]:
        """Broadcast `version`'s weights (collective over the trainer ranks); with `export_to`, rank 0
        also writes them there as a policy export while they pass. Returns the seconds rank 0 waited
        for the generators to take them (a generator evaluating makes it wait) and the logprob gap
        each live engine measured under it (`runtime.probe`); (0, None) on other ranks. A gap beyond
        generator.max_logprob_gap stops the run (RuntimeError naming it). When the fleet lost an
        engine during the broadcast, every trainer rank exports the weights again and rank 0 sends
        them to the re-formed group; fewer engines than generator.min_engines request a stop at a
        checkpoint (`StopFlag.request`)."""
        faults.point("trainer.sync", version)
        probe = self.backend.trainer.probe_logprobs(self.probe)  # every rank: a forward pass of the trainers
        if self.env.rank == 0 and probe is not None:
            write_probe(self.paths, version, self.probe, probe)
        writer = PolicyWriter(export_to, self.format, version) if export_to is not None and self.env.rank == 0 else None
        while True:
            weights = self.format.export(self.backend)
            if writer is not None:
                weights = _tee(weights, writer.add)
            outcome = self._broadcast(weights, version)
            for _ in weights:  # finish the export (under FSDP2 a collective of the trainers) if the send stopped early
                pass
            if writer is not None:
                writer.close()
                writer = None
            if not self._agree_to_send_again(outcome is _AGAIN):
                break
        if outcome is None or outcome is _AGAIN:
            return 0.0, None
        transfer, gaps = outcome
        return transfer.waited_s, self._judge(version, gaps)

    def _broadcast(self, weights, version: int):
        """Rank 0: the fleet's outcome ((transfer, gaps), or _AGAIN after a loss); None elsewhere, or
        when the run is stopping."""
        if self.fleet is None:
            return None
        try:
            outcome = self.fleet.send(weights, version=version, kind=self.format.name, step=version)
        except WeightSyncError:
            if not self.stop.requested:
                raise
            # SIGTERM reached the generators too and they left mid-broadcast; the checkpoint about
            # to be written holds this version, and they receive it from there when the run resumes.
            log.warning("generators left during the broadcast of version %d: stopping", version)
            return None
        except FleetTooSmall as err:
            self.stop.request(str(err), requeue=True)
            return None
        return _AGAIN if outcome is None else outcome

    def _agree_to_send_again(self, again: bool) -> bool:
        """Whether rank 0 must send this version again (collective: every rank exports it again). A
        stop (a signal, or too few engines: `stop.request`) takes effect at the loop's next safe
        point, where the ranks agree on it with the steps done counted right."""
        flag = torch.tensor([int(again)])
        if self.env.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _judge(self, version: int, gaps: dict[int, float]) -> list[float] | None:
        """Each engine's gap (the largest over its TP workers), in engine order; beyond
        generator.max_logprob_gap, stop naming who. None when no probe was scored (a backend that
        scores none reports nan)."""
        gaps = {rank: gap for rank, gap in gaps.items() if gap == gap}
        if not gaps:
            return None
        worst = max(gaps, key=gaps.get)
        engine_of = self.fleet.engine_of
        check_gap(version, gaps[worst], f"sync rank {worst} (generator {engine_of(worst)})",
                  self.config.generator.max_logprob_gap)
        engines: dict[int, float] = {}
        for rank, gap in gaps.items():
            engines[engine_of(rank)] = max(gap, engines.get(engine_of(rank), 0.0))
        return [engines[engine] for engine in sorted(engines)]


_AGAIN = object()


def _tokenizer(model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)


def host_fleet(env: RoleEnv, paths: RunPaths, config, stop: StopFlag) -> Fleet:
    return Fleet(paths, config, address=socket.gethostbyname(env.trainer_host), attempt=env.attempt,
                 backend=sync_backend(), stopping=lambda: stop.requested)


def _tee(weights, add):
    """`weights` (a TensorStream keeps its specs) with `add(name, tensor)` called on each as it passes."""

    def passing():
        for name, tensor in weights:
            add(name, tensor)
            yield name, tensor

    return TensorStream(weights.specs, passing()) if isinstance(weights, TensorStream) else passing()
