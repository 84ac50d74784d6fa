"""H2O (Zhang et al., 2023): sinks + recent window + heavy hitters by accumulated attention; the rest released.
The adaptation to decisions that are made once, when a token leaves the window, is in `heavy_hitters`."""

from __future__ import annotations

from dataclasses import dataclass

from ..costs import Action
from .heavy_hitters import HeavyHitterPolicy

__all__ = ["H2O"]


@dataclass(frozen=True)
class H2O(HeavyHitterPolicy):
    """H2O on the mixed-precision cache.

    Args:
        costs: the model's `GroupCosts` (or the model / its config).
        sink_tokens: sinks kept ``H`` (Table 8: 2, 4, 8).
        window: recent window (Table 8: 16, 32, 64, 128).
        heavy_ratio: heavy hitters kept per non-sink token, in ``[0, 1]`` (the budget knob).
    """

    LOW = Action.R
