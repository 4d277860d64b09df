"""Routed experts kept packed on their EP rank (`model.quantization: nvfp4`): megatron's expert MLP
with its two linears replaced by modules that hold the checkpoint's NVFP4 triples and dequantise one
expert's projection at a time, in forward and again in backward (`quant.linear.packed_linear`, as
the FSDP2 backend's `NVFP4Experts`): autograd keeps the packed tensors, never a dense copy.

They enter through the layer spec (build.py), so the dense experts are never allocated. Names:
`linear_fc1.gate_proj_weight_packed` etc., one triple per HF projection (linear_fc1 is [gate; up]
as megatron fuses it, linear_fc2 is down_proj); `dense()` gives the weight megatron's dense module
would hold, for the export.
"""

import torch
from torch import nn

from ...quant.layout import QUANT_SUFFIXES
from ...quant.linear import packed_linear
from ...quant.nvfp4 import BLOCK, dequantize


class PackedExpertLinear(nn.Module):
    PROJECTIONS: tuple[str, ...] = ()

    def __init__(self, input_size: int, output_size: int, *, config, **_):
        super().__init__()
        self.config = config
        rows = output_size // len(self.PROJECTIONS)
        self.shape = (output_size, input_size)
        if input_size % BLOCK:
            raise ValueError(f"NVFP4 experts need an input width that is a multiple of {BLOCK}, got {input_size}")
        for projection in self.PROJECTIONS:
            self.register_parameter(f"{projection}_weight_packed", nn.Parameter(
                torch.zeros(rows, input_size // 2, dtype=torch.uint8), requires_grad=False))
            self.register_parameter(f"{projection}_weight_scale", nn.Parameter(
                torch.zeros(rows, input_size // BLOCK, dtype=torch.float8_e4m3fn), requires_grad=False))
            self.register_buffer(f"{projection}_weight_global_scale", torch.ones(1))

    def triple(self, projection: str) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f"{projection}_{leaf}") for leaf in QUANT_SUFFIXES)

    def forward(self, x: torch.Tensor):
        outs = [packed_linear(x, *self.triple(p)) for p in self.PROJECTIONS]
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)), None

    def dense(self, dtype: torch.dtype, meta: bool = False) -> torch.Tensor:
        """The dequantised weight megatron's dense linear would hold (a meta tensor of its shape)."""
        if meta:
            return torch.empty(self.shape, dtype=dtype, device="meta")
        return torch.cat([dequantize(*self.triple(p), dtype=dtype) for p in self.PROJECTIONS])

    def load(self, read) -> None:
        """Fill the triples from `read(hf_projection) -> {leaf: tensor}` (`hf_projection` one of
        PROJECTIONS; the caller maps it to the checkpoint's module name)."""
        with torch.no_grad():
            for projection in self.PROJECTIONS:
                stored = read(projection)
                if set(stored) != set(QUANT_SUFFIXES):
                    raise ValueError(f"routed expert {projection}: not an NVFP4 triple in the checkpoint "
                                     f"(found {sorted(stored)}): the experts of this backend must be NVFP4")
                for leaf, tensor in stored.items():
                    getattr(self, f"{projection}_{leaf}").copy_(tensor.reshape(getattr(self, f"{projection}_{leaf}").shape))


class PackedExpertFc1(PackedExpertLinear):
    PROJECTIONS = ("gate_proj", "up_proj")


class PackedExpertFc2(PackedExpertLinear):
    PROJECTIONS = ("down_proj",)


def pack_expert_specs(spec) -> None:
    """Put the packed linears into the routed experts of a decoder block spec's MoE layers."""
    for layer_spec in spec.layer_specs:
        experts = getattr(getattr(layer_spec.submodules.mlp, "submodules", None), "experts", None)
        if experts is not None:
            experts.submodules.linear_fc1, experts.submodules.linear_fc2 = PackedExpertFc1, PackedExpertFc2
