"""Compacted attention through torch's fused ``scaled_dot_product_attention``: the reference's computation without
its score tensors.

Per KV head the compacted prefix and the appended tokens are one key set, the prefix biases and the appended mask
one additive FP32 mask, and SDPA (FP32 inputs, so FP32 softmax and accumulation) computes the softmax over their
union in one fused call for the KV head's query heads (`grouped_sdpa`: at a decode step they are query rows of the
one KV head, so its keys and values are not copied per query head); the result equals `compacted_attention`'s
partition merge (eq. 15) up to rounding. Its fused kernel works block by block instead of materialising
``[B, g, q, N]`` scores, exponentials and statistics per partition: faster and smaller on long contexts, such as the
uncompacted context served during on-policy calibration (measured in docs/RESULTS.md). Soft-capping (tanh before
the bias) has no SDPA form: the whole call goes to the reference. A KV head with no kept entry can leave a padded
row without any visible key (SDPA's softmax is then NaN where the reference gives zeros): that head alone goes to
the reference. At a decode step (one query per row) an INT4 head with one row of key scales and even dimensions
is read from its codes instead (`int4_decode_attention`, every such head of the layer at once: its softmax
statistics, merged with the appended tokens' by eq. 15, without SDPA and without a copy of its keys per batch row;
one C call per layer on the CPU). Other INT4 heads, and every INT4 head at several
queries per row (a prefill: there SDPA's blocks beat the statistics' whole ``[B·g·q, L]`` scores, by 1.6x to 3.3x
at 16 to 512 queries in an ad hoc CPU timing), are dequantised head by head (`CompactedPrefix.head`) once per
forward, never kept.
"""

from __future__ import annotations

import torch

from .compacted_inputs import AppendedTokens, CompactedPrefix
from .compacted_reference import appended_scores_mask, compacted_attention, kv_grouping
from .grouped_sdpa import grouped_sdpa
from .int4_decode import int4_decode_attention
from .int4_head_stats import reads_codes


def fused_compacted_attention(
    query: torch.Tensor, prefix: CompactedPrefix, appended: AppendedTokens, scaling: float, softcap: float | None = None
) -> torch.Tensor:
    """`compacted_attention` (same arguments, shapes and result) with one fused SDPA call per KV head (at one query
    per row, statistics from the codes for the INT4 heads that `reads_codes`).

    Args:
        query: ``[B, H_q, q, D]``; prefix: `CompactedPrefix` (keys ``[N, D]``, values ``[N, D_v]``, biases ``[N]``,
            ``H_kv + 1`` offsets); appended: `AppendedTokens` (keys / values ``[B, H_kv, n, D]`` /
            ``[B, H_kv, n, D_v]``, mask ``None``, boolean or additive ``[B|1, 1, q, n]``).

    Returns:
        ``[B, q, H_q, D_v]`` in ``query.dtype``.
    """
    n_kv_heads, group = kv_grouping(query, prefix, appended)
    if softcap:
        return compacted_attention(query, prefix, appended, scaling, softcap)
    batch, _, q_len, _ = query.shape
    add_mask = appended_scores_mask(appended.mask, q_len, appended.keys.shape[-2], query.device)
    mask_batch = add_mask.shape[0]
    code_heads = [h for h in range(n_kv_heads) if reads_codes(prefix, h)] if q_len == 1 else []
    result = query.new_empty(batch, q_len, query.shape[1], prefix.values.shape[-1], dtype=torch.float32)
    if code_heads:  # a decode step over INT4 heads: read from their codes, all at once, into their rows of result
        int4_decode_attention(
            query, prefix, code_heads, appended.keys, appended.values, add_mask, scaling, result[:, 0]
        )
    for h in range(n_kv_heads):
        if h in code_heads:
            continue
        heads = slice(h * group, (h + 1) * group)
        appended_h = AppendedTokens(appended.keys[:, h : h + 1], appended.values[:, h : h + 1], appended.mask)
        prefix_keys, prefix_values, prefix_bias = prefix.head(h)
        if prefix_keys.shape[0] == 0:  # no kept entry: a padded row may see no key, only the reference gives zeros
            empty_prefix = CompactedPrefix(prefix_keys, prefix_values, prefix_bias, [0, 0])
            result[:, :, heads] = compacted_attention(query[:, heads], empty_prefix, appended_h, scaling)
            continue
        keys = torch.cat([prefix_keys.float().expand(batch, 1, -1, -1), appended_h.keys.float()], dim=2)
        values = torch.cat([prefix_values.float().expand(batch, 1, -1, -1), appended_h.values.float()], dim=2)
        bias = prefix_bias.to(torch.float32).expand(mask_batch, 1, q_len, -1)
        mask = torch.cat([bias, add_mask.expand(mask_batch, 1, q_len, -1)], dim=-1)
        out = grouped_sdpa(query[:, heads].to(torch.float32), keys, values, mask, scaling)  # [B, g, q, D_v]
        result[:, :, heads] = out.transpose(1, 2)
    return result.to(query.dtype)
