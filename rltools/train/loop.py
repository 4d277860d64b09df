"""The trainer role: wait for a step's rollouts, update the policy, broadcast the new weights.

Reads top to bottom. Trainer rank 0 owns the step counter and metrics.jsonl, and hosts the
weight-sync group; every trainer rank trains (FSDP2 when there are several) and takes part in
gathering the full weights before rank 0 broadcasts policy version step+1.
"""

import json
import logging
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config import load_config
from ..eval.checkpoints import save_policy
from ..launch.address import publish_address, wait_for_address
from ..launch.role_env import RoleEnv
from ..paths import RunPaths
from ..roles import eval_due, sync_backend, sync_world_size
from ..rollout import RolloutBatch, RolloutStore
from .model import export_adapter, export_weights, load_policy, shard_model
from .trainer import Trainer

log = logging.getLogger("rltools.trainer")


def run_trainer(run_dir: str) -> None:
    env = RoleEnv.from_environ()
    paths = RunPaths(run_dir)
    config = load_config(paths.config)
    torch.manual_seed(config.run.seed)
    device = torch.device(f"cuda:{env.local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    init_trainer_group(env, paths, timeout_s=config.generator.sync_timeout_s)
    model = load_policy(config.model, config.lora).to(device)
    if env.world_size > 1:
        shard_model(model)
    trainer = Trainer(
        model,
        config.algorithm,
        micro_batch_size=config.trainer.micro_batch_size,
        max_new_tokens=config.generator.max_new_tokens,
        pad_id=_pad_id(config.model.path),
        device=device,
        rank=env.rank,
        world_size=env.world_size,
        temperature=config.generator.temperature,
    )
    sender = host_weight_sync(env, paths, config) if env.rank == 0 else None
    store = RolloutStore(paths, paths.read_run_id(), keep_steps=config.schedule.keep_rollout_steps)
    generator_ranks = list(range(config.cluster.generators.ntasks))
    lora_scale = config.lora.alpha / config.lora.rank if config.lora.enabled else None
    for step in range(config.schedule.steps):
        start = time.perf_counter()
        batch = RolloutBatch.concat(store.wait(step, generator_ranks, config.schedule.rollout_timeout_s))
        staleness = step - batch.policy_version
        if not 0 <= staleness <= config.schedule.max_staleness:
            raise RuntimeError(
                f"step {step}: rollouts of policy version {batch.policy_version} exceed schedule.max_staleness "
                f"{config.schedule.max_staleness}"
            )
        waited = time.perf_counter() - start
        metrics = trainer.step(batch)
        trained = time.perf_counter() - start - waited
        kind = config.generator.weight_sync
        # collective: every trainer rank iterates
        weights = export_adapter(model) if kind == "lora" else export_weights(model, lora_scale)
        export = eval_due(config, step + 1)  # the evaluated policies stay loadable by `rltools eval`
        if export:
            weights = list(weights)
        if sender is not None:
            sender.broadcast(weights, version=step + 1, kind=kind)
        else:
            for _ in weights:
                pass
        synced = time.perf_counter() - start - waited - trained
        if export and env.rank == 0:
            save_policy(paths.policy_dir(step + 1), weights, kind, config.model.path, config.lora, step + 1)
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
        store.prune(consumed_through=step, checkpointed_through=-1)  # no checkpoints yet: keep every step
    if dist.is_initialized():
        dist.destroy_process_group()


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


def append_metrics(paths: RunPaths, metrics: dict) -> None:
    with open(paths.metrics, "a") as f:
        f.write(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in metrics.items()}) + "\n")


def _pad_id(model_path: str) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
