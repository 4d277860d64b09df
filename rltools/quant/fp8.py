"""FP8 weights (E4M3, one float32 scale per output channel) as pure tensor functions: the layout the
public NVFP4 MoE checkpoints give their linears outside the routed experts (compressed-tensors
`float-quantized`, weight-only: vLLM's `CompressedTensorsW8A16Fp8`).

Invariant: `dequantize_fp8` is the only place these FP8 weights become numbers; the trainer's
`FP8Linear` and the CPU generator's dense copy both call it. Value = e4m3 x scale; the scale maps
each row's largest magnitude onto 448, the largest E4M3 value; rounding is `nvfp4.round_to_e4m3`
(to nearest, ties to even, saturating).
"""

import torch

from .nvfp4 import E4M3_MAX, round_to_e4m3


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (float8_e4m3fn [out, in], float32 scale [out, 1])."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return round_to_e4m3(w / scale), scale


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (weight.float() * scale.float()).to(dtype)
