"""NVFP4Linear: a frozen linear layer that keeps its weight packed (4.5 bits per parameter) and
dequantises it on the fly in forward; NVFP4Experts, the same for a MoE layer's routed experts;
FP8Linear, the same for an FP8 weight (the other linears of the mixed MoE layout); and the swap of
an HF model's layers for them (on the meta device: `train.model.load_policy` fills them).

Invariants:
- The packed weight and block scales are frozen parameters (requires_grad False: no gradient, not
  in the optimizer) so that FSDP2 shards them like any weight — each rank holds 1/N of the packed
  base at rest and gathers one layer at a time; the one-element global scale is a buffer. All are
  named as in the checkpoint (`weight_packed`, `weight_scale`, `weight_global_scale`), so the state
  dict loads and exports without renaming.
- Forward computes with `nvfp4.dequantize(...)` cast to the input's dtype: the same values the CPU
  generator is given (`checkpoint.write_dequantized`). The dense weight lives only while it is used:
  autograd keeps the packed tensors for backward and dequantises again there (`packed_linear`).
- NVFP4Experts holds the routed experts of one MoE layer as the checkpoint has them (one packed
  triple per expert and projection, stacked over the experts) and dequantises one expert's
  projection at a time, for the tokens routed to it: never a dense copy of all experts.
- LoRA goes on top through peft (`lora_custom_modules`): peft wraps any module that has
  `in_features` / `out_features` and calls it as its base layer.
"""

import re

import torch
import torch.nn.functional as F
from torch import nn

from .fp8 import dequantize_fp8
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
        out = packed_linear(x, self.weight_packed, self.weight_scale, self.weight_global_scale)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, nvfp4"


class _FrozenLinear(torch.autograd.Function):
    """x @ decode(*parts).T, the dense weight made in forward and again in backward: autograd saves
    the stored parts (resident anyway: the frozen base), not the dense weight, which would keep
    every layer's dense copy alive from forward until its backward."""

    @staticmethod
    def forward(ctx, x, decode, *parts):
        ctx.save_for_backward(*parts)
        ctx.decode, ctx.dtype = decode, x.dtype
        return F.linear(x, decode(*parts, dtype=x.dtype))

    @staticmethod
    def backward(ctx, grad):
        parts = ctx.saved_tensors  # once: under activation checkpointing a second unpack is an error
        nothing = (None,) * (1 + len(parts))
        if not ctx.needs_input_grad[0]:
            return (None, *nothing)
        return (grad @ ctx.decode(*parts, dtype=ctx.dtype), *nothing)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """F.linear(x, W) for the frozen NVFP4 weight W (no gradient for W; the gradient for x)."""
    return _FrozenLinear.apply(x, dequantize, packed, scale, global_scale)


class FP8Linear(nn.Module):
    """A frozen linear layer with an FP8 weight (one float32 scale per output row, `quant.fp8`), named
    as in the checkpoint (`weight`, `weight_scale`); computes like NVFP4Linear."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _frozen(torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn, device=device))
        self.weight_scale = _frozen(torch.ones(out_features, 1, dtype=torch.float32, device=device))
        self.bias = _frozen(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _FrozenLinear.apply(x, dequantize_fp8, self.weight, self.weight_scale)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, fp8"


EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_STACKED = re.compile(r"(.*\.experts)\.(gate_proj|up_proj|down_proj)_(weight_packed|weight_scale|weight_global_scale)")
_PER_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight_packed|weight_scale|weight_global_scale)")


class NVFP4Experts(nn.Module):
    """The routed experts of one MoE layer, packed: for each projection P of gate_proj, up_proj,
    down_proj, `P_weight_packed` [E, out, in/2], `P_weight_scale` [E, out, in/16] (frozen parameters,
    so FSDP2 shards them over the experts) and the buffer `P_weight_global_scale` [E, 1]: expert e's
    checkpoint triple `experts.e.P.weight_*` is row e. Computes as transformers' DeepseekV3Experts:
    each expert hit, in order, on the tokens routed to it (top-k slot first), its output scaled by the
    routing weight and summed in."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act_fn, device=None):
        super().__init__()
        self.num_experts, self.act_fn = num_experts, act_fn
        for projection, (out, inp) in zip(EXPERT_PROJECTIONS, ((intermediate, hidden),) * 2 + ((hidden, intermediate),)):
            self.register_parameter(f"{projection}_weight_packed", _frozen(
                torch.zeros(num_experts, out, inp // 2, dtype=torch.uint8, device=device)))
            self.register_parameter(f"{projection}_weight_scale", _frozen(
                torch.zeros(num_experts, out, inp // BLOCK, dtype=torch.float8_e4m3fn, device=device)))
            self.register_buffer(f"{projection}_weight_global_scale", torch.ones(num_experts, 1, device=device))

    def _project(self, projection: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        packed, scale, global_scale = (getattr(self, f"{projection}_{leaf}")[expert] for leaf in QUANT_SUFFIXES)
        return packed_linear(x, packed, scale, global_scale)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for expert in torch.unique(top_k_index).tolist():
            slot, token = torch.where(top_k_index.T == expert)
            x = hidden_states[token]
            y = self._project("down_proj", expert, self.act_fn(self._project("gate_proj", expert, x))
                              * self._project("up_proj", expert, x))
            out.index_add_(0, token, (y * top_k_weights[token, slot, None]).to(out.dtype))
        return out

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, nvfp4"


def unstack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """NVFP4Experts' stacked tensors under the checkpoint's per-expert names (`...experts.3.gate_proj.weight_packed`)."""
    out = {}
    for name, tensor in state.items():
        match = _STACKED.fullmatch(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, projection, leaf = match.groups()
        for expert, row in enumerate(tensor):
            out[f"{prefix}.{expert}.{projection}.{leaf}"] = row
    return out


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def swap_quantized_layers(model: nn.Module, layout: dict[str, torch.dtype | None], model_path: str) -> None:
    """Replace, in `model` (built on the meta device), each linear that `layout` (checkpoint name ->
    stored dtype where it matters, `ShardReader.layout`) holds quantised by an NVFP4Linear or FP8Linear,
    and each MoE layer's routed experts held as NVFP4 triples by NVFP4Experts; all on the meta device,
    to be filled from the checkpoint (`train.model.materialize`). The base is frozen."""
    expert_layers = {match.group(1) for match in map(_PER_EXPERT.fullmatch, layout) if match}
    for name in expert_layers:
        parent, _, leaf = name.rpartition(".")
        old = model.get_submodule(name)
        if getattr(old, "gate_up_proj", None) is None or old.gate_up_proj.dim() != 3:
            raise ValueError(f"{model_path}: {name} holds NVFP4 routed experts, but the model's {type(old).__name__} "
                             "is not laid out as transformers' DeepseekV3Experts (gate_up_proj [E, 2I, H])")
        experts, double, hidden = old.gate_up_proj.shape
        setattr(model.get_submodule(parent), leaf, NVFP4Experts(experts, hidden, double // 2, old.act_fn, device="meta"))
    layer_types = {name.rsplit(".", 1)[0]: NVFP4Linear for name in layout
                   if name.endswith(".weight_packed") and not _PER_EXPERT.fullmatch(name)}
    layer_types.update({name.rsplit(".", 1)[0]: FP8Linear for name, dtype in layout.items()
                        if name.endswith(".weight") and dtype == torch.float8_e4m3fn})
    for name, layer_type in layer_types.items():
        parent, _, leaf = name.rpartition(".")
        old = model.get_submodule(name)
        dtype = old.weight.dtype
        setattr(model.get_submodule(parent), leaf,
                layer_type(old.in_features, old.out_features, old.bias is not None, device="meta", dtype=dtype))
    model.requires_grad_(False)  # the base is frozen: LoRA adapters (added after) are the only trainables


def lora_custom_modules() -> dict:
    """peft's custom-module mapping: NVFP4Linear and FP8Linear get peft's own LoRA Linear wrapper."""
    import warnings

    from peft.tuners.lora.layer import Linear as LoraLinear

    # peft warns about every custom layer type; these are tested (tests/integration/test_nvfp4.py,
    # test_moe_nvfp4.py).
    warnings.filterwarnings("ignore", message="Unsupported layer type .*(NVFP4Linear|FP8Linear)")
    return {NVFP4Linear: LoraLinear, FP8Linear: LoraLinear}
