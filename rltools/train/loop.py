"""The trainer role: wait for a step's rollouts, update the policy, broadcast the new weights.

Reads top to bottom. Trainer rank 0 owns the step counter, metrics.jsonl and the experiment trackers
(`rltools.tracking`), and hosts the weight-sync group; every trainer rank trains (FSDP2 when there
are several) and takes part in gathering the full weights before rank 0 broadcasts policy version
step+1. A stop signal, from the first instant of the process on, ends the run at a checkpoint of the
steps done.
"""

import json
import logging
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from .. import completions, policy_exports
from ..adapter_init import check_init_adapter
from ..config import load_config
from ..config.schema import LoraConfig
from ..durable import atomic_write
from ..metrics import append_metrics, resume_metrics
from ..paths import RunPaths
from ..rollout import RolloutBatch, RolloutStore
from ..runtime import faults
from ..runtime.address import publish_address, wait_for_address
from ..runtime.preempt import EXIT_STOPPED, StopFlag, Stopped, requeue
from ..runtime.role_env import RoleEnv
from ..runtime.roles import eval_due, gpu_index, sends_start_policy, slots
from ..tracking.trackers import Trackers
from ..weight_formats import ADAPTER_WEIGHTS
from ..weight_sync import bound_store
from . import checkpoints
from .backend import Backend
from .backends import build_backend
from .fleet import Fleet, FleetTooSmall
from .publish import Publisher
from .samples import StepSamples

log = logging.getLogger("rltools.trainer")


def run_trainer(run_dir: str) -> int:
    """Train from the latest checkpoint (or the start) to schedule.steps; returns the exit code:
    0 when done, EXIT_STOPPED after a stop signal (with a checkpoint of the steps done)."""
    env = RoleEnv.from_environ()
    paths = RunPaths(run_dir)
    config = load_config(paths.config)
    stop = StopFlag(config.cluster.preempt_signal)  # keeps a signal that arrived while the process started
    torch.manual_seed(config.run.seed)
    device = trainer_device(env.local_rank)
    try:
        init_trainer_group(env, paths, timeout_s=config.trainer.sync_timeout_s, device=device)
        backend = build_backend(config, env, device, _pad_id(config.model.path))  # trainer.backend: fsdp2 | megatron
        store = RolloutStore(paths, paths.read_run_id(), keep_steps=config.schedule.keep_rollout_steps)
        return train(env, paths, config, backend, store, stop)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def train(env: RoleEnv, paths: RunPaths, config, backend: Backend, store: RolloutStore, stop: StopFlag) -> int:
    """Resume, then train to schedule.steps; on a stop signal, checkpoint the steps done."""
    done = checkpointed = resume(env, paths, config, backend, store)
    trackers = Trackers.start(config.trackers, paths, config.run.name, done) if env.rank == 0 else Trackers()
    schedule = config.schedule
    try:
        _agree_to_stop(stop, env)  # a warning during start-up: requeue now rather than start a step
        publisher = Publisher(env, paths, config, backend, stop)
        samples = StepSamples(paths, config.run.samples_per_step if env.rank == 0 else 0, config.run.seed,
                              config.model.path)  # rank 0 keeps a readable sample of each step
        if sends_start_policy(config, done):
            publisher.send(done)  # generators take the checkpoint's (or lora.init_from's) weights before generating
        stop.starting = False  # from here on a signal is answered with a checkpoint
        for step in range(done, schedule.steps):
            begin = time.perf_counter()
            batch = wait_for_rollouts(env, store, step, range(slots(config)),
                                      schedule.rollout_timeout_s, stop, publisher.fleet)
            staleness = step - batch.policy_version
            if not 0 <= staleness <= schedule.max_staleness:
                raise RuntimeError(f"step {step}: rollouts of policy version {batch.policy_version} exceed "
                                   f"schedule.max_staleness {schedule.max_staleness}")
            waited = time.perf_counter() - begin
            faults.point("trainer.train", step)
            metrics = backend.trainer.step(batch)
            trained = time.perf_counter() - begin - waited
            export = eval_due(config, step + 1)  # the evaluated policies stay loadable by `rltools eval`
            sync_wait, gaps = publisher.send(step + 1, export_to=paths.policy_dir(step + 1) if export else None)
            # At eval steps the sync includes writing the export; sync_wait_s is the part the generators
            # kept it waiting (rank 0 evaluates the previous version before it takes this one).
            synced = time.perf_counter() - begin - waited - trained - sync_wait
            done = step + 1
            if env.rank == 0:
                if export:
                    policy_exports.prune_full_exports(paths, config.eval.keep_full_exports)
                tokens = int(batch.completion_offsets[-1])
                fleet = publisher.fleet.trained(step, batch.slot_sizes)
                reassigned = sum(batch.slot_sizes[slot] for slot in fleet.covered(step))
                record = {**metrics, "step": step, "staleness": staleness, "samples": len(batch),
                          "engines": len(fleet.live), "reassigned_samples": reassigned,
                          "prompts_drawn": batch.prompts_drawn, "reward_failures": batch.reward_failures,
                          **batch.score_metrics(),
                          **({"logprob_gap": max(gaps), "logprob_gap_engines": gaps} if gaps else {}),
                          "generated_tokens": tokens, "gen_tokens_per_s": _rate(tokens, batch),
                          "generation_s": batch.generation_seconds, "wait_s": waited,
                          "training_s": trained, "sync_s": synced, "sync_wait_s": sync_wait, "time": time.time()}
                append_metrics(paths, record)
                trackers.log_step(record)  # and the evaluations the generators wrote since
                log.info("step %d/%d: loss %.4f grad norm %.3f reward %.3f kl %.4f entropy %.3f | wait %.2fs "
                         "train %.2fs sync %.2fs, generators busy %.2fs", done, schedule.steps, metrics["loss"],
                         metrics["grad_norm"], metrics["reward_mean"], metrics["kl"], metrics["entropy"], waited,
                         trained, synced, sync_wait)
                kept = samples.write(step, batch, backend.trainer.advantages, fleet.slots(step))
                if kept:
                    trackers.table("samples", kept, done)  # the step's kept completions, readable in the tracker
            if done % schedule.checkpoint_every == 0 or done == schedule.steps:
                backend.save(paths, done, keep=schedule.keep_checkpoints)
                checkpointed = done
            if env.rank == 0:  # one deleter: two ranks removing the same directory race (FileNotFoundError)
                store.prune(consumed_through=step, checkpointed_through=checkpointed - 1)
    except Stopped as signal_name:
        trackers.close("stopped")
        return stop_at_checkpoint(env, paths, config, backend, done, str(signal_name), stop.is_warning)
    except BaseException:
        trackers.close("failed")
        raise
    # the generators evaluate the final policy after this broadcast: the trackers get it within a deadline
    trackers.wait_for_eval(schedule.steps, config.trackers.final_eval_timeout_s, give_up=lambda: stop.requested)
    trackers.close("finished")
    return 0


def _rate(tokens: int, batch: RolloutBatch) -> float:
    return tokens / batch.generation_seconds if batch.generation_seconds else 0.0


def resume(env: RoleEnv, paths: RunPaths, config, backend: Backend, store: RolloutStore) -> int:
    """Load the newest checkpoint that verifies, if any; returns the steps it holds (0: a fresh start,
    whose adapters come from lora.init_from when it is set).

    Trainer rank 0 first deletes what a crash left behind (unfinished checkpoints), sets damaged
    checkpoints aside, and, once the checkpoint is known, drops the metrics, evaluations and kept
    completions of steps it does not contain and the shards the resumed run may not use."""
    if env.rank == 0:
        for debris in checkpoints.clean_incomplete(paths):
            log.warning("deleted %s: an interrupted checkpoint", debris)
        start, notes = checkpoints.resume_point(paths)
        for note in notes:
            log.warning("%s", note)
        if notes:
            log.warning("resuming from %s instead", paths.checkpoint_dir(start) if start else "step 0 (no good checkpoint)")
    checkpoints.barrier()
    start = paths.latest_checkpoint()
    if start:
        backend.load(paths, start)
        log.info("resumed from %s: %d of %d steps done", paths.checkpoint_dir(start), start, config.schedule.steps)
    elif config.lora.init_from is not None:
        init_adapters(config.lora, backend)
    if env.rank == 0:
        resume_metrics(paths, start)
        completions.drop_after(paths, start)
        policy_exports.drop_after(paths, start)
        discarded = store.discard_unusable(start, config.schedule.max_staleness)
        if discarded:
            log.info("discarded %d rollout shard(s) the resumed run may not use", len(discarded))
        # What the launcher announced was the newest checkpoint: this is the one loaded (`Progress`,
        # status). Written after the metrics are cut back to it: a metrics.jsonl newer than this
        # file has a step trained by this start (the job script asks, when every engine is gone).
        atomic_write(paths.resumed, json.dumps({"step": start, "set_aside": notes, "time": time.time()}))
    checkpoints.barrier()
    return start


def init_adapters(lora: LoraConfig, backend: Backend) -> None:
    """Step 0 of a run with lora.init_from: its adapters start from that PEFT adapter (checked again
    here as `submit` checked it: the job may see another file than the login node did)."""
    from safetensors.torch import load_file

    check_init_adapter(lora)
    backend.load_adapter(load_file(str(Path(lora.init_from) / ADAPTER_WEIGHTS)))
    log.info("adapters initialised from %s", lora.init_from)


def wait_for_rollouts(env: RoleEnv, store: RolloutStore, step: int, slots, timeout_s: float, stop: StopFlag,
                      fleet: Fleet | None = None):
    """Step `step`'s rollouts (a shard per slot), or Stopped on every trainer rank when a stop signal
    arrived or too few generator engines are left.

    Trainer rank 0 alone waits (giving up on a signal, and handing a lost engine's slots to the
    others: `fleet`); then all ranks agree in one collective whether to stop, so they stop at the
    same step even if the signal reached them apart."""
    batches = None
    if env.rank == 0:
        def check():
            stop.check()
            if fleet is not None:
                fleet.check(step)

        try:
            batches = store.wait(step, slots, timeout_s, check=check)
        except Stopped:
            pass
        except FleetTooSmall as err:
            stop.request(str(err), requeue=True)
    _agree_to_stop(stop, env)
    return RolloutBatch.concat(batches if batches is not None else store.wait(step, slots, timeout_s))


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
    """The end of a stopped run: checkpoint the steps done, requeue after the warning signal (also
    when it came during start-up, with nothing new to checkpoint)."""
    if paths.latest_checkpoint() < done:
        backend.save(paths, done, keep=config.schedule.keep_checkpoints)
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


def trainer_device(local_rank: int) -> torch.device:
    """This trainer's device, made current (FSDP2 places parameters on the current CUDA device, and
    the weight-sync group of trainer rank 0 uses it): see `runtime.roles.gpu_index` for the layouts."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", gpu_index(local_rank, torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES")))
    torch.cuda.set_device(device)
    return device


def init_trainer_group(env: RoleEnv, paths: RunPaths, timeout_s: float, device: torch.device) -> None:
    """The trainers' own process group (FSDP2), separate from the weight-sync group; on GPUs bound to
    this rank's device (`device_id`: NCCL's communicator is created for it, not guessed)."""
    if env.world_size == 1:
        return
    # CPU tensors travel too (the stop agreement, metrics averages): gloo beside NCCL on GPUs
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if env.rank == 0:
        host = socket.gethostbyname(env.trainer_host)
        store = bound_store(host, timeout)
        publish_address(paths.trainer_address, host, store.port, env.attempt)
    else:
        host, port = wait_for_address(paths.trainer_address, env.attempt, timeout_s, "trainer rank 0")
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)


def _pad_id(model_path: str) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
