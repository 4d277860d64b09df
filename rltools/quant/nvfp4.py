"""NVFP4 weights as pure tensor functions: quantise, pack, unpack, dequantise.

Format (NVIDIA NVFP4, as stored by compressed-tensors' `nvfp4-pack-quantized` and read by vLLM's
`CompressedTensorsW4A4Fp4`): each element is a 4-bit E2M1 code (bit 3 sign, bits 0-2 an index into
{0, 0.5, 1, 1.5, 2, 3, 4, 6}), two codes per byte with element 2j in the LOW nibble; one FP8 E4M3
scale per block of 16 consecutive elements along the input dimension; one float32 global scale per
tensor, stored as a divisor. Dequantised value = e2m1 x (block_scale / global_scale).

Invariant: `dequantize` is the only place FP4 codes become numbers. The trainer's linear layers and
the CPU generator's dense copy of the base both call it, so they compute with bitwise-equal
weights. Rounding: E2M1 round-to-nearest-even with saturation at 6 (as compressed-tensors'
`cast_to_fp4` and the PTX `cvt.rn.satfinite.e2m1x2` do); E4M3 round-to-nearest-even, saturating
at 448.
"""

from typing import NamedTuple

import torch

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring grid values; a tie goes to the neighbour with an even code
# (mantissa bit 0), i.e. down at even boundaries k, up at odd ones.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


class NVFP4Weight(NamedTuple):
    packed: torch.Tensor  # uint8 [out, in / 2], element 2j in the low nibble
    scale: torch.Tensor  # float8_e4m3fn [out, in / 16]
    global_scale: torch.Tensor  # float32 [1]; dequantise by dividing by it


def global_scale_for(amax: float | torch.Tensor) -> torch.Tensor:
    """The per-tensor scale that maps `amax` onto the largest block scale x largest element
    (448 x 6), as compressed-tensors' `generate_gparam`. Pass the max over all shards vLLM fuses
    (q/k/v, gate/up): it keeps one global scale per fused layer."""
    amax = torch.as_tensor(amax, dtype=torch.float32).clamp(min=torch.finfo(torch.float32).tiny)
    scale = E4M3_MAX * E2M1_MAX / amax
    return torch.nan_to_num(scale, nan=1.0, posinf=1.0, neginf=1.0).reshape(1)


def round_to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8 0..15) of the E2M1 values nearest to `x` (ties to even, saturating)."""
    magnitude = x.abs()
    index = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for k, midpoint in enumerate(_MIDPOINTS):
        above = magnitude > midpoint if k % 2 == 0 else magnitude >= midpoint
        index += above.to(torch.uint8)
    negative = (x < 0) & (index > 0)  # no negative zero: code 8 is never written
    return index | (negative.to(torch.uint8) << 3)


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float8_e4m3fn, round-to-nearest-even, saturating at 448 (the cast alone would
    give NaN above it)."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize(weight: torch.Tensor, global_scale: torch.Tensor | None = None) -> NVFP4Weight:
    """Quantise a [out, in] weight (in % 16 == 0). `global_scale` defaults to the tensor's own."""
    out_features, in_features = weight.shape
    if in_features % BLOCK:
        raise ValueError(f"NVFP4 needs the input dimension to be a multiple of {BLOCK}, got {in_features}")
    w = weight.detach().float()
    if global_scale is None:
        global_scale = global_scale_for(w.abs().max())
    blocks = w.reshape(out_features, in_features // BLOCK, BLOCK)
    scale = round_to_e4m3(global_scale * blocks.abs().amax(-1) / E2M1_MAX)
    # A zero block scale (an all-zero block) would divide by zero; its codes are 0 either way.
    scale = torch.where(scale.float() == 0, torch.finfo(torch.float8_e4m3fn).eps, scale.float()).to(torch.float8_e4m3fn)
    codes = round_to_e2m1_codes(blocks / _effective_scale(scale, global_scale).unsqueeze(-1))
    codes = codes.reshape(out_features, in_features)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return NVFP4Weight(packed.contiguous(), scale, global_scale.float().reshape(1).clone())


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in/2] -> codes uint8 [out, in]: low nibble first."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """e2m1 x (block_scale / global_scale), computed in float32 and then cast to `dtype`."""
    table = _signed_grid(packed.device)
    values = table[unpack_codes(packed).long()]
    out_features, in_features = values.shape
    blocks = values.reshape(out_features, in_features // BLOCK, BLOCK)
    return (blocks * _effective_scale(scale, global_scale).unsqueeze(-1)).reshape(out_features, in_features).to(dtype)


def packed_bytes(out_features: int, in_features: int) -> int:
    """Bytes of one quantised [out, in] weight: 4 bits per element, 1 byte per block, 4 global."""
    return out_features * in_features // 2 + out_features * in_features // BLOCK + 4


def _effective_scale(scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    # Same order of operations as compressed-tensors' `_dequantize`: scale / global, then times x.
    return scale.float() / global_scale.float()


def _signed_grid(device) -> torch.Tensor:
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32, device=device)
    return torch.cat([grid, -grid])
