"""Asymmetric INT4 with FP16 scales and offsets per channel (column), one row of each per group of rows.

For ``x [..., n, d]`` (e.g. the kept keys of one KV head, one row per kept token) and a group size ``g`` (``None``: one
group of all ``n`` rows), row ``r`` is read through the scale and offset rows ``scales[r // g]``, ``offsets[r // g]``
``[d]``. In a group, channel ``c`` spans ``[lo, hi]`` (its min and max over the group's rows): its scale is
``(hi − lo) / 15`` rounded to FP16 and clamped to ``[2**-24, 65504]`` (1 when ``hi == lo``), its offset (the value of
code 0) ``lo + 8 · scale`` rounded to FP16 and clamped to ``±65504``; codes are
``clip(round((x − offset) / scale), -8, 7)`` (round half to even), packed along ``d`` exactly as the rows of
`quantize_int4` (`pack_int4`), so a reader unpacks a row of either scheme the same way; ``x̂ = code · scale + offset``.

Per-channel ranges suit keys: post-RoPE keys have outlier channels and channels far from zero (the slow rotary pairs),
where a per-row scale flattens every other channel and a symmetric range wastes half its codes (measured on the
embedded model's heads: the attention error of INT4 keys is several times lower with offsets).
"""

from __future__ import annotations

import torch

from ..validation import check_int
from .int4 import LARGEST_FP16, SMALLEST_FP16, pack_int4, unpack_int4


def _group_size(group: object, rows: int) -> int:
    size = check_int("group", group, 1, counts="rows per row of scales", none_ok=True)
    return rows if size is None else size


def quantize_int4_channels(
    x: torch.Tensor, group: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantise ``x [..., n, d]`` to INT4 with one FP16 scale and offset per channel and group of ``group`` rows.

    Returns:
        ``(codes, scales, offsets)``: ``codes`` uint8 ``[..., n, ceil(d / 2)]``, ``scales`` and ``offsets`` fp16
        ``[..., ceil(n / g), d]`` (``g = group``, or ``n`` when ``group`` is None). Dequantised values are
        ``code · scale + offset``; every element is within about ``scale / 2`` of ``x`` (up to the FP16 rounding of
        the offset, and saturation only beyond the FP16 range).
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor [..., n, d], got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() < 2 or x.shape[-1] == 0 or x.shape[-2] == 0:
        raise ValueError(f"x must have non-empty last two dimensions [..., n, d], got shape {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        raise ValueError("x must be finite (no NaN or inf) to be quantised")
    rows, size = x.shape[-2], _group_size(group, x.shape[-2])
    xf = x.float()
    filler = xf[..., -1:, :].expand(*xf.shape[:-2], -rows % size, xf.shape[-1])  # the last group: its own rows
    grouped = torch.cat([xf, filler], dim=-2).unflatten(-2, (-1, size))
    low, high = grouped.amin(dim=-2), grouped.amax(dim=-2)
    scales = ((high - low) / 15.0).clamp_max(LARGEST_FP16).to(torch.float16).clamp_min(SMALLEST_FP16)
    scales = torch.where(high == low, torch.ones_like(scales), scales)
    offsets = (low + 8.0 * scales.float()).clamp(-LARGEST_FP16, LARGEST_FP16).to(torch.float16)
    codes = torch.round((xf - _per_row(offsets, size, rows)) / _per_row(scales, size, rows)).clamp_(-8, 7)
    return pack_int4(codes.to(torch.int8)), scales, offsets


def dequantize_int4_channels(
    codes: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    d: int,
    group: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``x̂ = code · scale + offset`` ``[..., n, d]`` in ``dtype`` from ``codes`` uint8 ``[..., n, ceil(d / 2)]``,
    ``scales`` and ``offsets`` fp16 ``[..., ceil(n / g), d]`` (as returned by `quantize_int4_channels` with the same
    ``group``); formed in FP32."""
    signed = unpack_int4(codes, d)
    if signed.dim() < 2:
        raise ValueError(f"codes must be [..., n, ceil(d / 2)] with at least two dimensions, got {tuple(codes.shape)}")
    rows = signed.shape[-2]
    size = _group_size(group, rows)
    expected = (*signed.shape[:-2], -(-rows // size), d)
    for name, tensor in (("scales", scales), ("offsets", offsets)):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float16:
            raise TypeError(f"{name} must be an fp16 tensor [..., groups, d], got {getattr(tensor, 'dtype', tensor)}")
        if tuple(tensor.shape) != expected:
            shape = tuple(tensor.shape)
            raise ValueError(f"{name} must have shape {expected} for {rows} rows in groups of {size}, got {shape}")
    return (signed.float() * _per_row(scales, size, rows) + _per_row(offsets, size, rows)).to(dtype)


def _per_row(per_group: torch.Tensor, size: int, rows: int) -> torch.Tensor:
    """``[..., groups, d]`` fp16 to ``[..., rows, d]`` fp32, each group's row repeated for its ``size`` rows."""
    return per_group.float().repeat_interleave(size, dim=-2)[..., :rows, :]
