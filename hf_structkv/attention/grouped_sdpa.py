"""SDPA of the query heads that share one KV head, without a copy of its keys and values per query head.

At one query per row (a decode step) the ``g`` query heads of a KV head are ``g`` query rows of that one head:
``[B, g, 1, D]`` is viewed as ``[B, 1, g, D]`` and one SDPA call reads each key and value once for all of them; the
additive mask of the single query position ``[B|1, 1, 1, n]`` broadcasts over those rows. With several queries per
row the rows of a head would need its mask repeated per query head, so there the keys and values are broadcast
(``expand``, a view) over the ``g`` heads instead.
"""

from __future__ import annotations

import torch


def grouped_sdpa(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """``softmax(query · keysᵀ · scale + mask) · values`` for the query heads of one KV head.

    Args:
        query: ``[B, g, q, D]`` the ``g`` query heads of the KV head.
        keys: ``[B, 1, n, D]``; values: ``[B, 1, n, D_v]`` (same dtype as ``query``).
        mask: additive float mask broadcastable to ``[B, 1, q, n]``.
        scale: logit scale.

    Returns:
        ``[B, g, q, D_v]``.
    """
    group, q_len = query.shape[1], query.shape[2]
    if q_len == 1:
        out = torch.nn.functional.scaled_dot_product_attention(
            query.transpose(1, 2), keys, values, attn_mask=mask, scale=scale
        )  # [B, 1, g, D_v]: the query heads as the rows of one head
        return out.transpose(1, 2)
    return torch.nn.functional.scaled_dot_product_attention(
        query, keys.expand(-1, group, -1, -1), values.expand(-1, group, -1, -1), attn_mask=mask, scale=scale
    )
