"""The trainer backends by name: `trainer.backend` picks one here, and nowhere else.

Invariant: a backend's module is imported only when it is chosen (megatron-core is heavy and absent
from CPU installs); the names here are exactly the values the config accepts (a unit test holds it).
"""

import torch

from .backend import Backend


def _fsdp2() -> type[Backend]:
    from .fsdp2 import FSDP2Backend

    return FSDP2Backend


def _megatron() -> type[Backend]:
    from .megatron.backend import MegatronBackend

    return MegatronBackend


BACKENDS = {"fsdp2": _fsdp2, "megatron": _megatron}


def build_backend(config, env, device: torch.device, pad_id: int) -> Backend:
    """This trainer rank's `trainer.backend` (after the trainers' process group exists)."""
    trainer_args = dict(micro_batch_size=config.trainer.micro_batch_size, max_new_tokens=config.generator.max_new_tokens,
                        pad_id=pad_id, device=device, temperature=config.generator.temperature,
                        total_steps=config.schedule.steps)
    return BACKENDS[config.trainer.backend]().build(config, env, trainer_args)
