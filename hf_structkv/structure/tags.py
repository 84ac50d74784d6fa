"""Structural tags ``z_t = (class, role, state, next)`` (PASK §3.3, Table 5) and their lookup fallback chain."""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from itertools import product
from typing import NamedTuple

from ..validation import check_int

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


TAG_VIEWS = ("full", "no_role", "no_class", "no_state_lookahead", "position_bins")
"""What the grammar tells the cache (PASK Fig. 5 structural ablations): ``"full"`` tags, or tags with the role, the
class, or the parser state and lookahead removed. A removed field takes one fixed value of the vocabulary (its first;
``no_lookahead`` for the lookahead), so tags that differ only there become one tag: one calibration bucket, one table
entry. Removing state and lookahead also removes what the controller's promotion protects (`StructuralTag.protects`).
``"position_bins"`` removes the parser transitions altogether (C.5): a generated token's one tag is the bin of its
index in the completion (`position_tag`); the parser still enforces legality but no longer informs the lookup."""

POSITION_CLASS = "position"
"""The class of every position-bin tag (``position|bin_<k>|<first state>|no_lookahead``)."""
DEFAULT_POSITION_BINS = 10
POSITION_COVERAGE = 0.75
"""C.5: every bin is reached by at least this fraction of the calibration requests of every category."""


def check_tag_view(view: str, family: str, position_bins: Sequence[int] = ()) -> tuple[int, ...]:
    """Raise ``ValueError`` unless ``view`` is one of `TAG_VIEWS`, ``family`` a tag vocabulary family and
    ``position_bins`` the bin starts of the ``"position_bins"`` view (strictly increasing ints >= 1; ``()`` for the
    other views). Returns the bins as a tuple."""
    if view not in TAG_VIEWS:
        raise ValueError(f"tag_view must be one of {TAG_VIEWS}, got {view!r}")
    if family not in ROLES:
        raise ValueError(f"family must be one of {tuple(ROLES)}, got {family!r}")
    try:
        bins = tuple(position_bins)
    except TypeError:
        raise ValueError(f"position_bins must be a sequence of ints, got {position_bins!r}") from None
    if view != "position_bins":
        if bins:
            raise ValueError(f"position_bins apply to tag_view='position_bins' only, got {bins!r} with {view!r}")
        return bins
    ints = all(isinstance(b, int) and not isinstance(b, bool) for b in bins)
    if not ints or (bins and bins[0] < 1) or any(b >= c for b, c in zip(bins, bins[1:])):
        raise ValueError(
            "position_bins must be the start indices of bins 1, 2, ... (bin 0 starts at 0): strictly increasing "
            f"ints >= 1, e.g. position_bin_starts(lengths); got {bins!r}"
        )
    return bins


def view_tags(candidates: tuple[StructuralTag, ...], view: str, family: str) -> tuple[StructuralTag, ...]:
    """A token's candidate tags as ``view`` sees them (`TAG_VIEWS`), duplicates dropped, first occurrence order.

    Args:
        candidates: full tags of ``family``'s vocabulary (``()``: unresolved, stays ``()``).

    Raises:
        ValueError: ``view`` is ``"position_bins"``, whose tag depends on the token's index (`position_tag`).
    """
    check_tag_view(view, family)
    if view == "full":
        return tuple(candidates)
    if view == "position_bins":
        raise ValueError("the position_bins view tags a token by its index: use position_tag(index, bins, family)")
    replace = {
        "no_role": {"role": ROLES[family][0]},
        "no_class": {"tag_class": TAG_CLASSES[0]},
        "no_state_lookahead": {"state": STATES[family][0], "next": "no_lookahead"},
    }[view]
    return tuple(dict.fromkeys(tag._replace(**replace) for tag in candidates))


def position_tag(index: int, position_bins: Sequence[int], family: str) -> StructuralTag:
    """The one tag of generated token ``index`` under the ``"position_bins"`` view: ``bin_k`` with ``k`` the number
    of bin starts ``<= index`` (the last bin absorbs the tail); state and lookahead fixed (no parser information)."""
    return StructuralTag(POSITION_CLASS, f"bin_{bisect_right(position_bins, index)}", STATES[family][0], "no_lookahead")


def view_vocabulary(family: str, view: str = "full", position_bins: Sequence[int] = ()) -> list[StructuralTag]:
    """Every tag a processor of ``view`` can emit for ``family`` (the full vocabulary of Table 5 for the field
    views, whose tags are a subset of it; the ``len(position_bins) + 1`` bin tags for ``"position_bins"``)."""
    bins = check_tag_view(view, family, position_bins)
    if view == "position_bins":
        return [position_tag(start, bins, family) for start in (0, *bins)]
    return [StructuralTag(*fields) for fields in product(TAG_CLASSES, ROLES[family], STATES[family], NEXT)]


def position_bin_starts(
    lengths: Mapping[str, Sequence[int]], bins: int = DEFAULT_POSITION_BINS, coverage: float = POSITION_COVERAGE
) -> tuple[int, ...]:
    """Bin starts of the ``"position_bins"`` view from Full-KV calibration completion lengths (C.5).

    ``m`` is the largest length reached by at least ``coverage`` of the requests of every category (per category:
    the ``⌈coverage · n⌉``-th longest completion; then the minimum over categories). Bin ``k`` starts at
    ``⌊k · m / bins⌋``; coinciding starts merge (short completions give fewer bins), and the last bin absorbs the tail.
    Every bin then starts below ``m``, so each is reached by at least ``coverage`` of every category's requests.

    Args:
        lengths: category -> the generated (non-stop) token counts of its calibration requests.
    """
    check_int("bins", bins, 1)
    if not 0 < coverage <= 1:
        raise ValueError(f"coverage must be in (0, 1], got {coverage!r}")
    if not lengths or not all(lengths.values()):
        raise ValueError("lengths must map each category to a non-empty list of completion lengths")
    reached = min(sorted(values, reverse=True)[math.ceil(coverage * len(values)) - 1] for values in lengths.values())
    starts = (k * reached // bins for k in range(1, bins))
    return tuple(sorted({start for start in starts if start >= 1}))
