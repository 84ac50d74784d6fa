"""Symmetric per-row INT4 quantisation with two signed nibbles per byte (PASK B.5).

Each row of the last dimension (one token x KV head row of K or V) gets its own scale ``max|x| / 7``, clamped to
the largest finite FP16 (``65504``: beyond ``|x| = 7 * 65504`` the codes saturate instead of the scale overflowing to
inf, which would dequantise to NaN), rounded to FP16 and floored at the smallest positive FP16 (``2**-24``); codes
are ``clip(round(x / scale), -7, 7)`` (round half to even, as ``torch.round``), stored as 4-bit two's complement:
element ``2i`` in the low nibble of byte ``i``, element ``2i + 1`` in its high nibble; an odd last dimension is
padded with a zero code. An all-zero row gets zero codes and scale 1.
"""

from __future__ import annotations

import torch

from ..validation import is_int

SMALLEST_FP16 = 2.0**-24
"""The smallest positive (subnormal) FP16 value: the floor of every scale."""
LARGEST_FP16 = 65504.0
"""The largest finite FP16 value: the ceiling of every scale."""


def _check_float(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor (fp32/fp16/bf16), got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{name} must have a non-empty last dimension, got shape {tuple(x.shape)}")
    return x


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise each row of ``x`` ``[..., d]`` to INT4.

    Returns:
        ``(codes, scales)``: ``codes`` uint8 ``[..., ceil(d / 2)]`` (two nibbles per byte), ``scales`` fp16
        ``[..., 1]``, finite for every finite ``x``. Dequantised values are ``code * scale``; every element is
        within ``scale / 2`` of ``x`` unless ``|x|`` exceeds ``7 * scale`` after the FP16 rounding of the scale, or
        the row's ``max|x|`` exceeds ``7 * 65504`` (then the code saturates at +-7).
    """
    x = _check_float("x", x)
    if not torch.isfinite(x).all():
        raise ValueError("x must be finite (no NaN or inf) to be quantised")
    xf = x.float()
    peak = xf.abs().amax(dim=-1, keepdim=True)
    scales = (peak / 7.0).clamp_max(LARGEST_FP16).to(torch.float16).clamp_min(SMALLEST_FP16)
    scales = torch.where(peak == 0, torch.ones_like(scales), scales)
    codes = torch.round(xf / scales.float()).clamp_(-7, 7).to(torch.int8)
    return pack_int4(codes), scales


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Packed uint8 ``[..., ceil(d / 2)]`` from signed int8 ``codes [..., d]`` in ``[-8, 7]``: element ``2i`` in the
    low nibble of byte ``i``, element ``2i + 1`` in its high nibble, an odd ``d`` padded with a zero code (the
    inverse of `unpack_int4`)."""
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    nibbles = (codes & 0x0F).to(torch.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(codes: torch.Tensor, d: int) -> torch.Tensor:
    """Signed codes int8 ``[..., d]`` in ``[-8, 7]`` from packed ``codes`` uint8 ``[..., ceil(d / 2)]``."""
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError(f"codes must be a uint8 tensor of packed nibbles, got {getattr(codes, 'dtype', type(codes))}")
    if not is_int(d) or d < 1 or codes.shape[-1] != (d + 1) // 2:
        raise ValueError(f"d must be the unpacked row length with ceil(d / 2) == {codes.shape[-1]}, got {d!r}")
    pairs = torch.stack((codes & 0x0F, codes >> 4), dim=-1).flatten(-2)[..., :d]
    return (pairs.to(torch.int8) ^ 8) - 8


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, d: int, dtype: torch.dtype = torch.float32):
    """``x̂ = code * scale`` ``[..., d]`` in ``dtype`` from ``codes`` uint8 ``[..., ceil(d/2)]`` and ``scales``
    fp16 ``[..., 1]`` (as returned by `quantize_int4`); the product is formed in FP32."""
    values = unpack_int4(codes, d)
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float16:
        raise TypeError(f"scales must be an fp16 tensor [..., 1], got {getattr(scales, 'dtype', type(scales))}")
    if scales.shape != (*codes.shape[:-1], 1):
        raise ValueError(f"scales must have shape {(*codes.shape[:-1], 1)}, got {tuple(scales.shape)}")
    return (values.float() * scales.float()).to(dtype)
