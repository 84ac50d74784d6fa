"""The reserve ``Γ`` (eqs. 10, 16, B.6, Prop. 4) from reference floor costs.

For a reference trajectory with non-stop tokens ``0 .. T − 1`` of floor costs ``f_u`` (bits, ``Σ_c m(a⁻, c)``) and
allowance ``b = B_D · C_full`` per token: ``S^(K)_u = max_{0 <= h <= min(K, T − 1 − u)} [Σ_{j=1..h} f_{u+j} − h·b]_+``.
``Γ(s)`` is the left empirical ``β``-quantile of ``S^(K)`` over the positions in parser state ``s`` (the value of rank
``⌈βN⌉`` among ``N`` sorted samples); the pooled quantile over every position serves unseen states. A position whose
token has several candidate states counts for each of them (the controller reserves the max over a token's
candidates); an unresolved token (no candidates) counts only in the pooled sample.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from ..validation import check_int

__all__ = [
    "DEFAULT_RESERVE_HORIZON",
    "DEFAULT_RESERVE_QUANTILE",
    "left_quantile",
    "reserve_statistics",
    "reserve_table",
]

DEFAULT_RESERVE_HORIZON = 8
DEFAULT_RESERVE_QUANTILE = 0.8


def reserve_statistics(floor_costs: Sequence[float], allowance: float, horizon: int) -> list[float]:
    """``S^(K)_u`` for every position ``u`` of one trajectory (eq. 16)."""
    check_int("horizon (K)", horizon, 0, counts="lookahead tokens")
    stats = []
    for u in range(len(floor_costs)):
        best, running = 0.0, 0.0
        for h in range(1, min(horizon, len(floor_costs) - 1 - u) + 1):
            running += floor_costs[u + h] - allowance
            best = max(best, running)
        stats.append(best)
    return stats


def left_quantile(values: Iterable[float], beta: float) -> float:
    """The left empirical ``β``-quantile ``inf{x : F̂(x) >= β}``: the ``⌈βN⌉``-th smallest of ``N`` values.

    Raises:
        ValueError: no values, or ``β`` outside ``(0, 1]``.
    """
    ordered = sorted(values)
    if not ordered:
        raise ValueError("left_quantile needs at least one value")
    if not 0 < beta <= 1:
        raise ValueError(f"beta must be in (0, 1], got {beta!r}")
    n = len(ordered)
    rank = max(math.ceil(beta * n), 1)  # then corrected so that rank is the least k with k / n >= beta in floats
    while rank > 1 and (rank - 1) / n >= beta:
        rank -= 1
    while rank < n and rank / n < beta:
        rank += 1
    return ordered[rank - 1]


def reserve_table(
    floor_costs: Sequence[Sequence[float]],
    states: Sequence[Sequence[frozenset[str]]],
    allowance: float,
    horizon: int = DEFAULT_RESERVE_HORIZON,
    beta: float = DEFAULT_RESERVE_QUANTILE,
) -> tuple[dict[str, float], float]:
    """``(Γ by state, pooled Γ)`` in bits over reference trajectories (eq. 10).

    Args:
        floor_costs: per trajectory, the floor cost of each non-stop token.
        states: per trajectory, the set of candidate parser states of each of those tokens (empty = unresolved).
        allowance: ``b = B_D · C_full``.
    """
    if len(floor_costs) != len(states) or any(len(f) != len(s) for f, s in zip(floor_costs, states)):
        raise ValueError("floor_costs and states must have one entry per token of each trajectory")
    by_state: dict[str, list[float]] = {}
    pooled: list[float] = []
    for costs, token_states in zip(floor_costs, states):
        for stat, candidates in zip(reserve_statistics(costs, allowance, horizon), token_states):
            pooled.append(stat)
            for state in candidates:
                by_state.setdefault(state, []).append(stat)
    if not pooled:
        return {}, 0.0
    return {state: left_quantile(v, beta) for state, v in sorted(by_state.items())}, left_quantile(pooled, beta)
