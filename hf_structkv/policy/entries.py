"""What a PASK policy holds per bucket (`PolicyEntry`) and what a lookup returns (`PolicyLookup`), shared by the decode
table (`PolicyTable`) and the prefill policy (`PrefillPolicy`), with the conservative merge of eq. 12."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..structure.tags import view_vocabulary
from ..validation import is_number
from .costs import Action

__all__ = ["UPGRADE_STEPS", "PolicyEntry", "PolicyLookup", "all_high_entries", "is_score", "merge_lookups"]

UPGRADE_STEPS = ("R->L", "L->H")


def is_score(value: Any) -> bool:
    """Whether ``value`` is a valid upgrade priority: a finite number ``>= 0``."""
    return is_number(value) and value >= 0


class PolicyLookup(NamedTuple):
    """What the table gives a token (per layer group): the starting point of Algorithm 2.

    Attributes:
        base: the base action ``a⁰`` per group.
        floor: the floor ``a⁻`` per group (never crossed).
        priorities: per group ``(ρ(R→L), ρ(L→H))``; ``None`` where the score is ambiguous (several entries disagree),
            and such a step is never taken.
    """

    base: tuple[Action, ...]
    floor: tuple[Action, ...]
    priorities: tuple[tuple[float | None, float | None], ...]


@dataclass(frozen=True)
class PolicyEntry:
    """One calibrated bucket: per layer group the base action, the floor and the adjacent-upgrade priorities.

    Attributes:
        action: base action ``a⁰`` per group.
        floor: protection floor ``a⁻`` per group. A floor above the action is allowed: the controller starts from
            ``max(action, floor)`` (eq. 11).
        priorities: per group ``(ρ(R→L), ρ(L→H))``, finite and ``>= 0``: the controller demotes the step with the
            smallest score first and promotes the one with the largest first.
    """

    action: tuple[Action, ...]
    floor: tuple[Action, ...]
    priorities: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        for name in ("action", "floor"):
            values = getattr(self, name)
            if not isinstance(values, tuple) or not all(isinstance(a, Action) for a in values):
                raise TypeError(f"PolicyEntry.{name} must be a tuple of Action values (one per layer group)")
        if not isinstance(self.priorities, tuple) or not all(
            isinstance(pair, tuple) and len(pair) == 2 and all(is_score(s) for s in pair) for pair in self.priorities
        ):
            raise ValueError(
                "PolicyEntry.priorities must be a tuple of (ρ(R->L), ρ(L->H)) pairs of finite numbers >= 0, "
                f"one per layer group, got {self.priorities!r}"
            )
        if not len(self.action) == len(self.floor) == len(self.priorities):
            raise ValueError(
                f"PolicyEntry needs one action, floor and priority pair per layer group, got {len(self.action)} "
                f"actions, {len(self.floor)} floors and {len(self.priorities)} priority pairs"
            )

    def lookup(self) -> PolicyLookup:
        """This entry as a lookup result."""
        return PolicyLookup(self.action, self.floor, self.priorities)


def all_high_entries(
    groups: int, family: str = "function_calling", tag_view: str = "full", position_bins: tuple[int, ...] = ()
) -> dict[str, PolicyEntry]:
    """One ``H`` entry (action, floor, zero priorities in ``groups`` groups) per tag class the view emits: every
    token of that view resolves to ``H``."""
    high = PolicyEntry((Action.H,) * groups, (Action.H,) * groups, ((0.0, 0.0),) * groups)
    classes = dict.fromkeys(tag.tag_class for tag in view_vocabulary(family, tag_view, position_bins))
    return dict.fromkeys(classes, high)


def merge_lookups(results: list[PolicyLookup]) -> PolicyLookup:
    """Eq. 12 over several entries: base = floor = the max of their actions and floors per group; a promotion score
    survives only when every entry has the same one."""
    groups = len(results[0].base)
    top = tuple(max(max(r.base[c], r.floor[c]) for r in results) for c in range(groups))
    priorities = tuple(
        tuple(_unique(r.priorities[c][step] for r in results) for step in range(len(UPGRADE_STEPS)))
        for c in range(groups)
    )
    return PolicyLookup(top, top, priorities)


def _unique(scores: Iterable[float | None]) -> float | None:
    distinct = set(scores)
    return distinct.pop() if len(distinct) == 1 else None
