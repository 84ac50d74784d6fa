"""What the decode-time baselines share: validation of their knobs, the per-sequence ledger of their controllers,
the prompt's sinks, and the budget arithmetic that picks a knob for a target total ``B`` from development lengths.

Budget accounting is PASK's ledger (B.3, `StructuredGeneration.bytes_report`): a token costs the payload of its
scheduled actions, ``m(H) = 16 n_c``, ``m(L) = 4 n_c + 16 k_c``, ``m(R) = 0`` bits per layer group, whether or not it
still sits in the recent window ("R may still occupy protected-window storage"); ``B`` = scheduled payload / Full-KV
payload of the same tokens. The recent window is therefore free for every method alike (PASK included), and a
method's budget knob is what it keeps beyond the window.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ...attention.attention_mass import TokenStatistics
from ..costs import Action, GroupCosts
from ..retention import RetentionController, RetentionPolicy

__all__ = ["BaselineController", "DevelopmentLengths", "solve_knob"]

DevelopmentLengths = Sequence[tuple[int, int]]
"""``(prompt_tokens, generated_tokens)`` of development cases (from a Full-KV run): what budget arithmetic needs."""


def check_ratio(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def check_costs(costs) -> GroupCosts:
    """``costs`` as `GroupCosts`: a `GroupCosts`, or a model / config to derive them from."""
    if isinstance(costs, GroupCosts):
        return costs
    config = getattr(costs, "config", costs)
    if not hasattr(config, "num_hidden_layers") and not hasattr(config, "get_text_config"):
        raise TypeError(f"costs must be a GroupCosts or a transformers model / config, got {type(costs).__name__}")
    return GroupCosts.from_config(config)


def check_lengths(lengths: DevelopmentLengths) -> list[tuple[int, int]]:
    pairs = [tuple(pair) for pair in lengths]
    if not pairs or not all(
        len(pair) == 2 and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in pair) and pair[0] > 0
        for pair in pairs
    ):
        raise ValueError(
            "lengths must be a non-empty list of (prompt_tokens > 0, generated_tokens >= 0) int pairs "
            "(development cases, e.g. from a Full-KV run)"
        )
    return pairs


def sink_mask(real: torch.Tensor, sinks: int) -> torch.Tensor:
    """Bool ``[P]``: the first ``sinks`` real prompt tokens (``real`` bool ``[P]``; left padding moves them)."""
    return real & (torch.cumsum(real.to(torch.int64), 0) <= sinks)


def solve_knob(expected: Callable[[float], float], target: float, low: float, high: float, steps: int = 40) -> float:
    """The knob in ``[low, high]`` whose ``expected`` budget is closest to ``target`` from below (bisection on a
    budget that does not decrease in the knob); ``low`` when even it exceeds the target, ``high`` when even it falls
    short."""
    if expected(low) >= target:
        return low
    if expected(high) <= target:
        return high
    for _ in range(steps):
        middle = (low + high) / 2
        low, high = (middle, high) if expected(middle) <= target else (low, middle)
    return low


class BaselineController(RetentionController):
    """The per-sequence ledger of a baseline: one decision per `step` (``None`` for a stop token), the scheduled
    bits, and an exact `rollback`. Subclasses implement `decide` (and `plan_prompt`: every baseline records attention
    statistics, if only which prompt slots are real, and plans the prompt)."""

    def __init__(self, costs: GroupCosts):
        self.costs = costs
        self.decisions: list[tuple[Action, ...] | None] = []
        self.positions: list[int | None] = []
        self._bits: list[int] = [0]

    @property
    def scheduled_bits(self) -> int:
        return self._bits[-1]

    @property
    def num_steps(self) -> int:
        return len(self.decisions)

    def step(self, candidates, statistics: TokenStatistics | None = None) -> tuple[Action, ...] | None:
        """Decide the next generated token (``candidates is None``: a stop token, free); ``statistics`` is the
        cache's `TokenStatistics` for policies that record attention."""
        actions = None if candidates is None else self.decide(statistics)
        self.decisions.append(actions)
        self.positions.append(None if statistics is None else statistics.position)
        self._bits.append(self._bits[-1] + (0 if actions is None else self.costs.total(actions)))
        return actions

    def decide(self, statistics) -> tuple[Action, ...]:
        raise NotImplementedError

    def rollback(self, num_steps: int) -> None:
        if not 0 <= num_steps <= self.num_steps:
            raise ValueError(f"num_steps must be in [0, {self.num_steps}], got {num_steps}")
        del self.decisions[num_steps:], self.positions[num_steps:], self._bits[num_steps + 1 :]


class BudgetKnob(RetentionPolicy):
    """The base of the baseline policies, a `RetentionPolicy` with a budget knob: `for_budget` picks the value of the
    class's budget knob (``BUDGET_KNOB``, in ``[0, KNOB_MAX]``, an int when ``INTEGER_KNOB``) whose `expected_budget`
    on development lengths is the largest not above the target (the other knobs fixed)."""

    BUDGET_KNOB: str
    KNOB_MAX: float = 1.0
    INTEGER_KNOB = False

    def expected_budget(self, lengths: DevelopmentLengths) -> float:
        raise NotImplementedError

    @classmethod
    def for_budget(cls, costs, target: float, lengths: DevelopmentLengths, **knobs):
        """The policy with the other ``knobs`` whose budget knob makes `expected_budget` on ``lengths`` (development
        cases only: ``(prompt_tokens, decoded_tokens)`` each) closest to ``target`` from below; the knob's lowest
        value when even that exceeds ``target`` (its `expected_budget` says by how much).

        Raises:
            ValueError: ``target`` outside ``(0, 1]``, malformed ``lengths``, or the budget knob given in ``knobs``.
        """
        if isinstance(target, bool) or not isinstance(target, int | float) or not 0 < target <= 1:
            raise ValueError(f"target must be a total budget B in (0, 1], got {target!r}")
        if cls.BUDGET_KNOB in knobs:
            raise ValueError(f"for_budget chooses {cls.BUDGET_KNOB} itself; pass the other knobs only")
        lengths = check_lengths(lengths)
        high = max(p + d for p, d in lengths) if cls.INTEGER_KNOB else cls.KNOB_MAX

        def make(value: float):
            return cls(costs, **knobs, **{cls.BUDGET_KNOB: int(value) if cls.INTEGER_KNOB else value})

        return make(solve_knob(lambda v: make(v).expected_budget(lengths), target, 0, high))
