"""A decode step (one query per row) over the INT4 heads of a compacted prefix that are read from their codes: each
head's prefix statistics (`int4_head_stats`) merged with its appended tokens' (`merge_partitions`), for every such
head of a layer at once.

On the CPU, where the C kernel builds (`native_int4`), the whole step runs in one call per layer: the prefix read from
its codes (scales and offsets in fp16 as stored), the appended tokens and the merge, with no torch operation per
head, written straight into the layer's output. Elsewhere the heads go one at a time
through `int4_head_stats`, `partition_stats` and `merge_partitions`. Both give the same outputs up to rounding.
"""

from __future__ import annotations

import torch

from .compacted_inputs import CompactedPrefix
from .int4_head_stats import int4_head_stats, reads_codes
from .native_int4 import native_int4_decode, runs_natively
from .partitions import merge_partitions, partition_stats


def int4_decode_attention(
    query: torch.Tensor,
    prefix: CompactedPrefix,
    heads: list[int],
    appended_keys: torch.Tensor,
    appended_values: torch.Tensor,
    add_mask: torch.Tensor,
    scaling: float,
    out: torch.Tensor,
) -> None:
    """Attention outputs of the query heads of KV heads ``heads`` over the prefix and the appended tokens, written to
    their rows of ``out`` (the other query heads' rows are left as they are).

    Args:
        query: ``[B, H_q, 1, D]`` queries of every query head of the layer (``g = H_q / H_kv`` per KV head).
        prefix: the layer's compacted prefix; every head in ``heads`` is read from codes (`reads_codes`).
        heads: KV heads, non-empty.
        appended_keys: ``[B, H_kv, n, D]`` and appended_values: ``[B, H_kv, n, D_v]``, the appended tokens.
        add_mask: ``[B | 1, 1, 1, n]`` float32 additive mask over the appended tokens.
        scaling: logit scale.
        out: ``[B, H_q, D_v]`` float32 contiguous; a row that sees no key gets zeros.

    Raises:
        ValueError: a head is not read from codes, or ``query`` is not one query per row.
    """
    if not heads or not all(reads_codes(prefix, h) for h in heads):
        raise ValueError(f"heads must be a non-empty list of KV heads read from codes (reads_codes), got {heads}")
    batch, n_q, q_len, dim = query.shape
    if q_len != 1:
        raise ValueError(f"query must hold one query per row at a decode step, got {q_len}")
    group = n_q // prefix.num_kv_heads
    query = query.to(torch.float32)
    if runs_natively(query.device, dim, prefix.values.shape[-1]):
        keys, values = appended_keys.to(torch.float32), appended_values.to(torch.float32)
        mask = add_mask.reshape(add_mask.shape[0], -1)
        native_int4_decode(query, scaling, heads, prefix, keys, values, mask, out)
        return
    for h in heads:
        query_h = query[:, h * group : (h + 1) * group]  # [B, g, 1, D]
        scores = query_h @ appended_keys[:, h : h + 1].to(torch.float32).transpose(-1, -2) * scaling + add_mask
        appended_part = partition_stats(scores, appended_values[:, h : h + 1])
        merged = merge_partitions([int4_head_stats(query_h, prefix, h, scaling), appended_part])  # [B, g, 1, D_v]
        out[:, h * group : (h + 1) * group] = merged[:, :, 0]
