"""NVFP4Linear: a frozen linear layer that keeps its weight packed (4.5 bits per parameter) and
dequantises it on the fly in forward; and the loading of an HF model with such layers.

Invariants:
- The packed weight and block scales are frozen parameters (requires_grad False: no gradient, not
  in the optimizer) so that FSDP2 shards them like any weight — each rank holds 1/N of the packed
  base at rest and gathers one layer at a time; the one-element global scale is a buffer. All are
  named as in the checkpoint (`weight_packed`, `weight_scale`, `weight_global_scale`), so the state
  dict loads and exports without renaming.
- Forward computes with `nvfp4.dequantize(...)` cast to the input's dtype: the same values the CPU
  generator is given (`checkpoint.write_dequantized`).
- LoRA goes on top through peft (`lora_custom_modules`): peft wraps any module that has
  `in_features` / `out_features` and calls it as its base layer.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .layout import QUANT_SUFFIXES
from .nvfp4 import BLOCK, dequantize


class NVFP4Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight_packed = _frozen(torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.weight_scale = _frozen(torch.zeros(out_features, in_features // BLOCK, dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_global_scale", torch.ones(1, dtype=torch.float32, device=device))
        self.bias = _frozen(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    @property
    def qweight(self) -> torch.Tensor:
        """peft finds a quantised base layer's device through `qweight` (as for GPTQ layers)."""
        return self.weight_packed

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.weight_packed, self.weight_scale, self.weight_global_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized_weight(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, nvfp4"


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def load_nvfp4_model(model_path: str, dtype: torch.dtype) -> nn.Module:
    """The HF causal LM of `model_path` with its quantised linears as NVFP4Linear (the checkpoint's,
    or quantised now if `model_path` is a plain checkpoint: see `checkpoint.load_nvfp4_state`)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from .nvfp4_checkpoint import load_nvfp4_state

    state = dict(load_nvfp4_state(model_path))
    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # we load the packed tensors ourselves; transformers must not
    with init_empty_weights():  # parameters on the meta device (no dense base in memory), buffers real
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    quantized = {name.rsplit(".", 1)[0] for name in state if name.endswith(".weight_packed")}
    for name in quantized:
        parent, _, leaf = name.rpartition(".")
        old = model.get_submodule(name)
        setattr(model.get_submodule(parent), leaf, NVFP4Linear(old.in_features, old.out_features, old.bias is not None, dtype=dtype))
    dense = {n: (t if n.rsplit(".", 1)[-1] in QUANT_SUFFIXES else t.to(dtype)) for n, t in state.items()}
    missing, unexpected = model.load_state_dict(dense, strict=False, assign=True)
    if unexpected or [m for m in missing if not _tied(model, m)]:
        raise ValueError(f"{model_path}: checkpoint does not match the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    assert not any(p.is_meta for p in model.parameters()), "a parameter was left on the meta device"
    model.requires_grad_(False)  # the base is frozen: LoRA adapters (added after) are the only trainables
    return model


def _tied(model: nn.Module, name: str) -> bool:
    return name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False)


def lora_custom_modules() -> dict:
    """peft's custom-module mapping: NVFP4Linear gets peft's own LoRA Linear wrapper."""
    import warnings

    from peft.tuners.lora.layer import Linear as LoraLinear

    # peft warns about every custom layer type; this one is tested (tests/integration/test_nvfp4.py).
    warnings.filterwarnings("ignore", message="Unsupported layer type .*NVFP4Linear")
    return {NVFP4Linear: LoraLinear}
