"""What a trainer checkpoint changes in its base model, read from the checkpoint's DCP files alone.

Both backends write the one checkpoint layout (`train.checkpoints`; Megatron's under the FSDP2
backend's peft names), so what is read here does not depend on the backend that trained.

Invariants:
- With LoRA, the checkpoint's adapters are read whole (they are small) and nothing else: the
  optimizer state and the frozen base are never read. `LoraDeltas` adds W' = W + (alpha / rank) B A
  in float32, cast back to W's dtype, as the trainer's merged weight sync computes it
  (`train.model.export_weights`).
- Without LoRA (a full fine-tune) every weight trained and the checkpoint holds each: `TrainedWeights`
  reads one when the base's tensor of that name passes, so memory holds one weight at a time.
- Each change is applied once; `missing` names what the base never offered a place for, and the
  writer refuses to finish with any (an export that silently drops a trained weight is a lie).
"""

from pathlib import Path

import torch

from ..errors import UserError
from ..train.checkpoints import read_saved, saved_weights
from ..train.model import adapter_name

PEFT_PREFIX = "base_model.model."


def adapter_tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's LoRA weights under the names of a saved PEFT adapter (`...q_proj.lora_A.weight`)."""
    shapes = saved_weights(checkpoint)
    names = [name for name in shapes if adapter_name(name)]
    if not names:
        raise UserError(f"{checkpoint} holds no LoRA adapters (its run trained every weight: lora.enabled false); "
                        "export it with --format merged")
    return {adapter_name(name): tensor for name, tensor in read_saved(checkpoint, names, shapes).items()}


class LoraDeltas:
    """The merged weights of a LoRA policy: `apply(name, tensor)` adds the delta of the module whose
    weight `name` is (HF checkpoint names); other tensors pass unchanged."""

    def __init__(self, adapters: dict[str, torch.Tensor], scale: float):
        self.scale, self.pairs = scale, {}
        for name, tensor in adapters.items():
            stem, matrix = name.removesuffix(".weight").rsplit(".lora_", 1)
            self.pairs.setdefault(stem.removeprefix(PEFT_PREFIX), {})[matrix] = tensor
        self.applied: set[str] = set()

    def modules(self) -> set[str]:
        return set(self.pairs)

    def apply(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        module = name.removesuffix(".weight")
        pair = self.pairs.get(module) if name.endswith(".weight") else None
        if pair is None:
            return tensor
        if not tensor.is_floating_point() or tensor.element_size() == 1:
            raise UserError(f"{name} is stored as {tensor.dtype}: a LoRA delta cannot be merged into it (an NVFP4 or FP8 "
                            "base is dequantised first only under model.quantization: nvfp4)")
        self.applied.add(module)
        merged = tensor.float()  # in place when it is float32 already: no second copy of the weight
        return merged.addmm_(pair["B"].float(), pair["A"].float(), alpha=self.scale).to(tensor.dtype)

    def missing(self) -> list[str]:
        return sorted(set(self.pairs) - self.applied)


class TrainedWeights:
    """The weights of a full fine-tune: `apply(name, tensor)` returns the checkpoint's weight of that
    name (cast to the base tensor's dtype), read when asked for; tensors it never trained (buffers such
    as a router's score correction bias) pass unchanged."""

    def __init__(self, checkpoint: Path):
        self.checkpoint, self.shapes = checkpoint, saved_weights(checkpoint)
        self.applied: set[str] = set()

    def modules(self) -> set[str]:
        return {name.removesuffix(".weight") for name in self.shapes}

    def apply(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name not in self.shapes:
            return tensor
        (trained,) = read_saved(self.checkpoint, [name], self.shapes).values()
        if tuple(trained.shape) != tuple(tensor.shape):
            raise UserError(f"{self.checkpoint}: {name} has shape {tuple(trained.shape)}, the base model's "
                            f"{tuple(tensor.shape)}: the checkpoint is not of this run's model.path")
        self.applied.add(name)
        return trained.to(tensor.dtype)

    def missing(self) -> list[str]:
        return sorted(set(self.shapes) - self.applied)


def policy_changes(checkpoint: Path, lora) -> LoraDeltas | TrainedWeights:
    """What the checkpoint changes in the base: its adapters (`lora`: the run's LoraConfig) or its weights."""
    if lora.enabled:
        return LoraDeltas(adapter_tensors(checkpoint), lora.alpha / lora.rank)
    return TrainedWeights(checkpoint)
