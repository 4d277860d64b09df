"""The trainer role: wait for a step's rollouts, update the policy, broadcast the new weights.

Reads top to bottom. Trainer rank 0 owns the step counter and metrics.jsonl, and hosts the
weight-sync group; every trainer rank trains (FSDP2 when there are several) and takes part in
gathering the full weights before rank 0 broadcasts policy version step+1.
"""

import logging
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from .. import checkpoint
from ..config import load_config
from ..eval.checkpoints import PolicyWriter, prune_full_exports
from ..launch.address import publish_address, wait_for_address
from ..launch.role_env import RoleEnv
from ..metrics import append_metrics, resume_metrics
from ..paths import RunPaths
from ..preempt import EXIT_STOPPED, StopFlag, Stopped, requeue
from ..roles import eval_due, sync_backend, sync_world_size
from ..rollout import RolloutBatch, RolloutStore
from ..weight_sync import TensorStream, WeightSyncError
from .backend import Backend, build_backend

log = logging.getLogger("rltools.trainer")


def run_trainer(run_dir: str) -> int:
    """Train from the latest checkpoint (or the start) to schedule.steps; returns the exit code:
    0 when done, EXIT_STOPPED after a stop signal (with a checkpoint of the steps done)."""
    env = RoleEnv.from_environ()
    paths = RunPaths(run_dir)
    config = load_config(paths.config)
    stop = StopFlag(config.cluster.preempt_signal)
    torch.manual_seed(config.run.seed)
    device = torch.device(f"cuda:{env.local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    init_trainer_group(env, paths, timeout_s=config.generator.sync_timeout_s)
    backend = build_backend(config, env, device, _pad_id(config.model.path))  # trainer.backend: fsdp2 | megatron
    model, trainer = backend.model, backend.trainer
    store = RolloutStore(paths, paths.read_run_id(), keep_steps=config.schedule.keep_rollout_steps)
    start = resume(env, paths, config, backend, store)
    # after resume(): generators join only now, so they never see shards or checkpoints in flux
    sender = host_weight_sync(env, paths, config) if env.rank == 0 else None
    lora_scale = config.lora.alpha / config.lora.rank if config.lora.enabled else None
    kind = config.generator.weight_sync

    def send(version: int, export_to: Path | None = None) -> None:
        """Broadcast `version`'s weights (collective: every trainer rank takes part in the export);
        with `export_to`, rank 0 also writes them there as a policy export while they pass."""
        weights = backend.export_adapter(model) if kind == "lora" else backend.export_weights(model, lora_scale)
        writer = None
        if export_to is not None and env.rank == 0:
            writer = PolicyWriter(export_to, kind, config.model.path, config.lora, version)
            weights = _tee(weights, writer.add)
        if sender is None:
            for _ in weights:
                pass
        else:
            try:
                sender.broadcast(weights, version=version, kind=kind)
            except WeightSyncError:
                if not stop.requested:
                    raise
                # SIGTERM reached the generators too and they left mid-broadcast; the checkpoint about
                # to be written holds this version, and they receive it from there when the run resumes.
                log.warning("generators left during the broadcast of version %d: stopping", version)
                for _ in weights:  # finish the export: under FSDP2 it is a collective of the trainers
                    pass
        if writer is not None:
            writer.close()

    if start:
        send(start)  # generators take the checkpoint's weights before generating anything
    generator_ranks = list(range(config.cluster.generators.ntasks))
    done = checkpointed = start
    try:
        for step in range(start, config.schedule.steps):
            begin = time.perf_counter()
            batch = wait_for_rollouts(env, store, step, generator_ranks, config.schedule.rollout_timeout_s, stop)
            staleness = step - batch.policy_version
            if not 0 <= staleness <= config.schedule.max_staleness:
                raise RuntimeError(
                    f"step {step}: rollouts of policy version {batch.policy_version} exceed schedule.max_staleness "
                    f"{config.schedule.max_staleness}"
                )
            waited = time.perf_counter() - begin
            metrics = trainer.step(batch)
            trained = time.perf_counter() - begin - waited
            export = eval_due(config, step + 1)  # the evaluated policies stay loadable by `rltools eval`
            send(step + 1, export_to=paths.policy_dir(step + 1) if export else None)
            synced = time.perf_counter() - begin - waited - trained  # at eval steps: with the export written
            done = step + 1
            if export and env.rank == 0:
                prune_full_exports(paths, config.eval.keep_full_exports)
            if env.rank == 0:
                tokens = int(batch.completion_offsets[-1])
                metrics.update(
                    step=step,
                    staleness=staleness,
                    samples=len(batch),
                    generated_tokens=tokens,
                    gen_tokens_per_s=tokens / batch.generation_seconds if batch.generation_seconds else 0.0,
                    generation_s=batch.generation_seconds,
                    wait_s=waited,
                    training_s=trained,
                    sync_s=synced,
                    time=time.time(),
                )
                append_metrics(paths, metrics)
            if done % config.schedule.checkpoint_every == 0 or done == config.schedule.steps:
                backend.save(paths, done, model, trainer.optimizer, rank=env.rank, keep=config.schedule.keep_checkpoints)
                checkpointed = done
            if env.rank == 0:  # one deleter: two ranks removing the same directory race (FileNotFoundError)
                store.prune(consumed_through=step, checkpointed_through=checkpointed - 1)
    except Stopped as signal_name:
        return stop_at_checkpoint(env, paths, config, backend, done, str(signal_name), stop.is_warning)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def resume(env: RoleEnv, paths: RunPaths, config, backend: Backend, store: RolloutStore) -> int:
    """Load the latest valid checkpoint, if any; returns the steps it holds (0: a fresh start).

    Trainer rank 0 first deletes what a crash left behind: unfinished checkpoints, the metrics and
    evaluations of steps the checkpoint does not contain, and shards the resumed run may not use."""
    if env.rank == 0:
        for debris in checkpoint.clean_incomplete(paths):
            log.warning("deleted %s: an interrupted checkpoint", debris)
    checkpoint.barrier()
    start = paths.latest_checkpoint()
    if start:
        backend.load(paths, start, backend.model, backend.trainer.optimizer, rank=env.rank)
        log.info("resumed from %s: %d of %d steps done", paths.checkpoint_dir(start), start, config.schedule.steps)
    if env.rank == 0:
        resume_metrics(paths, start)
        discarded = store.discard_unusable(start, config.schedule.max_staleness)
        if discarded:
            log.info("discarded %d rollout shard(s) of policy versions the resumed run does not have", len(discarded))
    checkpoint.barrier()
    return start


def wait_for_rollouts(env: RoleEnv, store: RolloutStore, step: int, ranks, timeout_s: float, stop: StopFlag):
    """Step `step`'s rollouts, or Stopped on every trainer rank when a stop signal arrived.

    Trainer rank 0 alone waits (and gives up the wait on a signal); then all ranks agree in one
    collective whether to stop, so they stop at the same step even if the signal reached them apart."""
    batches = None
    if env.rank == 0:
        try:
            batches = store.wait(step, ranks, timeout_s, check=stop.check)
        except Stopped:
            pass
    _agree_to_stop(stop, env)
    return RolloutBatch.concat(batches if batches is not None else store.wait(step, ranks, timeout_s))


def _agree_to_stop(stop: StopFlag, env: RoleEnv) -> None:
    """Raise Stopped when any trainer rank got a stop signal (all ranks then stop at the same step)."""
    requested = stop.requested
    if env.world_size > 1:  # collective
        flag = torch.tensor([1 if requested else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        requested = bool(flag.item())
    if requested:
        raise Stopped(stop.received or "a peer's signal")


def stop_at_checkpoint(env, paths: RunPaths, config, backend: Backend, done: int, signal_name: str, warning: bool) -> int:
    """The end of a stopped run: checkpoint the steps done, requeue after the warning signal."""
    if paths.latest_checkpoint() < done:
        backend.save(paths, done, backend.model, backend.trainer.optimizer, rank=env.rank,
                     keep=config.schedule.keep_checkpoints)
    log.warning("stopped on %s after %d of %d steps; checkpoint %s", signal_name, done, config.schedule.steps,
                paths.checkpoint_dir(done))
    cluster = config.cluster
    if env.rank == 0 and warning and env.launcher == "slurm" and cluster.requeue:
        if env.restart_count < cluster.max_requeues:
            requeue(env.job_id)
        else:
            log.error("not requeued: the job restarted %d times already (cluster.max_requeues); resume it with "
                      "`rltools resume %s`", env.restart_count, paths.root)
    elif env.rank == 0:
        log.warning("resume with `rltools resume %s`", paths.root)
    return EXIT_STOPPED


def init_trainer_group(env: RoleEnv, paths: RunPaths, timeout_s: float) -> None:
    """The trainers' own process group (FSDP2), separate from the weight-sync group."""
    if env.world_size == 1:
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if env.rank == 0:
        host = socket.gethostbyname(env.trainer_host)
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        publish_address(paths.trainer_address, host, store.port, env.attempt)
    else:
        host, port = wait_for_address(paths.trainer_address, env.attempt, timeout_s, "trainer rank 0")
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)


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


def _pad_id(model_path: str) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def _tee(weights, add):
    """`weights` (a TensorStream keeps its specs) with `add(name, tensor)` called on each as it passes."""

    def passing():
        for name, tensor in weights:
            add(name, tensor)
            yield name, tensor

    return TensorStream(weights.specs, passing()) if isinstance(weights, TensorStream) else passing()
