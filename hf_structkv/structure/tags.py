"""Structural tags ``z_t = (class, role, state, next)`` (PASK §3.3, Table 5) and their lookup fallback chain."""

from __future__ import annotations

from typing import NamedTuple

TAG_CLASSES = ("pure_scaffold", "schema_bearing", "free_generation")
ROLES = {
    "function_calling": ("scaffold_separator", "required", "optional", "dispatch_key"),
    "sql": ("projection", "relation", "predicate", "outside_schema"),
}
STATES = {"function_calling": ("boundary", "critical"), "sql": ("stable", "boundary", "critical")}
NEXT = ("lookahead_critical", "no_lookahead")


class StructuralTag(NamedTuple):
    """The structural tag of one accepted token: what the grammar says the token is, not what it means."""

    tag_class: str
    role: str
    state: str
    next: str

    def validate(self, family: str = "function_calling") -> StructuralTag:
        """Return ``self`` if every field is in ``family``'s vocabulary (Table 5), else raise ``ValueError``."""
        if family not in ROLES:
            raise ValueError(f"family must be one of {tuple(ROLES)}, got {family!r}")
        for name, value, allowed in (
            ("tag_class", self.tag_class, TAG_CLASSES),
            ("role", self.role, ROLES[family]),
            ("state", self.state, STATES[family]),
            ("next", self.next, NEXT),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed} for the {family} vocabulary, got {value!r}")
        return self

    def fallback_keys(self) -> tuple[str, ...]:
        """Lookup keys from the most to the least specific: ``class|role|state|next``, ``class|role|state``,
        ``class|role``, ``class`` (B.1)."""
        parts = (self.tag_class, self.role, self.state, self.next)
        return tuple("|".join(parts[:n]) for n in (4, 3, 2, 1))

    @property
    def protects(self) -> bool:
        """True for critical or lookahead-critical tags: the controller may promote them (Algorithm 2)."""
        return self.state == "critical" or self.next == "lookahead_critical"

    @classmethod
    def from_key(cls, key: str) -> StructuralTag:
        """Inverse of the full ``class|role|state|next`` key."""
        parts = key.split("|")
        if len(parts) != 4:
            raise ValueError(f"a full tag key has four '|'-separated fields, got {key!r}")
        return cls(*parts)


TAG_VIEWS = ("full", "no_role", "no_class", "no_state_lookahead")
"""What the grammar tells the cache (PASK Fig. 5 structural ablations): ``"full"`` tags, or tags with the role, the
class, or the parser state and lookahead removed. A removed field takes one fixed value of the vocabulary (its first;
``no_lookahead`` for the lookahead), so tags that differ only there become one tag: one calibration bucket, one table
entry. Removing state and lookahead also removes what the controller's promotion protects (`StructuralTag.protects`)."""


def check_tag_view(view: str, family: str) -> None:
    """Raise ``ValueError`` unless ``view`` is one of `TAG_VIEWS` and ``family`` a tag vocabulary family."""
    if view not in TAG_VIEWS:
        raise ValueError(f"tag_view must be one of {TAG_VIEWS}, got {view!r}")
    if family not in ROLES:
        raise ValueError(f"family must be one of {tuple(ROLES)}, got {family!r}")


def view_tags(candidates: tuple[StructuralTag, ...], view: str, family: str) -> tuple[StructuralTag, ...]:
    """A token's candidate tags as ``view`` sees them (`TAG_VIEWS`), duplicates dropped, first occurrence order.

    Args:
        candidates: full tags of ``family``'s vocabulary (``()``: unresolved, stays ``()``).
    """
    check_tag_view(view, family)
    if view == "full":
        return tuple(candidates)
    replace = {
        "no_role": {"role": ROLES[family][0]},
        "no_class": {"tag_class": TAG_CLASSES[0]},
        "no_state_lookahead": {"state": STATES[family][0], "next": "no_lookahead"},
    }[view]
    return tuple(dict.fromkeys(tag._replace(**replace) for tag in candidates))
