"""`trainer.backend: megatron` for the role loop: every trainer rank is one TP rank of one model."""

import torch

from ...errors import UserError
from ..backend import Backend
from . import checkpoint
from .model import check_supported, export_adapter, export_weights, init_parallel, load_megatron_policy
from .trainer import MegatronTrainer


def build(config, env, trainer_args: dict) -> Backend:
    from transformers import AutoConfig

    t = config.trainer
    hf_config = AutoConfig.from_pretrained(config.model.path, local_files_only=True)
    check_supported(config.model, config.lora, hf_config, t.tensor_parallel, t.pipeline_parallel, t.expert_parallel,
                    env.world_size)
    _require_cuda()
    init_parallel(t.tensor_parallel, config.run.seed)
    policy = load_megatron_policy(config.model, config.lora).to(trainer_args["device"])
    # no data parallelism: every rank trains on the whole step (Trainer rank 0 of 1)
    trainer = MegatronTrainer(policy, config.algorithm, rank=0, world_size=1, **trainer_args)
    return Backend(policy, trainer, export_weights, export_adapter, checkpoint.save, checkpoint.load)


def _require_cuda() -> None:
    """megatron-core places tensors on `torch.cuda.current_device()`; say so before it fails deep inside."""
    try:
        torch.cuda.current_device()
    except (AssertionError, RuntimeError) as error:
        raise UserError(
            "trainer.backend: megatron needs CUDA GPUs: megatron-core does not run on CPU "
            f"({error}); use trainer.backend: fsdp2 on CPU machines"
        ) from None
