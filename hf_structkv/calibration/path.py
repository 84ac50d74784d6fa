"""Upgrade priorities (eq. 8) and the nested greedy upgrade path of one threshold pair (Algorithm 1, A.4, Prop. 2).

``ρ_D(q, a → a') = [D(q, a) − D(q, a')]_+ / (N̄_q [m(a', c) − m(a, c)])`` for the adjacent upgrades ``R → L`` and
``L → H`` (``D(q, H) = 0``; ``N̄_q`` = mean occurrences of the bucket per reference request; a step that costs
nothing, in a layer group without layers, scores 0).

`greedy_path` starts from the floors and repeatedly takes the eligible adjacent upgrade with the largest priority;
ties follow the fixed serialized bucket order (`bucket_order`: ``(key, group)`` ascending; a bucket has one eligible
upgrade at a time, so the action part of the tie order is implied). Zero-score upgrades stay eligible, so the path
ends at all-high. Each step raises one bucket by one level: the maps are componentwise nondecreasing (nested).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from ..policy.costs import Action, GroupCosts
from .buckets import Bucket, bucket_order

__all__ = ["greedy_path", "upgrade_priorities"]


def upgrade_priorities(
    distortion: Mapping[Bucket, Mapping[Action, float]],
    mean_counts: Mapping[Bucket, float],
    costs: GroupCosts,
) -> dict[Bucket, tuple[float, float]]:
    """``{bucket: (ρ(R→L), ρ(L→H))}`` (eq. 8).

    Args:
        distortion: ``{bucket: {Action.R: D(q, R), Action.L: D(q, L)}}`` (eq. 7).
        mean_counts: ``N̄_q`` per bucket, ``> 0``.
        costs: the model's layer-group costs ``m(a, c)``.

    Raises:
        ValueError: a bucket without a positive mean count or without both distortions.
    """
    priorities = {}
    for bucket, values in distortion.items():
        count = mean_counts.get(bucket, 0)
        if not count > 0:
            raise ValueError(f"bucket {bucket} needs a positive mean count N̄_q, got {count!r}")
        if Action.R not in values or Action.L not in values:
            raise ValueError(f"bucket {bucket} needs D(q, R) and D(q, L), got {dict(values)!r}")
        d = {Action.R: float(values[Action.R]), Action.L: float(values[Action.L]), Action.H: 0.0}
        steps = []
        for low, high in ((Action.R, Action.L), (Action.L, Action.H)):
            extra = costs.cost(high, bucket.group) - costs.cost(low, bucket.group)
            steps.append(max(d[low] - d[high], 0.0) / (count * extra) if extra else 0.0)
        priorities[bucket] = (steps[0], steps[1])
    return priorities


def greedy_path(
    floors: Mapping[Bucket, Action], priorities: Mapping[Bucket, tuple[float, float]]
) -> list[dict[Bucket, Action]]:
    """The nested candidate action maps ``Θ_0 = floors, Θ_1, ..., Θ_J = all-high`` of one threshold pair.

    Args:
        floors: ``{bucket: floor}``.
        priorities: ``{bucket: (ρ(R→L), ρ(L→H))}`` for every bucket of ``floors``.

    Returns:
        ``J + 1`` maps, ``J = Σ_q (H − floor(q))``; map ``i + 1`` is map ``i`` with one bucket raised one level.
    """
    missing = [str(b) for b in floors if b not in priorities]
    if missing:
        raise ValueError(f"priorities lack the buckets {missing}")
    rank = {bucket: index for index, bucket in enumerate(bucket_order(floors))}
    current = {bucket: Action(floors[bucket]) for bucket in rank}
    heap = [(-priorities[b][a], rank[b], b) for b, a in current.items() if a < Action.H]
    heapq.heapify(heap)
    path = [dict(current)]
    while heap:
        _, _, bucket = heapq.heappop(heap)
        current[bucket] = Action(current[bucket] + 1)
        path.append(dict(current))
        if current[bucket] < Action.H:
            heapq.heappush(heap, (-priorities[bucket][current[bucket]], rank[bucket], bucket))
    return path
