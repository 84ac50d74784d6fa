"""INT4 row quantisation (PASK B.5): brute-force codes, packing layout, error bound, edge rows, bad input."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_structkv.quant import SMALLEST_FP16, dequantize_int4, quantize_int4, unpack_int4


def brute_force(row: list[float]) -> tuple[list[int], float]:
    """One row, element by element: the FP16 scale and the signed codes."""
    peak = max(abs(x) for x in row)
    if peak == 0:
        return [0] * len(row), 1.0
    scale = max(float(torch.tensor(min(peak / 7.0, 65504.0), dtype=torch.float32).to(torch.float16)), SMALLEST_FP16)
    codes = []
    for x in row:
        q = x / float(torch.tensor(scale, dtype=torch.float16))
        r = round(float(torch.tensor(q, dtype=torch.float32)))  # Python's round: half to even, as torch.round
        codes.append(max(-7, min(7, r)))
    return codes, scale


@pytest.mark.parametrize("d", [1, 2, 7, 16, 33])
def test_codes_and_scales_equal_brute_force(d):
    x = torch.randn(5, d) * torch.logspace(-3, 2, 5).unsqueeze(1)
    codes, scales = quantize_int4(x)
    assert codes.dtype == torch.uint8 and codes.shape == (5, math.ceil(d / 2))
    assert scales.dtype == torch.float16 and scales.shape == (5, 1)
    signed = unpack_int4(codes, d)
    for i in range(5):
        want_codes, want_scale = brute_force(x[i].tolist())
        assert signed[i].tolist() == want_codes
        assert float(scales[i]) == want_scale


def test_rows_beyond_the_fp16_range_saturate_finitely_as_brute_force():
    # a scale max|x| / 7 above 65504 would overflow FP16 to inf and dequantise to NaN (inf * 0)
    x = torch.tensor([[4.6e5, -1.0, 3.0], [1e12, -2.5e11, 7.0], [-7 * 65504.0, 65504.0, 0.5], [3e38, 1e30, -3e38]])
    codes, scales = quantize_int4(x)
    signed = unpack_int4(codes, 3)
    for i in range(x.shape[0]):
        want_codes, want_scale = brute_force(x[i].tolist())
        assert signed[i].tolist() == want_codes and float(scales[i]) == want_scale
    recon = dequantize_int4(codes, scales, 3)
    assert torch.isfinite(recon).all()
    assert float(scales[1]) == 65504.0 and recon[1].tolist() == [7 * 65504.0, -7 * 65504.0, 0.0]
    inside = x[2].abs() <= 7 * scales[2].float()  # the documented bound holds wherever the code does not saturate
    assert ((recon[2] - x[2]).abs()[inside] <= scales[2].float() / 2).all()


def test_packing_layout_low_nibble_first_twos_complement():
    # scale 1: codes equal the values
    x = torch.tensor([[7.0, -7.0, 1.0, -1.0, 0.0]])
    codes, scales = quantize_int4(x)
    assert float(scales) == 1.0
    assert codes.tolist() == [[0x97, 0xF1, 0x00]]  # (7 | -7<<4), (1 | -1<<4), (0 | pad 0)


def test_zero_rows_get_zero_codes_and_unit_scale():
    codes, scales = quantize_int4(torch.zeros(2, 3, 5, dtype=torch.bfloat16))
    assert not codes.any() and bool((scales == 1).all())
    assert not dequantize_int4(codes, scales, 5).any()


def test_round_half_to_even_ties():
    # peak 7 -> scale 1; 2.5 -> 2, 3.5 -> 4, -0.5 -> 0
    x = torch.tensor([[7.0, 2.5, 3.5, -0.5]])
    assert unpack_int4(quantize_int4(x)[0], 4).tolist() == [[7, 2, 4, 0]]


def test_tiny_rows_use_the_smallest_fp16_scale():
    x = torch.tensor([[1e-9, -3e-9]])
    _, scales = quantize_int4(x)
    assert float(scales) == SMALLEST_FP16


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(
        st.lists(st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32), min_size=1, max_size=9),
        min_size=1,
        max_size=4,
    ).filter(lambda rows: len({len(r) for r in rows}) == 1),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
)
def test_round_trip_codes_exact_and_error_within_half_a_scale(rows, dtype):
    x = torch.tensor(rows, dtype=torch.float32).to(dtype)
    d = x.shape[-1]
    codes, scales = quantize_int4(x)
    recon = dequantize_int4(codes, scales, d)
    err = (recon - x.float()).abs()
    peak = x.float().abs().amax(-1, keepdim=True)
    # Outside FP16 subnormals the FP16 scale is within 2^-11 of peak / 7, so the peak never saturates by more than
    # a sliver and every element is within half a step; tiny rows (scale in the subnormals) are tested separately.
    normal = (peak / 7 >= 2.0**-14).squeeze(-1)
    assert bool((err[normal] <= scales[normal].float() / 2 * (1 + 1e-5)).all())
    again, rescales = quantize_int4(recon)
    assert torch.equal(unpack_int4(again, d)[normal], unpack_int4(codes, d)[normal])
    assert torch.equal(rescales[normal], scales[normal])


def test_subnormal_scales_saturate_within_one_step():
    x = torch.tensor([[1e-6, -2e-7, 5e-7]])
    codes, scales = quantize_int4(x)
    err = (dequantize_int4(codes, scales, 3) - x).abs()
    # FP16 rounding of a subnormal scale is off by up to half a subnormal step (2^-25); the peak saturates at
    # code 7 by up to 7 such half steps.
    assert bool((err <= scales.float() / 2 + 7 * 2.0**-25).all())


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="x must be a floating-point"):
        quantize_int4(torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="finite"):
        quantize_int4(torch.tensor([[float("nan"), 1.0]]))
    with pytest.raises(ValueError, match="non-empty last dimension"):
        quantize_int4(torch.ones(2, 0))
    codes, scales = quantize_int4(torch.ones(2, 4))
    with pytest.raises(ValueError, match="ceil"):
        dequantize_int4(codes, scales, 5)
    with pytest.raises(TypeError, match="uint8"):
        dequantize_int4(codes.to(torch.int8), scales, 4)
    with pytest.raises(TypeError, match="fp16"):
        dequantize_int4(codes, scales.float(), 4)
    with pytest.raises(ValueError, match="scales must have shape"):
        dequantize_int4(codes, scales[:1], 4)


# ------------------------------------------------------- per-channel scales and offsets (compacted INT4 keys)
from hf_structkv.quant import (  # noqa: E402
    LARGEST_FP16,
    dequantize_int4_channels,
    pack_int4,
    quantize_int4_channels,
)


def fp16(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32).to(torch.float16))


def channel_brute_force(x: torch.Tensor, group: int | None) -> tuple[list[list[int]], list[list[float]], list]:
    """Element by element: one FP16 scale and offset per (group of rows, column) and the signed codes."""
    rows, cols = x.shape
    size = group or rows
    scales, offsets, codes = [], [], [[0] * cols for _ in range(rows)]
    for start in range(0, rows, size):
        members = range(start, min(rows, start + size))
        scale_row, offset_row = [], []
        for c in range(cols):
            column = [float(x[r, c]) for r in members]
            low, high = min(column), max(column)
            scale = 1.0 if high == low else max(fp16(min((high - low) / 15.0, LARGEST_FP16)), SMALLEST_FP16)
            offset = fp16(max(-LARGEST_FP16, min(LARGEST_FP16, low + 8.0 * scale)))
            scale_row.append(scale)
            offset_row.append(offset)
            for r in members:
                q = float(torch.tensor(float(x[r, c]) - offset, dtype=torch.float32) / torch.tensor(scale))
                codes[r][c] = max(-8, min(7, round(q)))
        scales.append(scale_row)
        offsets.append(offset_row)
    return codes, scales, offsets


@pytest.mark.parametrize(("rows", "cols", "group"), [(1, 1, None), (5, 7, None), (9, 4, 2), (8, 6, 4), (3, 5, 8)])
def test_channel_codes_scales_and_offsets_equal_brute_force(rows, cols, group):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols))
    x[:, 0] *= 300.0  # an outlier channel
    x[:, -1] += 20.0  # a channel far from zero
    codes, scales, offsets = quantize_int4_channels(x, group)
    size = group or rows
    assert codes.dtype == torch.uint8 and codes.shape == (rows, math.ceil(cols / 2))
    for per_group in (scales, offsets):
        assert per_group.dtype == torch.float16 and per_group.shape == (math.ceil(rows / size), cols)
    want_codes, want_scales, want_offsets = channel_brute_force(x, group)
    assert unpack_int4(codes, cols).tolist() == want_codes
    assert scales.float().tolist() == want_scales and offsets.float().tolist() == want_offsets
    # dequantisation is code * scale + offset of the row's group, exactly
    expand = lambda table: torch.tensor(table).repeat_interleave(size, 0)[:rows]  # noqa: E731
    expected = torch.tensor(want_codes, dtype=torch.float32) * expand(want_scales) + expand(want_offsets)
    assert torch.equal(dequantize_int4_channels(codes, scales, offsets, cols, group), expected)


@settings(max_examples=100, deadline=None)
@given(
    rows=st.integers(1, 9),
    cols=st.integers(1, 9),
    group=st.one_of(st.none(), st.integers(1, 10)),
    magnitude=st.sampled_from([1.0, 1e3]),
    shift=st.sampled_from([0.0, 3.0]),
    seed=st.integers(0, 2**16),
)
def test_channel_round_trip_codes_exact_and_error_within_half_a_scale(rows, cols, group, magnitude, shift, seed):
    x = (torch.randn(2, rows, cols, generator=torch.Generator().manual_seed(seed)) + shift) * magnitude
    codes, scales, offsets = quantize_int4_channels(x, group)
    recon = dequantize_int4_channels(codes, scales, offsets, cols, group)
    per_row = scales.float().repeat_interleave(group or rows, dim=-2)[..., :rows, :]
    offset_rows = offsets.float().repeat_interleave(group or rows, dim=-2)[..., :rows, :]
    # half a step, plus the FP16 rounding of the offset (half an FP16 ulp: 2^-11 relative) and of the scale over
    # the 8 steps from the group's minimum to code 0 (2^-11 relative each)
    slack = per_row / 2 + offset_rows.abs() * 2.0**-11 + 8 * per_row * 2.0**-11
    normal = per_row >= 2.0**-14
    assert bool(((recon - x).abs() <= slack * (1 + 1e-4))[normal].all())
    assert torch.equal(pack_int4(unpack_int4(codes, cols)), codes)


def test_channel_offsets_spend_every_code_on_a_shifted_channel():
    x = torch.linspace(10.0, 11.5, 16)[:, None]  # 16 evenly spaced values: one code each
    codes, scales, offsets = quantize_int4_channels(x)
    assert unpack_int4(codes, 1).flatten().tolist() == list(range(-8, 8))
    assert torch.allclose(dequantize_int4_channels(codes, scales, offsets, 1), x, atol=float(scales) / 2 + 1e-2)


def test_channel_scales_stay_finite_beyond_the_fp16_range():
    x = torch.tensor([[1e9, -1.0], [-3e8, 2.0]])
    codes, scales, offsets = quantize_int4_channels(x)
    assert float(scales[0, 0]) == LARGEST_FP16
    recon = dequantize_int4_channels(codes, scales, offsets, 2)
    assert torch.isfinite(recon).all() and torch.isfinite(offsets.float()).all()


def test_channel_constant_columns_are_exact_to_fp16():
    x = torch.zeros(4, 3)
    x[:, 1] = 2.5
    x[1, 2] = 0.5
    codes, scales, offsets = quantize_int4_channels(x, 2)
    assert scales[:, :2].float().eq(1).all()
    recon = dequantize_int4_channels(codes, scales, offsets, 3, 2)
    assert torch.equal(recon[:, :2], x[:, :2]) and torch.equal(recon[2:, 2], x[2:, 2])


def test_channel_bad_input_is_named():
    with pytest.raises(TypeError, match="x must be a floating-point"):
        quantize_int4_channels(torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[\.\.\., n, d\]"):
        quantize_int4_channels(torch.ones(4))
    with pytest.raises(ValueError, match="finite"):
        quantize_int4_channels(torch.tensor([[math.inf, 1.0]]))
    with pytest.raises(ValueError, match="group must be an integer >= 1"):
        quantize_int4_channels(torch.ones(2, 2), 0)
    with pytest.raises(TypeError, match="group must be an integer"):
        quantize_int4_channels(torch.ones(2, 2), 1.5)
    codes, scales, offsets = quantize_int4_channels(torch.ones(5, 4), 2)
    with pytest.raises(ValueError, match="scales must have shape"):
        dequantize_int4_channels(codes, scales, offsets, 4, 3)
    with pytest.raises(TypeError, match="offsets must be an fp16"):
        dequantize_int4_channels(codes, scales, offsets.float(), 4, 2)
