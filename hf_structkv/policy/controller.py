"""PASK's online structural controller (Algorithm 2, §3.5, B.6, B.7): one per sequence.

For each generated non-stop token ``t`` with candidate tags ``U``:

1. ``(a⁰, a⁻, ρ) = table.lookup(U)`` (fallback chain and conservative resolution, eq. 12);
2. ``a = max(a⁰, a⁻)`` per layer group (eq. 11);
3. ``B_t = [R_t − Γ(s_t)]_+`` with ``Γ(s_t)`` the largest reserve over the candidates' parser states (the pooled one
   for an unresolved token): a token that may sit in several states reserves for the most demanding one;
4. while ``M(a) > B_t``, take one adjacent demotion (``H→L`` or ``L→R``, never below the floor) in ascending priority:
   the step from ``a_c`` down to ``a_c − 1`` has priority ``ρ(a_c − 1 → a_c)``, ties go to the lower layer group;
5. if any candidate is critical or lookahead-critical, take adjacent promotions in descending priority (ties: upper
   group first) as long as the next one keeps ``M(a) <= B_t``; the first that would not fit ends the promotions;
6. ``R_{t+1} = R_t − M(a) + b`` with ``b = B_D · C_full`` and ``R_1 = b``: debt (a negative balance) carries.

A stop token (``None``) is free and adds no allowance. Steps with an ambiguous score (``None`` in the lookup) are never
taken. The ledger is kept exactly: balances are integers in units of ``1 / scale`` bits, where ``scale`` is the common
denominator of ``b`` and the reserves (binary fractions, since they are floats), so ``R_t = t·b − Σ M(a_i)`` holds
exactly. Work per token is ``O(|C| log |C|)`` (a heap over the groups, at most two steps per group) and independent of
the history; the per-step ledger history (two integers per step) makes `rollback` exact.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from fractions import Fraction
from typing import Protocol, runtime_checkable

from ..attention.attention_mass import TokenStatistics
from ..structure.tags import STATES, StructuralTag
from ..validation import check_int
from .costs import Action, GroupCosts
from .entries import PolicyLookup
from .retention import RetentionController

__all__ = ["DecodeTable", "PolicyController"]

_ACTIONS = (Action.R, Action.L, Action.H)


@runtime_checkable
class DecodeTable(Protocol):
    """What the controller reads from its frozen table (`PolicyTable` is the implementation)."""

    family: str
    costs: GroupCosts
    budget: float

    def lookup(self, candidates: Iterable[StructuralTag]) -> PolicyLookup:
        """Base actions, floors and priorities per layer group of a token with these candidate tags (eq. 12)."""

    def reserve(self, state: str | None) -> float:
        """``Γ(state)`` in bits (the pooled reserve for ``None``)."""


class PolicyController(RetentionController):
    """Algorithm 2 for one sequence: per-group actions for each generated token under the decode budget.

    Args:
        table: the frozen policy (a `PolicyTable`).
        costs: the layer-group costs of the model the cache serves; must equal ``table.costs``.
    """

    def __init__(self, table: DecodeTable, costs: GroupCosts) -> None:
        if not isinstance(table, DecodeTable):
            raise TypeError(f"table must be a PolicyTable, got {type(table).__name__}")
        if not isinstance(costs, GroupCosts):
            raise TypeError(f"costs must be a GroupCosts (GroupCosts.from_config(model.config)), got {type(costs)}")
        if costs != table.costs:
            raise ValueError(
                f"the policy table was built for other layer dimensions: its group costs are {table.costs}, the "
                f"model's are {costs}; load the table made for this model"
            )
        self._table = table
        self._cost = tuple(tuple(costs.cost(a, c) for a in _ACTIONS) for c in range(len(costs.groups)))
        allowance = Fraction(table.budget) * costs.full
        reserves = {state: Fraction(table.reserve(state)) for state in STATES[table.family]}
        pooled = Fraction(table.reserve(None))
        self._scale = math.lcm(allowance.denominator, pooled.denominator, *(r.denominator for r in reserves.values()))
        self._allowance = int(allowance * self._scale)
        self._reserve = {state: int(r * self._scale) for state, r in reserves.items()}
        self._pooled_reserve = int(pooled * self._scale)
        self._balances = [self._allowance]  # R_{k+1} after k steps, in 1/scale bits
        self._scheduled = [0]  # Σ M(a) after k steps, in bits

    @property
    def balance(self) -> float:
        """``R_t``: the balance (bits) the next token starts from, its allowance included."""
        return self._balances[-1] / self._scale

    @property
    def allowance(self) -> float:
        """``b = B_D · C_full``: the bits each non-stop token adds."""
        return self._allowance / self._scale

    @property
    def scheduled_bits(self) -> int:
        """``Σ M(a)``: the scheduled payload of every token so far, in bits."""
        return self._scheduled[-1]

    @property
    def num_steps(self) -> int:
        """The number of `step` calls so far (stop tokens included)."""
        return len(self._balances) - 1

    def step(
        self, candidates: Sequence[StructuralTag] | None, statistics: TokenStatistics | None = None
    ) -> tuple[Action, ...] | None:
        """Schedule one generated token.

        Args:
            candidates: the token's candidate tags (empty = unresolved: full protection), or ``None`` for a stop
                token / a token after the sequence finished.
            statistics: unused (a `PolicyTable` records no attention statistics, so the cache passes ``None``).

        Returns:
            One action per layer group (lower, middle, upper), or ``None`` for a stop token (no charge, no allowance).
        """
        balance, scheduled = self._balances[-1], self._scheduled[-1]
        if candidates is None:
            self._balances.append(balance)
            self._scheduled.append(scheduled)
            return None
        base, floor, priorities = self._table.lookup(candidates)
        actions = [max(a, f) for a, f in zip(base, floor)]
        reserve = max((self._reserve[tag.state] for tag in candidates), default=self._pooled_reserve)
        budget = max(balance - reserve, 0)
        cost = sum(self._cost[c][a] for c, a in enumerate(actions))
        if cost * self._scale > budget:
            cost = self._demote(actions, floor, priorities, cost, budget)
        if any(tag.protects for tag in candidates):
            cost = self._promote(actions, priorities, cost, budget)
        self._balances.append(balance - cost * self._scale + self._allowance)
        self._scheduled.append(scheduled + cost)
        return tuple(_ACTIONS[a] for a in actions)

    def _demote(self, actions: list[int], floor, priorities, cost: int, budget: int) -> int:
        """Adjacent demotions in ascending ``(priority, group)`` until the cost fits or only floors remain."""
        heap = [
            (priorities[c][a - 1], c)
            for c, a in enumerate(actions)
            if a > floor[c] and priorities[c][a - 1] is not None
        ]
        heapq.heapify(heap)
        while heap and cost * self._scale > budget:
            _, c = heapq.heappop(heap)
            a = actions[c]
            cost -= self._cost[c][a] - self._cost[c][a - 1]
            actions[c] = a - 1
            if a - 1 > floor[c] and priorities[c][a - 2] is not None:
                heapq.heappush(heap, (priorities[c][a - 2], c))
        return cost

    def _promote(self, actions: list[int], priorities, cost: int, budget: int) -> int:
        """Adjacent promotions in descending ``(priority, group)`` while the next one keeps the cost within budget."""
        top = Action.H
        heap = [(-priorities[c][a], -c) for c, a in enumerate(actions) if a < top and priorities[c][a] is not None]
        heapq.heapify(heap)
        while heap:
            c = -heap[0][1]
            a = actions[c]
            step_cost = self._cost[c][a + 1] - self._cost[c][a]
            if (cost + step_cost) * self._scale > budget:
                break
            heapq.heappop(heap)
            cost += step_cost
            actions[c] = a + 1
            if a + 1 < top and priorities[c][a + 1] is not None:
                heapq.heappush(heap, (-priorities[c][a + 1], -c))
        return cost

    def rollback(self, num_steps: int) -> None:
        """Restore the exact state after the first ``num_steps`` steps (speculative-decoding rollback, B.7)."""
        check_int("num_steps", num_steps, 0, self.num_steps, counts="steps taken")
        del self._balances[num_steps + 1 :]
        del self._scheduled[num_steps + 1 :]
