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
    its model onto the one checkpoint layout (rltools.train.checkpoints)."""

    def save(self, paths, step: int, keep: int) -> Path:
        """Checkpoint after `step` steps (model and optimizer), keeping the newest `keep`; a collective."""
        return self.checkpoints.save(paths, step, self.model, self.trainer.optimizer, rank=self.rank, keep=keep)

    def load(self, paths, step: int) -> dict:
        """Restore the checkpoint of `step`; returns its meta; a collective."""
        return self.checkpoints.load(paths, step, self.model, self.trainer.optimizer, rank=self.rank)
