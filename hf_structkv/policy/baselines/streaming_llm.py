"""StreamingLLM (Xiao et al., 2024) as a retention policy of the mixed-precision cache: attention sinks plus a rolling
recent window; every other token is released.

Prompt: the first ``sink_tokens`` real tokens of each row are ``H``, every other prompt token ``R`` (it stays in the
recent region, at full precision, until it is more than ``window`` tokens old). Decode: every generated token is
``R`` when it leaves the window. Under PASK's ledger (`base`) the window is free, so the measured ``B`` is
``Σ min(sinks, n) / Σ n`` over sequences of ``n`` cached tokens, and the sink count is the budget knob.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...cache.attention_mass import AttentionMass
from ..costs import Action, GroupCosts
from ..table import DEFAULT_WINDOW
from .base import BaselineController, BudgetKnob, DevelopmentLengths, check_costs, check_int, check_lengths, sink_mask

__all__ = ["StreamingLLM"]


class _StreamingController(BaselineController):
    def __init__(self, policy: StreamingLLM):
        super().__init__(policy.costs)
        self.sinks = policy.sink_tokens

    def plan_prompt(self, mass: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """``[P, groups]``: sinks ``H``, everything else ``R`` (``mass`` unused)."""
        plan = torch.full((real.shape[0], len(self.costs.groups)), int(Action.R), dtype=torch.int64)
        plan[sink_mask(real, self.sinks)] = int(Action.H)
        return plan

    def decide(self, statistics) -> tuple[Action, ...]:
        return (Action.R,) * len(self.costs.groups)


@dataclass(frozen=True)
class StreamingLLM(BudgetKnob):
    """Sinks + recent window, everything else released.

    Args:
        costs: the model's `GroupCosts` (or the model / its config).
        sink_tokens: attention sinks kept ``H`` (>= 0; Table 8 range 2-8, larger to reach a budget).
        window: the recent window in tokens (>= 1; Table 8 range 16-128).
    """

    costs: GroupCosts
    sink_tokens: int = 4
    window: int = DEFAULT_WINDOW

    BUDGET_KNOB = "sink_tokens"
    INTEGER_KNOB = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "costs", check_costs(self.costs))
        check_int("sink_tokens", self.sink_tokens, 0)
        check_int("window", self.window, 1)

    def attention_statistics(self) -> AttentionMass:
        """No attention mass: only which prompt slots are real (the sinks of a left-padded row)."""
        return AttentionMass(len(self.costs.groups), observation_window=0)

    def controller(self, costs: GroupCosts) -> _StreamingController:
        if costs != self.costs:
            raise ValueError(f"this policy was built for group costs {self.costs}, the model's are {costs}")
        return _StreamingController(self)

    def expected_budget(self, lengths: DevelopmentLengths) -> float:
        """``Σ min(sinks, n) / Σ n`` over ``(prompt_tokens, decoded_tokens)`` pairs, ``n`` their sum."""
        pairs = check_lengths(lengths)
        return sum(min(self.sink_tokens, p + d) for p, d in pairs) / sum(p + d for p, d in pairs)
