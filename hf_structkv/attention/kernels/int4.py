"""Triton kernel for symmetric per-row INT4 quantisation and nibble packing (PASK B.5).

Bit-exact with ``hf_structkv.quant.quantize_int4``: per row of the last dimension, ``scale = max|x| / 7`` (IEEE FP32
division) capped at 65504, rounded to FP16 (round to nearest even) and floored at ``2**-24``; an all-zero row gets
scale 1; codes ``clip(round_half_even(x / scale), -7, 7)``; element ``2i`` in the low nibble of byte ``i``, ``2i + 1``
in the high nibble, 4-bit two's complement; an odd last dimension is padded with a zero code.

CPU tensors run under the Triton interpreter only: ``TRITON_INTERPRET=1`` set before triton is first imported.
Inputs are not checked for NaN / inf (that would cost a device synchronisation per call); the reference rejects them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import check_runs_on

SMALLEST_FP16: tl.constexpr = tl.constexpr(2.0**-24)
"""The smallest positive (subnormal) FP16 value: the floor of every scale."""
LARGEST_FP16: tl.constexpr = tl.constexpr(65504.0)
"""The largest finite FP16 value: the ceiling of every scale (a larger row saturates its codes, as on CPU)."""
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_ROWS = 16
MAX_BLOCK_PAIRS = 128
"""Byte columns (element pairs) per step of the loops along a row."""


@triton.jit
def _round_half_even(x):
    """``torch.round`` of FP32 ``x``: exact, without relying on a device rounding intrinsic."""
    whole = tl.floor(x)
    frac = x - whole  # exact: |x| < 2**23 here
    is_odd = (whole - 2.0 * tl.floor(whole * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & is_odd)
    return tl.where(up, whole + 1.0, whole)


@triton.jit
def _nibbles(x, scale):
    """4-bit two's-complement codes (int32 in ``[0, 15]``) of ``clip(round(x / scale), -7, 7)``."""
    code = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(x, scale)), -7.0), 7.0)
    return code.to(tl.int32) & 15


@triton.jit
def _quantize_int4_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    n_rows,
    d,
    stride_xr,
    stride_xd,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_PAIRS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < n_rows
    pair = tl.arange(0, BLOCK_PAIRS)
    n_pairs = (d + 1) // 2
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xr

    peak = tl.zeros([BLOCK_ROWS], tl.float32)
    for start in range(0, n_pairs, BLOCK_PAIRS):
        even = 2 * (start + pair)
        ok_even = row_ok[:, None] & (even < d)[None, :]
        ok_odd = row_ok[:, None] & (even + 1 < d)[None, :]
        x_even = tl.load(x_rows + even[None, :] * stride_xd, mask=ok_even, other=0.0).to(tl.float32)
        x_odd = tl.load(x_rows + (even[None, :] + 1) * stride_xd, mask=ok_odd, other=0.0).to(tl.float32)
        peak = tl.maximum(peak, tl.maximum(tl.max(tl.abs(x_even), axis=1), tl.max(tl.abs(x_odd), axis=1)))

    scale = tl.minimum(tl.math.div_rn(peak, 7.0), LARGEST_FP16).to(tl.float16).to(tl.float32)
    scale = tl.where(peak == 0.0, 1.0, tl.maximum(scale, SMALLEST_FP16))
    tl.store(scales_ptr + rows, scale.to(tl.float16), mask=row_ok)

    for start in range(0, n_pairs, BLOCK_PAIRS):
        byte = start + pair
        even = 2 * byte
        ok_even = row_ok[:, None] & (even < d)[None, :]
        ok_odd = row_ok[:, None] & (even + 1 < d)[None, :]
        x_even = tl.load(x_rows + even[None, :] * stride_xd, mask=ok_even, other=0.0).to(tl.float32)
        x_odd = tl.load(x_rows + (even[None, :] + 1) * stride_xd, mask=ok_odd, other=0.0).to(tl.float32)
        packed = _nibbles(x_even, scale[:, None]) | (_nibbles(x_odd, scale[:, None]) << 4)
        tl.store(
            codes_ptr + rows[:, None].to(tl.int64) * n_pairs + byte[None, :],
            packed.to(tl.uint8),
            mask=row_ok[:, None] & (byte < n_pairs)[None, :],
        )


def triton_quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise each row of ``x`` ``[..., d]`` (fp32, fp16 or bf16) to packed INT4.

    Returns:
        ``(codes, scales)``: ``codes`` uint8 ``[..., ceil(d / 2)]``, ``scales`` fp16 ``[..., 1]``, equal to
        ``hf_structkv.quant.quantize_int4(x)`` bit for bit (for finite ``x``).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"x must be fp32, fp16 or bf16, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    check_runs_on(x.device)
    d = x.shape[-1]
    lead = x.shape[:-1]
    rows = x.reshape(-1, d)
    n_pairs = (d + 1) // 2
    codes = torch.empty(*lead, n_pairs, dtype=torch.uint8, device=x.device)
    scales = torch.empty(*lead, 1, dtype=torch.float16, device=x.device)
    if rows.shape[0] == 0:
        return codes, scales
    _quantize_int4_kernel[(triton.cdiv(rows.shape[0], BLOCK_ROWS),)](
        rows,
        codes,
        scales,
        rows.shape[0],
        d,
        *rows.stride(),
        BLOCK_ROWS=BLOCK_ROWS,
        BLOCK_PAIRS=min(MAX_BLOCK_PAIRS, triton.next_power_of_2(n_pairs)),
    )
    return codes, scales
