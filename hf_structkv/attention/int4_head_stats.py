"""Softmax statistics of an INT4 head of a compacted prefix read from its codes, without dequantising it.

An INT4 head with one row of key scales (`key_groups` is 1: ``key_group`` None, or no more kept entries than it)
serves keys ``k̂[j, c] = code[j, c] · s[c] + o[c]`` (`quantize_int4_channels`: ``o`` is the value of code 0) and values
``v̂[j, c] = vcode[j, c] · t[j]`` (`quantize_int4`). So for a query ``x``

- ``x · k̂[j] = Σ_c (x[c] · s[c]) · code[j, c] + x · o``: the query scaled per channel times the signed codes, plus
  one offset term per query row;
- ``Σ_j w[j] · v̂[j] = Σ_j (w[j] · t[j]) · vcode[j]``: the softmax weights with the value scales folded in, times the
  signed codes.

The codes are packed two per byte, channel ``2i`` in the low nibble of byte ``i`` and ``2i + 1`` in the high one
(`pack_int4`, 4-bit two's complement). Both products run on the codes of the even channels followed by those of the
odd ones, each nibble sign-extended by an arithmetic shift of its byte (no reordering of the codes): the scaled query's
channels are put in that order, and the value sum is put back in channel order. The products are FP32, as the
reference's over dequantised keys and values; the two agree up to rounding. The prefix is shared by the batch, so the
``B · g · q`` query rows of a KV head are the rows of one matrix product (its ``[B·g·q, L]`` scores are formed
whole, as the reference's). A head with several rows of key scales, or an odd key or value dimension, is not read
here (`reads_codes`). `fused_compacted_attention` reads INT4 heads this way at decode steps (one query per row),
through `int4_decode_attention`, whose C kernel computes the same on the CPU.
"""

from __future__ import annotations

import torch

from .compacted_inputs import CompactedPrefix, key_groups
from .partitions import PartitionStats


def reads_codes(prefix: CompactedPrefix, h: int) -> bool:
    """Whether `int4_head_stats` reads KV head ``h`` of ``prefix`` from its codes: an INT4 head with kept entries and
    one row of key scales, in a prefix of even key and value dimensions."""
    quantized = prefix.quantized
    if quantized is None or not quantized.int4_heads[h]:
        return False
    length = prefix.offsets[h + 1] - prefix.offsets[h]
    even = prefix.keys.shape[-1] % 2 == 0 and prefix.values.shape[-1] % 2 == 0
    return even and key_groups(length, quantized.key_group) == 1


def _split_codes(packed: torch.Tensor) -> torch.Tensor:
    """``[L, D]`` float32 signed codes from packed ``[L, D / 2]`` uint8: those of the even channels (low nibbles),
    then those of the odd channels (high nibbles)."""
    return (torch.cat([packed << 4, packed], dim=-1).view(torch.int8) >> 4).to(torch.float32)


def int4_head_stats(query: torch.Tensor, prefix: CompactedPrefix, h: int, scaling: float) -> PartitionStats:
    """`PartitionStats` of INT4 KV head ``h`` of ``prefix`` (scores ``q · k̂ · scaling + bias``, every entry visible)
    for the query heads that read it, from its codes and scales.

    Args:
        query: ``[B, g, q, D]`` float32 queries of the KV head's ``g`` query heads.
        prefix: a prefix whose head ``h`` is read from codes (`reads_codes`).
        h: the KV head.
        scaling: logit scale.

    Returns:
        ``PartitionStats`` with ``row_max`` / ``exp_sum`` ``[B, g, q]`` and ``value_sum`` ``[B, g, q, D_v]``.

    Raises:
        ValueError: head ``h`` is not read from codes, or ``query`` is not float32 of ``D`` channels.
    """
    if not reads_codes(prefix, h):
        raise ValueError(f"KV head {h} is not an INT4 head with one row of key scales and even dimensions")
    dim, value_dim = prefix.keys.shape[-1], prefix.values.shape[-1]
    if query.dtype != torch.float32 or query.dim() != 4 or query.shape[-1] != dim:
        raise ValueError(f"query must be float32 [B, g, q, {dim}], got {query.dtype} {tuple(query.shape)}")
    quantized = prefix.quantized
    start, end = prefix.offsets[h], prefix.offsets[h + 1]
    rows = slice(quantized.row_starts[h], quantized.row_starts[h] + end - start)
    scale_row = quantized.group_starts[h]
    flat = query.reshape(-1, dim)  # [R, D], R = B·g·q
    scaled = flat * quantized.key_scales[scale_row].to(torch.float32)
    scaled = torch.cat([scaled[:, 0::2], scaled[:, 1::2]], dim=-1)  # channels in the order of _split_codes
    offset_term = flat @ quantized.key_offsets[scale_row].to(torch.float32)  # [R]
    scores = scaled @ _split_codes(quantized.key_codes[rows]).T + offset_term[:, None]
    scores = scores * scaling + prefix.bias[start:end].to(torch.float32)  # [R, L]
    row_max = scores.amax(dim=-1)
    # A row whose every bias is -inf has row_max = -inf; shift by 0 there so that exp(-inf) = 0 instead of NaN.
    shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - shift[:, None])
    value_scales = quantized.value_scales[rows, 0].to(torch.float32)  # [L]
    split = (weights * value_scales) @ _split_codes(quantized.value_codes[rows])  # [R, D_v]: even, then odd channels
    value_sum = split.unflatten(-1, (2, value_dim // 2)).transpose(-1, -2).flatten(-2)
    lead = query.shape[:-1]
    return PartitionStats(row_max.view(lead), weights.sum(dim=-1).view(lead), value_sum.view(*lead, value_dim))
