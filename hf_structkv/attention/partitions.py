"""Softmax statistics of disjoint key partitions and their exact merge (ALGORITHMS.md §2, eq. 15).

Attention over keys split into disjoint partitions (a compacted prefix and the appended tokens; or a BF16 store,
an INT4 store and the current tokens) equals the merge of per-partition statistics: each partition ``j`` gives its
row maximum ``m_j``, its exp-sum ``l_j = Σ exp(s - m_j)`` and its unnormalised value sum ``u_j = Σ exp(s - m_j) v``;
then ``o = Σ_j e^{m_j - m} u_j / Σ_j e^{m_j - m} l_j`` with ``m = max_j m_j``. All statistics are FP32.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch


class PartitionStats(NamedTuple):
    """FP32 softmax statistics of one key partition for a block of query rows.

    Attributes:
        row_max: ``[..., q]`` largest score of each query row (``-inf`` where the row sees no key of the partition).
        exp_sum: ``[..., q]`` ``Σ exp(score - row_max)`` (0 where the row sees no key).
        value_sum: ``[..., q, d_v]`` ``Σ exp(score - row_max) · value`` (0 where the row sees no key).
    """

    row_max: torch.Tensor
    exp_sum: torch.Tensor
    value_sum: torch.Tensor


def partition_stats(scores: torch.Tensor, values: torch.Tensor) -> PartitionStats:
    """Statistics of one partition.

    Args:
        scores: ``[..., q, n]`` FP32 logits of the partition, biases added, masked entries ``-inf``.
        values: ``[..., n, d_v]`` values (broadcastable against ``scores``' leading dims); cast to FP32.

    Returns:
        ``PartitionStats``; an empty partition (``n == 0``) or a fully masked row contributes nothing.
    """
    if scores.dtype != torch.float32:
        raise TypeError(f"scores must be float32 (softmax statistics are FP32), got {scores.dtype}")
    if scores.shape[-1] == 0:
        shape = scores.shape[:-1]
        d_v = values.shape[-1]
        return PartitionStats(
            scores.new_full(shape, float("-inf")),
            scores.new_zeros(shape),
            scores.new_zeros((*shape, d_v)),
        )
    row_max = scores.amax(dim=-1)
    # A fully masked row has row_max = -inf; shift by 0 there so that exp(-inf) = 0 instead of NaN.
    shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - shift.unsqueeze(-1))
    return PartitionStats(row_max, weights.sum(dim=-1), weights @ values.to(torch.float32))


def merge_partitions(parts: Sequence[PartitionStats]) -> torch.Tensor:
    """Exact softmax attention output over the union of disjoint partitions (eq. 15).

    Args:
        parts: statistics of each partition for the same query rows (shapes ``[..., q]`` and ``[..., q, d_v]``).

    Returns:
        ``[..., q, d_v]`` FP32 output; a row that sees no key in any partition gets zeros.
    """
    if not parts:
        raise ValueError("merge_partitions needs at least one partition")
    row_max = torch.stack([p.row_max for p in parts]).amax(dim=0)
    shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    numerator = torch.zeros_like(parts[0].value_sum)
    denominator = torch.zeros_like(parts[0].exp_sum)
    for p in parts:
        # exp(-inf - shift) = 0 for partitions that the row does not see.
        scale = torch.exp(p.row_max - shift)
        numerator = numerator + scale.unsqueeze(-1) * p.value_sum
        denominator = denominator + scale * p.exp_sum
    safe = torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    return numerator / safe.unsqueeze(-1)
