"""The trainer backends (`trainer.backend`) behind one interface: what the role loop needs.

Invariant: the loop sees only a `Backend`: the model and its Trainer, and the functions that export
its weights (HF names) or adapters (PEFT names) and save or load its checkpoints — the same shapes
and names whichever backend built them.
"""

from dataclasses import dataclass
from typing import Callable

import torch

from ..runtime.role_env import RoleEnv
from . import checkpoints
from .model import export_adapter, export_weights, load_policy, shard_model
from .trainer import Trainer


@dataclass
class Backend:
    model: torch.nn.Module
    trainer: Trainer
    export_weights: Callable  # (model, lora_scale) -> iterator of (HF name, full tensor); collective
    export_adapter: Callable  # (model) -> iterator of (PEFT name, full tensor); collective
    save: Callable  # as rltools.train.checkpoints.save
    load: Callable  # as rltools.train.checkpoints.load


def build_backend(config, env: RoleEnv, device: torch.device, pad_id: int) -> Backend:
    """The policy and its Trainer on this trainer rank (after the trainers' process group exists)."""
    trainer_args = dict(micro_batch_size=config.trainer.micro_batch_size, max_new_tokens=config.generator.max_new_tokens,
                        pad_id=pad_id, device=device, temperature=config.generator.temperature)
    if config.trainer.backend == "megatron":
        from .megatron.backend import build

        return build(config, env, trainer_args)
    model = load_policy(config.model, config.lora, config.trainer.gradient_checkpointing).to(device)
    if env.world_size > 1:
        shard_model(model)
    trainer = Trainer(model, config.algorithm, rank=env.rank, world_size=env.world_size, **trainer_args)
    return Backend(model, trainer, export_weights, export_adapter, checkpoints.save, checkpoints.load)
