"""Heavy hitters by accumulated attention (H2O's ranking), shared by `H2O` (others released) and `MiKV` (others INT4).

The cache decides a token once, when it leaves the recent window, and never undoes it; H2O instead re-ranks its whole
cache every step and evicts the least attended entry. The adaptation, per layer group, with heavy ratio ``r``:

* prompt (decided at once after the prompt forward, from the mass every prompt query gave): the first ``sink_tokens``
  real tokens are ``H``; of the other ``m`` real tokens the ``⌊r·m⌋`` with the largest accumulated mass are ``H``
  (ties: earlier position first), the rest get the low action;
* generated token at slot ``p`` (decided when it leaves the window, from the mass accumulated so far): with ``n``
  non-sink tokens decided so far, this one included, ``k`` heavy hitters kept and ``room = ⌊r·n⌋ - k``, it is ``H``
  iff ``room >= 2``, or ``room == 1`` and its mass is at least the smallest current mass of a kept heavy hitter;
  otherwise the low action. H2O evicts the least attended entry when over budget; kept entries here are final, so a
  newcomer that would be that entry (its mass below every kept one's) is refused while only one slot is free — the
  refusal leaves one slot unused, and the next newcomer is admitted. The heavy set therefore stays within one token of
  ``⌊r·(tokens)⌋``: the measured ``B`` equals the `expected_budget` arithmetic on the prompt and falls short of it by
  at most one token per layer group on the generated part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...attention.attention_mass import AttentionMass, TokenStatistics
from ...validation import check_int
from ..costs import Action, GroupCosts
from ..table import DEFAULT_WINDOW
from .base import (
    BaselineController,
    BudgetKnob,
    DevelopmentLengths,
    check_costs,
    check_lengths,
    check_ratio,
    sink_mask,
)


def heavy_count(ratio: float, tokens: int) -> int:
    """``⌊ratio · tokens⌋`` (with a 1e-9 guard against binary rounding of the ratio)."""
    return math.floor(ratio * tokens + 1e-9)


class HeavyHitterController(BaselineController):
    """Per-sequence heavy-hitter decisions (module docstring) with ``low`` for the others."""

    def __init__(self, costs: GroupCosts, sinks: int, ratio: float, low: Action):
        super().__init__(costs)
        self.sinks, self.ratio, self.low = sinks, ratio, low
        groups = len(costs.groups)
        self.prompt_heavy: list[list[int]] = [[] for _ in range(groups)]
        self.prompt_others = 0

    def plan_prompt(self, mass: torch.Tensor, real: torch.Tensor, weighted: torch.Tensor | None = None) -> torch.Tensor:
        """``[P, groups]`` actions of the prompt from ``mass`` ``[groups, P]`` and ``real`` bool ``[P]`` (``weighted``
        unused: heavy hitters rank by attention mass alone)."""
        groups = len(self.costs.groups)
        sinks = sink_mask(real, self.sinks)
        others = (real & ~sinks).nonzero().flatten()
        self.prompt_others = len(others)
        keep = heavy_count(self.ratio, len(others))
        plan = torch.full((real.shape[0], groups), int(Action.R), dtype=torch.int64)
        plan[real] = int(self.low)
        plan[sinks] = int(Action.H)
        for group in range(groups):
            order = torch.sort(-mass[group, others], stable=True).indices
            heavy = others[order[:keep]]
            plan[heavy, group] = int(Action.H)
            self.prompt_heavy[group] = heavy.tolist()
        return plan

    def decide(self, statistics: TokenStatistics) -> tuple[Action, ...]:
        groups = len(self.costs.groups)
        if statistics is None:
            raise ValueError("heavy-hitter controllers decide from attention statistics: use them in a cache")
        position, mass = statistics
        if position < self.sinks:
            return (Action.H,) * groups
        decided = [(p, a) for p, a in zip(self.positions, self.decisions) if a is not None and p >= self.sinks]
        budget = heavy_count(self.ratio, self.prompt_others + len(decided) + 1)
        actions = []
        for group in range(groups):
            kept = self.prompt_heavy[group] + [p for p, a in decided if a[group] == Action.H]
            room = budget - len(kept)
            keep = room >= 2 or (room == 1 and (not kept or bool(mass[group, position] >= mass[group, kept].min())))
            actions.append(Action.H if keep else self.low)
        return tuple(actions)


@dataclass(frozen=True)
class HeavyHitterPolicy(BudgetKnob):
    """Sinks, a recent window and a heavy-hitter set of ratio ``heavy_ratio`` (module docstring); subclasses set
    ``LOW``, the action of the others."""

    costs: GroupCosts
    sink_tokens: int = 4
    window: int = DEFAULT_WINDOW
    heavy_ratio: float = 0.2

    LOW = Action.R
    BUDGET_KNOB = "heavy_ratio"

    def __post_init__(self) -> None:
        object.__setattr__(self, "costs", check_costs(self.costs))
        check_int("sink_tokens", self.sink_tokens, 0)
        check_int("window", self.window, 1)
        object.__setattr__(self, "heavy_ratio", check_ratio("heavy_ratio", self.heavy_ratio))

    def attention_statistics(self) -> AttentionMass:
        """Mass from every query row of every forward (accumulated attention)."""
        return AttentionMass(len(self.costs.groups))

    def controller(self, costs: GroupCosts) -> HeavyHitterController:
        if costs != self.costs:
            raise ValueError(f"this policy was built for group costs {self.costs}, the model's are {costs}")
        return HeavyHitterController(costs, self.sink_tokens, self.heavy_ratio, self.LOW)

    def expected_budget(self, lengths: DevelopmentLengths) -> float:
        """The measured ``B`` up to one generated token per layer group (module docstring): per sequence of ``n``
        tokens, ``s = min(sinks, n)`` sinks and ``h = ⌊r·(n - s)⌋`` heavy hitters at ``H``, the others at ``LOW``."""
        pairs = check_lengths(lengths)
        full, low = self.costs.full, self.costs.total((self.LOW,) * len(self.costs.groups))
        payload = 0
        for p, d in pairs:
            n = p + d
            high = min(self.sink_tokens, n) + heavy_count(self.heavy_ratio, n - min(self.sink_tokens, n))
            payload += high * full + (n - high) * low
        return payload / (full * sum(p + d for p, d in pairs))
