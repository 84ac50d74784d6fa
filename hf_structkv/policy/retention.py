"""What a `StructuredMixedPrecisionCache` needs from a retention policy, so PASK's table, calibration interventions
and decode-time baselines run on the same cache with the same budget accounting.

A *retention policy* is a frozen object with ``costs`` (`GroupCosts` of the model it was built for), ``sink_tokens``,
``window`` and ``controller(costs)``, which makes one fresh *controller* per sequence. A controller is stepped once per
generated token, in token order, when the token is about to leave the recent window; it returns one `Action` per
layer group (``None`` for a stop token) and keeps a ledger of what it scheduled so that speculative decoding can roll
it back. `PolicyTable` (with `PolicyController`, Algorithm 2) is the reference implementation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from ..structure.tags import StructuralTag
from .costs import Action, GroupCosts

__all__ = ["RetentionController", "RetentionPolicy"]


@runtime_checkable
class RetentionController(Protocol):
    """Per-sequence decisions. State changes only in `step` (appends one decision) and `rollback` (drops decisions)."""

    @property
    def scheduled_bits(self) -> int | float:
        """``Σ M(a)`` over the steps so far, in bits (B.3 cost convention; stop tokens free)."""

    @property
    def num_steps(self) -> int:
        """The number of `step` calls so far (stop tokens included)."""

    def step(self, candidates: Sequence[StructuralTag] | None) -> tuple[Action, ...] | None:
        """Decide the next generated token from its candidate tags (``()`` = unresolved, ``None`` = stop token)."""

    def rollback(self, num_steps: int) -> None:
        """Restore the exact state after the first ``num_steps`` steps."""


@runtime_checkable
class RetentionPolicy(Protocol):
    """A frozen retention policy for one model's layer dimensions."""

    costs: GroupCosts
    sink_tokens: int
    window: int

    def controller(self, costs: GroupCosts) -> RetentionController:
        """A fresh controller for one sequence of a model with ``costs`` (raise ``ValueError`` on a mismatch)."""
