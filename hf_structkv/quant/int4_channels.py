"""Symmetric INT4 with FP16 scales per channel (column), one row of scales per group of rows.

For ``x [..., n, d]`` (e.g. the kept keys of one KV head, one row per kept token) and a group size ``g`` (``None``: one
group of all ``n`` rows), row ``r`` is scaled by the scale row ``scales[r // g] [d]``: the scale of channel ``c`` in a
group is ``max |x[rows of the group, c]| / 7``, rounded to FP16 and clamped to ``[2**-24, 65504]`` (the smallest
positive and the largest finite FP16; beyond ``7 * 65504`` the codes saturate); a channel that is all zero in its group
gets scale 1. Codes are ``clip(round(x / scale), -7, 7)`` (round half to even), packed along ``d`` exactly as the rows
of `quantize_int4` (`pack_int4`), so a reader unpacks a row of either scheme the same way. Per-channel scales suit keys
with outlier channels, where one per-row scale would flatten every other channel to a few codes.
"""

from __future__ import annotations

import torch

from ..validation import check_int
from .int4 import LARGEST_FP16, SMALLEST_FP16, pack_int4, unpack_int4


def _group_size(group: object, rows: int) -> int:
    size = check_int("group", group, 1, counts="rows per row of scales", none_ok=True)
    return rows if size is None else size


def quantize_int4_channels(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., n, d]`` to INT4 with one FP16 scale per channel and group of ``group`` rows.

    Returns:
        ``(codes, scales)``: ``codes`` uint8 ``[..., n, ceil(d / 2)]``, ``scales`` fp16 ``[..., ceil(n / g), d]``
        (``g = group``, or ``n`` when ``group`` is None). Dequantised values are ``code * scale``; every element is
        within ``scale / 2`` of ``x`` unless it saturates (only when ``|x| > 7 * 65504``).
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor [..., n, d], got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() < 2 or x.shape[-1] == 0 or x.shape[-2] == 0:
        raise ValueError(f"x must have non-empty last two dimensions [..., n, d], got shape {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        raise ValueError("x must be finite (no NaN or inf) to be quantised")
    rows, size = x.shape[-2], _group_size(group, x.shape[-2])
    xf = x.float()
    padded = torch.nn.functional.pad(xf.abs(), (0, 0, 0, -rows % size))
    peak = padded.unflatten(-2, (-1, size)).amax(dim=-2)
    scales = (peak / 7.0).clamp_max(LARGEST_FP16).to(torch.float16).clamp_min(SMALLEST_FP16)
    scales = torch.where(peak == 0, torch.ones_like(scales), scales)
    per_row = scales.float().repeat_interleave(size, dim=-2)[..., :rows, :]
    codes = torch.round(xf / per_row).clamp_(-7, 7).to(torch.int8)
    return pack_int4(codes), scales


def dequantize_int4_channels(
    codes: torch.Tensor,
    scales: torch.Tensor,
    d: int,
    group: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``x̂ = code * scale`` ``[..., n, d]`` in ``dtype`` from ``codes`` uint8 ``[..., n, ceil(d / 2)]`` and ``scales``
    fp16 ``[..., ceil(n / g), d]`` (as returned by `quantize_int4_channels` with the same ``group``); the product is
    formed in FP32."""
    signed = unpack_int4(codes, d)
    if signed.dim() < 2:
        raise ValueError(f"codes must be [..., n, ceil(d / 2)] with at least two dimensions, got {tuple(codes.shape)}")
    rows = signed.shape[-2]
    size = _group_size(group, rows)
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float16:
        raise TypeError(f"scales must be an fp16 tensor [..., groups, d], got {getattr(scales, 'dtype', type(scales))}")
    expected = (*signed.shape[:-2], -(-rows // size), d)
    if tuple(scales.shape) != expected:
        shape = tuple(scales.shape)
        raise ValueError(f"scales must have shape {expected} for {rows} rows in groups of {size}, got {shape}")
    per_row = scales.float().repeat_interleave(size, dim=-2)[..., :rows, :]
    return (signed.float() * per_row).to(dtype)
