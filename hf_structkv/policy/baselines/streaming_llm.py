"""StreamingLLM (Xiao et al., 2024) as a retention policy of the mixed-precision cache: attention sinks plus a rolling
recent window; every other token is released.

Prompt: the first ``sink_tokens`` real tokens of each row and its last ``recent_tokens`` prompt tokens (the recent
window StreamingLLM holds when decoding starts) are ``H``, every other prompt token ``R``. Decode: every generated
token is ``R`` when it leaves the cache's ``window`` (the rolling window over generated tokens; the prompt's recent
tokens are not pushed out as decoding proceeds, a small advantage over StreamingLLM for BFCL-length replies). Under
PASK's ledger (`base`) tokens are charged their final action, so the measured ``B`` is
``Σ min(sinks + recent, p) / Σ (p + d)`` over sequences of ``p`` prompt and ``d`` generated tokens, and
``recent_tokens`` is the budget knob.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...attention.attention_mass import AttentionMass
from ...validation import check_int
from ..costs import Action, GroupCosts
from ..table import DEFAULT_WINDOW
from .base import BaselineController, BudgetKnob, DevelopmentLengths, check_costs, check_lengths, sink_mask

__all__ = ["StreamingLLM"]


class _StreamingController(BaselineController):
    def __init__(self, policy: StreamingLLM):
        super().__init__(policy.costs)
        self.sinks = policy.sink_tokens
        self.recent = policy.recent_tokens

    def plan_prompt(self, mass: torch.Tensor, real: torch.Tensor, weighted: torch.Tensor | None = None) -> torch.Tensor:
        """``[P, groups]``: sinks and the last ``recent_tokens`` prompt tokens ``H``, the rest ``R`` (``mass`` and
        ``weighted`` unused)."""
        plan = torch.full((real.shape[0], len(self.costs.groups)), int(Action.R), dtype=torch.int64)
        keep = sink_mask(real, self.sinks)
        if self.recent:
            keep[-self.recent :] |= real[-self.recent :]
        plan[keep] = int(Action.H)
        return plan

    def decide(self, statistics) -> tuple[Action, ...]:
        return (Action.R,) * len(self.costs.groups)


@dataclass(frozen=True)
class StreamingLLM(BudgetKnob):
    """Sinks + recent window, everything else released.

    Args:
        costs: the model's `GroupCosts` (or the model / its config).
        sink_tokens: attention sinks kept ``H`` (>= 0; Table 8 range 2-8).
        window: the cache's recent window in tokens (>= 1; Table 8 range 16-128), over which generated tokens roll.
        recent_tokens: the prompt's last tokens kept ``H`` (>= 0): the budget knob.
    """

    costs: GroupCosts
    sink_tokens: int = 4
    window: int = DEFAULT_WINDOW
    recent_tokens: int = 0

    BUDGET_KNOB = "recent_tokens"
    INTEGER_KNOB = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "costs", check_costs(self.costs))
        check_int("sink_tokens", self.sink_tokens, 0)
        check_int("window", self.window, 1)
        check_int("recent_tokens", self.recent_tokens, 0)

    def attention_statistics(self) -> AttentionMass:
        """No attention mass: only which prompt slots are real (the sinks of a left-padded row)."""
        return AttentionMass(len(self.costs.groups), observation_window=0)

    def controller(self, costs: GroupCosts) -> _StreamingController:
        if costs != self.costs:
            raise ValueError(f"this policy was built for group costs {self.costs}, the model's are {costs}")
        return _StreamingController(self)

    def expected_budget(self, lengths: DevelopmentLengths) -> float:
        """``Σ min(sinks + recent, p) / Σ (p + d)`` over ``(prompt_tokens, decoded_tokens)`` pairs."""
        pairs = check_lengths(lengths)
        kept = self.sink_tokens + self.recent_tokens
        return sum(min(kept, p) for p, d in pairs) / sum(p + d for p, d in pairs)
