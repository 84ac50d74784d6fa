"""SnapKV (Li et al., 2024) as a retention policy of the mixed-precision cache: prompt compression from the attention
of an observation window, decode kept high precision.

The attention mass that the last ``observation_window`` prompt queries give each prompt slot (summed over heads and
the group's layers; recorded during the prompt forward only) is pooled along the real prompt tokens (``avg`` or
``max``, odd ``kernel``, stride 1, zero padding ``kernel // 2`` as SnapKV's ``avg_pool1d`` / ``max_pool1d``); per
layer group the observation window itself and the ``⌊ρ·m⌋`` highest-scoring of the other ``m`` real prompt tokens
(ties: earlier first) are ``H``, the rest ``R``. Generated tokens are ``H``. Measured ``B`` per sequence:
``(min(w, P) + ⌊ρ·(P - min(w, P))⌋ + D) / (P + D)`` for ``P`` prompt and ``D`` decoded tokens, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...attention.attention_mass import AttentionMass
from ...validation import check_int
from ..costs import Action, GroupCosts
from ..table import DEFAULT_WINDOW
from .base import BaselineController, BudgetKnob, DevelopmentLengths, check_costs, check_lengths, check_ratio
from .heavy_hitters import heavy_count

__all__ = ["SnapKV"]

POOLINGS = ("avg", "max")


def pool_scores(scores: torch.Tensor, pooling: str, kernel: int) -> torch.Tensor:
    """``scores`` ``[n]`` pooled along the sequence (stride 1, zero padding ``kernel // 2``), ``[n]``."""
    x = scores.view(1, 1, -1).float()
    pool = F.avg_pool1d if pooling == "avg" else F.max_pool1d
    return pool(x, kernel, stride=1, padding=kernel // 2).view(-1)


def top_first(scores: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the ``count`` largest of ``scores`` ``[n]`` (ties: earlier first)."""
    return torch.sort(-scores, stable=True).indices[:count]


class _SnapKVController(BaselineController):
    def __init__(self, policy: SnapKV):
        super().__init__(policy.costs)
        self.policy = policy

    def plan_prompt(self, mass: torch.Tensor, real: torch.Tensor, weighted: torch.Tensor | None = None) -> torch.Tensor:
        """``[P, groups]`` actions from ``mass`` ``[groups, P]`` (the observation window's), ``real`` ``[P]`` and,
        for policies with value-weighted statistics, ``weighted`` ``[groups, P]``."""
        policy, groups = self.policy, len(self.costs.groups)
        slots = real.nonzero().flatten()
        window = min(policy.observation_window, len(slots))
        prefix = slots[: len(slots) - window]
        keep = heavy_count(policy.prompt_ratio, len(prefix))
        plan = torch.full((real.shape[0], groups), int(Action.R), dtype=torch.int64)
        plan[slots[len(prefix) :]] = int(Action.H)

        def pooled(scores: torch.Tensor) -> torch.Tensor:
            return pool_scores(scores[slots], policy.pooling, policy.kernel)[: len(prefix)]

        for group in range(groups):
            scores = pooled(mass[group]), None if weighted is None else pooled(weighted[group])
            plan[prefix[policy.select(*scores, keep)], group] = int(Action.H)
        return plan

    def decide(self, statistics) -> tuple[Action, ...]:
        return (Action.H,) * len(self.costs.groups)


@dataclass(frozen=True)
class SnapKV(BudgetKnob):
    """SnapKV on the mixed-precision cache (module docstring).

    Args:
        costs: the model's `GroupCosts` (or the model / its config).
        observation_window: the last prompt queries whose attention scores the prefix (Table 8: 16-128).
        pooling: ``"avg"`` or ``"max"``; kernel: odd pooling width (Table 8: 3, 5, 7).
        prompt_ratio: kept fraction of the prompt prefix before the observation window (the budget knob).
        window: the cache's recent window.
    """

    costs: GroupCosts
    observation_window: int = 16
    pooling: str = "max"
    kernel: int = 7
    prompt_ratio: float = 0.2
    window: int = DEFAULT_WINDOW
    sink_tokens: int = 0

    BUDGET_KNOB = "prompt_ratio"

    def __post_init__(self) -> None:
        object.__setattr__(self, "costs", check_costs(self.costs))
        check_int("observation_window", self.observation_window, 1)
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if check_int("kernel", self.kernel, 1) % 2 == 0:
            raise ValueError(f"kernel must be odd (SnapKV pools with padding kernel // 2), got {self.kernel}")
        object.__setattr__(self, "prompt_ratio", check_ratio("prompt_ratio", self.prompt_ratio))
        check_int("window", self.window, 1)
        check_int("sink_tokens", self.sink_tokens, 0)

    def attention_statistics(self) -> AttentionMass:
        """Mass from the last ``observation_window`` prompt queries only."""
        return AttentionMass(len(self.costs.groups), observation_window=self.observation_window)

    def select(self, pooled: torch.Tensor, weighted: torch.Tensor | None, keep: int) -> torch.Tensor:
        """The ``keep`` prefix tokens kept ``H`` in one layer group: the largest pooled scores ``[m]``."""
        return top_first(pooled, keep)

    def controller(self, costs: GroupCosts) -> _SnapKVController:
        if costs != self.costs:
            raise ValueError(f"this policy was built for group costs {self.costs}, the model's are {costs}")
        return _SnapKVController(self)

    def expected_budget(self, lengths: DevelopmentLengths) -> float:
        """The measured ``B`` (module docstring) over ``(prompt_tokens, decoded_tokens)`` pairs."""
        pairs = check_lengths(lengths)
        kept = 0
        for p, d in pairs:
            window = min(self.observation_window, p)
            kept += window + heavy_count(self.prompt_ratio, p - window) + d
        return kept / sum(p + d for p, d in pairs)
