"""`trainer.backend: fsdp2`: a Hugging Face model (with peft adapters), sharded data-parallel by
FSDP2 over two or more trainer ranks; one rank runs it unsharded."""

from . import checkpoints
from .backend import Backend, Tensors
from .model import export_adapter, export_weights, load_adapter, load_policy
from .trainer import Trainer


class FSDP2Backend(Backend):
    checkpoints = checkpoints

    @classmethod
    def build(cls, config, env, trainer_args: dict) -> "FSDP2Backend":
        # Built on the meta device and sharded there: each rank allocates and reads only its shard.
        model = load_policy(config.model, config.lora, config.trainer.gradient_checkpointing,
                            device=trainer_args["device"], shard=env.world_size > 1)
        trainer = Trainer(model, config.algorithm, rank=env.rank, world_size=env.world_size, **trainer_args)
        return cls(model, trainer, env.rank)

    def export_weights(self, lora_scale: float | None, modules: frozenset[str] | None = None) -> Tensors:
        return export_weights(self.model, lora_scale, modules)

    def export_adapter(self) -> Tensors:
        return export_adapter(self.model)

    def load_adapter(self, tensors) -> None:
        load_adapter(self.model, tensors)
