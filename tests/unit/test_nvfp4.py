"""NVFP4 format functions against references written here from the format definition."""

import itertools

import pytest
import torch

from rltools.quant.nvfp4 import (
    BLOCK,
    E2M1_GRID,
    dequantize,
    global_scale_for,
    packed_bytes,
    quantize,
    round_to_e2m1_codes,
    round_to_e4m3,
    unpack_codes,
)


def test_e2m1_grid_values_round_trip_exactly():
    signed = [v for v in E2M1_GRID] + [-v for v in E2M1_GRID[1:]]
    codes = round_to_e2m1_codes(torch.tensor(signed))
    table = torch.tensor(list(E2M1_GRID) + [-v for v in E2M1_GRID])
    assert table[codes.long()].tolist() == signed
    # through a whole weight: blocks holding a 6 get block scale 448 = global scale, i.e. exactly 1
    torch.manual_seed(0)
    grid = torch.tensor(signed)
    weight = grid[torch.randint(len(signed), (8, 64))]
    weight[:, ::BLOCK] = 6.0
    q = quantize(weight)
    assert q.global_scale.item() == 448.0
    assert torch.equal(dequantize(*q), weight)


def test_e2m1_rounding_ties_to_even_and_saturates():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, -0.25, -5.0, 0.26, 4.9])
    table = torch.tensor(list(E2M1_GRID) + [-v for v in E2M1_GRID])
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 0.0, -4.0, 0.5, 4.0]
    assert table[round_to_e2m1_codes(x).long()].tolist() == expected


def test_nibble_order_low_nibble_first():
    # compressed-tensors' pack_fp4_to_uint8: byte = code[2j] | code[2j + 1] << 4
    weight = torch.zeros(1, BLOCK)
    weight[0, 0], weight[0, 1], weight[0, 2] = 0.5 * 6 / 6, 6.0, -1.0  # amax 6: effective scale 1
    q = quantize(weight)
    assert q.packed[0, 0].item() == 0x1 | (0x7 << 4)  # 0.5 is code 1, 6 is code 7
    assert q.packed[0, 1].item() == 0xA  # -1.0: sign bit 8 | code 2, element 3 (zero) in the high nibble
    assert unpack_codes(q.packed)[0, :3].tolist() == [1, 7, 10]


def e4m3_values() -> list[float]:
    """Every finite float8 E4M3 (fn) value from the bit layout: 1 sign, 4 exponent (bias 7), 3 mantissa;
    exponent 0 is subnormal (m/8 x 2^-6); S.1111.111 is NaN (no infinities); max 1.1110 x 2^8 = 448."""
    values = []
    for exponent, mantissa in itertools.product(range(16), range(8)):
        if exponent == 15 and mantissa == 7:
            continue  # NaN
        if exponent == 0:
            values.append(mantissa / 8 * 2.0**-6)
        else:
            values.append((1 + mantissa / 8) * 2.0 ** (exponent - 7))
    return values  # index = the 7-bit code: its lowest bit is the mantissa's last bit


def reference_e4m3(x: float) -> float:
    """Round-to-nearest, ties to the even code, saturating at 448 (x >= 0)."""
    values = e4m3_values()
    if x >= 448.0:
        return 448.0
    best = min(range(len(values)), key=lambda i: (abs(values[i] - x), i % 2))
    return values[best]


def test_e4m3_block_scale_rounding_matches_the_bit_layout_reference():
    values = e4m3_values()
    midpoints = [(a + b) / 2 for a, b in zip(values, values[1:])]
    torch.manual_seed(0)
    randoms = (torch.rand(400) * 460).tolist() + (torch.rand(200) * 2.0**-5).tolist()
    xs = values + midpoints + randoms + [448.0, 460.0, 1e6, 0.0]
    ours = round_to_e4m3(torch.tensor(xs, dtype=torch.float32)).float().tolist()
    expected = [reference_e4m3(float(torch.tensor(x, dtype=torch.float32))) for x in xs]
    assert ours == expected


def test_packed_size_is_4_5_bits_per_parameter():
    q = quantize(torch.randn(96, 256))
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (96, 128)
    assert q.scale.dtype == torch.float8_e4m3fn and q.scale.shape == (96, 16)
    assert q.global_scale.dtype == torch.float32 and q.global_scale.shape == (1,)
    total = sum(t.numel() * t.element_size() for t in q)
    assert total == packed_bytes(96, 256) == 96 * 256 // 2 + 96 * 256 // 16 + 4
    assert 8 * total / (96 * 256) == pytest.approx(4.5, abs=0.01)


def test_quantize_dequantize_error_within_the_format_bound():
    torch.manual_seed(0)
    weight = torch.randn(64, 512) * torch.logspace(-3, 1, 64).unsqueeze(1)  # rows over 4 decades
    weight[3, 17] = 40.0  # an outlier that sets the global scale
    q = quantize(weight)
    dq = dequantize(*q)
    s_eff = (q.scale.float() / q.global_scale).repeat_interleave(BLOCK, dim=1)  # per element
    m = weight.abs() / s_eff  # magnitude in units of the block's step
    # nearest-value rounding: half the gap between neighbouring E2M1 values (0.25 below 2, 0.5 below 4,
    # 1 up to 6); above 6 the value saturates at 6 x s_eff
    half_gap = torch.where(m <= 2, 0.25, torch.where(m <= 4, 0.5, 1.0)) * s_eff
    bound = torch.where(m <= 6, half_gap, weight.abs() - 6 * s_eff)
    err = (dq - weight).abs()
    assert (err <= bound * (1 + 1e-6) + 1e-12).all()
    # the block scale is the block amax / 6 rounded to E4M3 (3 mantissa bits: <= 1/16 relative), so
    # saturation costs at most amax / 17 and the worst error in a block is <= (amax / 6) x 17/16
    amax = weight.abs().reshape(64, -1, BLOCK).amax(-1).repeat_interleave(BLOCK, dim=1)
    normal = amax * q.global_scale / 6 >= 2.0**-6  # block scales in E4M3's normal range
    assert (err[normal] <= (amax / 6 * 17 / 16)[normal]).all()
    rel = (err.square().sum() / weight.square().sum()).sqrt()
    assert rel < 0.12  # relative RMS error of 4-bit E2M1 with 16-element blocks, ~0.09 on Gaussians


def test_shared_global_scale_is_used_as_given():
    w = torch.randn(4, 32)
    g = global_scale_for(w.abs().max() * 3)  # as if a fused sibling had a 3x larger amax
    q = quantize(w, g)
    assert torch.equal(q.global_scale, g)
    assert (dequantize(*q) - w).abs().max() <= w.abs().max() / 6


def test_input_dim_must_be_a_multiple_of_16():
    with pytest.raises(ValueError, match="multiple of 16"):
        quantize(torch.randn(4, 24))


def test_the_packed_linear_keeps_no_dense_weight_for_backward():
    """The trainer's NVFP4 layers dequantise in forward and again in backward: what autograd keeps
    between them is the packed weight, never its dense copy, and the gradient is the dense one's."""
    from rltools.quant.linear import packed_linear

    torch.manual_seed(0)
    weight = quantize(torch.randn(48, 64))
    dense = dequantize(*weight)
    x = torch.randn(5, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = packed_linear(x, *weight)
    assert not [t for t in saved if t.is_floating_point() and t.numel() == dense.numel()]  # nor its transpose
    out.square().sum().backward()
    reference = x.detach().clone().requires_grad_()
    torch.nn.functional.linear(reference, dense).square().sum().backward()
    assert torch.equal(out, torch.nn.functional.linear(reference, dense))
    assert torch.allclose(x.grad, reference.grad, rtol=1e-6, atol=1e-6)


def test_fp8_weights_scale_each_row_onto_448_and_round_to_the_nearest_e4m3():
    """The FP8 linears of the mixed MoE layout: one float32 scale per row, its largest magnitude
    stored exactly as 448; every element the nearest E4M3 value (3 mantissa bits: relative error
    at most 2^-4) of weight / scale; an all-zero row stays zero."""
    from rltools.quant.fp8 import dequantize_fp8, quantize_fp8

    torch.manual_seed(0)
    weight = torch.randn(6, 40)
    weight[3] = 0
    stored, scale = quantize_fp8(weight)
    assert stored.dtype == torch.float8_e4m3fn and scale.shape == (6, 1) and scale.dtype == torch.float32
    assert torch.equal(stored.float().abs().amax(1)[[0, 1, 2, 4, 5]], torch.full((5,), 448.0))
    back = dequantize_fp8(stored, scale)
    assert torch.equal(back[3], torch.zeros(40))
    normal = weight.abs() / scale > 2**-6  # E4M3's smallest normal: below it the step is absolute
    assert ((back - weight).abs() <= weight.abs() * 2**-4 + 1e-12)[normal].all()
    assert torch.equal(stored.float(), round_to_e4m3(weight / scale).float())
