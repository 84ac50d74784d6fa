"""MiKV (Yang et al., 2024): importance-ranked mixed precision — heavy hitters by H2O-style accumulated attention are
kept high precision, the other tokens packed INT4 instead of released (PASK's reproduction, Appendix C.3).

The cache quantises to INT4 with one FP16 scale per token x KV-head row (B.5), so Table 8's low-bit width 2 and
group sizes 32 / 64 / 128 are not available: ``low_bits`` accepts 4 only. The lowest reachable ``B`` is the all-INT4
payload ``m(L) / m(H)`` (about 0.27 for head dimension 64) plus the sinks.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..costs import Action
from .heavy_hitters import HeavyHitterPolicy

__all__ = ["MiKV"]


@dataclass(frozen=True)
class MiKV(HeavyHitterPolicy):
    """MiKV on the mixed-precision cache.

    Args:
        costs: the model's `GroupCosts` (or the model / its config).
        sink_tokens: sinks kept ``H``.
        window: recent window.
        heavy_ratio: the high-precision ratio (Table 8: 0.1-0.4; the budget knob).
        low_bits: the low tier's bit width; 4 (the cache's INT4) is the only one available.
    """

    low_bits: int = 4

    LOW = Action.L

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.low_bits != 4:
            raise ValueError(
                f"low_bits={self.low_bits!r}: the mixed-precision cache stores the low tier as INT4 (B.5) only; "
                "use low_bits=4"
            )
