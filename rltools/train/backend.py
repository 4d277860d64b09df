"""The trainer backend interface (`trainer.backend`): what the role loop and the publisher call.

Invariant: the loop sees only a `Backend`: one trainer rank's model and its Trainer, and how this
backend exports the weights (HF names) or adapters (PEFT names) and saves or loads a checkpoint —
the same names, shapes and checkpoint layout whichever backend built them, so a checkpoint written
by one resumes on the other. Backends are chosen by name in `rltools.train.backends`.
"""

import abc
from pathlib import Path
from types import ModuleType
from typing import ClassVar, Iterable

import torch

from .trainer import Trainer

Tensors = Iterable[tuple[str, torch.Tensor]]


class Backend(abc.ABC):
    def __init__(self, model: torch.nn.Module, trainer: Trainer, rank: int):
        self.model, self.trainer, self.rank = model, trainer, rank

    @classmethod
    @abc.abstractmethod
    def build(cls, config, env, trainer_args: dict) -> "Backend":
        """The policy and its Trainer on this trainer rank (the trainers' process group exists)."""

    @abc.abstractmethod
    def export_weights(self, lora_scale: float | None, modules: frozenset[str] | None = None) -> Tensors:
        """(HF name, full tensor) of every weight, LoRA merged in with `lora_scale`; with `modules`, only
        the weights of the modules so named (`fused_layers.module_of`). A collective: every trainer
        rank iterates it."""

    @abc.abstractmethod
    def export_adapter(self) -> Tensors:
        """(PEFT name, full tensor) of every LoRA weight, as in a saved PEFT adapter; a collective."""

    checkpoints: ClassVar[ModuleType]
    """The backend's `save(paths, step, model, optimizer, *, rank, keep)` and `load(...)`, which map
    its model onto the one checkpoint layout (rltools.train.checkpoints): the trainable weights and
    their AdamW state; the step in its meta is the learning-rate schedule's clock."""

    def save(self, paths, step: int, keep: int) -> Path:
        """Checkpoint after `step` steps (model and optimizer), keeping the newest `keep`; a collective."""
        return self.checkpoints.save(paths, step, self.model, self.trainer.optimizer, rank=self.rank, keep=keep)

    def load(self, paths, step: int) -> dict:
        """Restore the checkpoint of `step` and the learning-rate schedule's clock (the steps it holds:
        `lr_schedule` needs nothing else); returns its meta; a collective."""
        meta = self.checkpoints.load(paths, step, self.model, self.trainer.optimizer, rank=self.rank)
        self.trainer.steps_done = meta["step"]
        return meta

    @abc.abstractmethod
    def load_adapter(self, tensors: dict[str, torch.Tensor]) -> None:
        """Set the LoRA adapters from `tensors` (PEFT name as in a saved adapter -> full tensor, e.g.
        adapter_model.safetensors as `train.loop.init_adapters` reads it); adapters it has no tensor
        for keep their values. Each rank keeps its part; a KeyError or ValueError names a tensor the
        model cannot take."""
