"""Envelope (eq. 5) and protection floors (eq. 6) from task sensitivities ``V(q, a)``.

``V̄(q, H) = 0``, ``V̄(q, L) = max(0, V(q, L))``, ``V̄(q, R) = max(V̄(q, L), V(q, R))``; for a threshold pair
``τ = (τ_low, τ_high)`` with ``0 <= τ_low <= τ_high``: floor ``H`` if ``V̄(q, L) > τ_high``, ``R`` if
``V̄(q, R) <= τ_low``, else ``L``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ..policy.costs import Action
from .buckets import Bucket

__all__ = ["DEFAULT_THRESHOLDS", "check_thresholds", "envelope", "protection_floor", "protection_floors"]

DEFAULT_THRESHOLDS = ((0.005, 0.01),)
"""The default threshold pairs ``τ = (τ_low, τ_high)`` (PASK §3.4: 0.5 % and 1 %)."""


def check_thresholds(thresholds) -> tuple[tuple[float, float], ...]:
    """``thresholds`` as a tuple of ``(τ_low, τ_high)`` pairs of finite numbers with ``0 <= τ_low <= τ_high``.

    Raises:
        ValueError: an empty list or a pair that is not ordered, finite and non-negative.
    """
    try:
        pairs = tuple((float(low), float(high)) for low, high in thresholds)
    except (TypeError, ValueError):
        raise ValueError(f"thresholds must be a list of (tau_low, tau_high) number pairs, got {thresholds!r}") from None
    if not pairs:
        raise ValueError("thresholds must hold at least one (tau_low, tau_high) pair, e.g. [(0.005, 0.01)]")
    for low, high in pairs:
        if not (math.isfinite(low) and math.isfinite(high) and 0 <= low <= high):
            raise ValueError(f"each threshold pair needs 0 <= tau_low <= tau_high (finite), got ({low}, {high})")
    return pairs


def envelope(v_low: float, v_release: float) -> tuple[float, float]:
    """``(V̄(q, L), V̄(q, R))`` from the measured ``V(q, L)`` and ``V(q, R)`` (eq. 5)."""
    bar_low = max(0.0, float(v_low))
    return bar_low, max(bar_low, float(v_release))


def protection_floor(v_low: float, v_release: float, tau_low: float, tau_high: float) -> Action:
    """The floor ``a_min^τ(q)`` of one bucket from its measured ``V(q, L)``, ``V(q, R)`` (eqs. 5, 6)."""
    bar_low, bar_release = envelope(v_low, v_release)
    if bar_low > tau_high:
        return Action.H
    if bar_release <= tau_low:
        return Action.R
    return Action.L


def protection_floors(
    sensitivity: Mapping[Bucket, Mapping[Action, float]], tau: tuple[float, float]
) -> dict[Bucket, Action]:
    """Floors of every bucket for one threshold pair.

    Args:
        sensitivity: ``{bucket: {Action.L: V(q, L), Action.R: V(q, R)}}``.
        tau: ``(τ_low, τ_high)``.
    """
    ((low, high),) = check_thresholds([tau])
    return {bucket: protection_floor(v[Action.L], v[Action.R], low, high) for bucket, v in sensitivity.items()}
