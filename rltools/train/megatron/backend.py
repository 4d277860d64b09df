"""`trainer.backend: megatron` for the role loop: trainer ranks form data-parallel replicas of
`trainer.tensor_parallel` x `trainer.pipeline_parallel` ranks each; a MoE model's routed experts are
spread over `trainer.expert_parallel` ranks of each pipeline stage."""

import torch

from ...errors import UserError
from ..backend import Backend, Tensors
from . import checkpoints
from .model import export_adapter, export_weights, load_adapter, load_megatron_policy
from .parallel import init_parallel
from .support import check_supported
from .trainer import MegatronTrainer


class MegatronBackend(Backend):
    checkpoints = checkpoints

    @classmethod
    def build(cls, config, env, trainer_args: dict) -> "MegatronBackend":
        from transformers import AutoConfig

        t = config.trainer
        hf_config = AutoConfig.from_pretrained(config.model.path, local_files_only=True)
        check_supported(config, hf_config, env.world_size)
        _require_cuda()
        init_parallel(t.tensor_parallel, t.pipeline_parallel, config.run.seed, t.expert_parallel)
        from megatron.core import parallel_state

        policy = load_megatron_policy(config.model, config.lora, t.gradient_checkpointing).to(trainer_args["device"])
        # the TP and PP ranks of one replica train on the same samples: the Trainer splits the step data-parallel
        trainer = MegatronTrainer(policy, config.algorithm, rank=parallel_state.get_data_parallel_rank(),
                                  world_size=parallel_state.get_data_parallel_world_size(), **trainer_args)
        return cls(policy, trainer, env.rank)

    def export_weights(self, lora_scale: float | None, modules: frozenset[str] | None = None) -> Tensors:
        return export_weights(self.model, lora_scale, modules)

    def export_adapter(self) -> Tensors:
        return export_adapter(self.model)

    def load_adapter(self, tensors) -> None:
        load_adapter(self.model, tensors)


def _require_cuda() -> None:
    """megatron-core places tensors on `torch.cuda.current_device()`; say so before it fails deep inside."""
    try:
        torch.cuda.current_device()
    except (AssertionError, RuntimeError) as error:
        raise UserError(
            "trainer.backend: megatron needs CUDA GPUs: megatron-core does not run on CPU "
            f"({error}); use trainer.backend: fsdp2 on CPU machines"
        ) from None
