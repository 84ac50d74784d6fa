"""Calibration buckets (PASK §3.4, A.2): what one intervention acts on.

A *decode bucket* is a full structural-tag key ``class|role|state|next`` and a layer group; a *prefill bucket* is a
prompt-span label (Table 6) and a layer group. Both are a `Bucket`: ``(key, group, groups)``, ``groups`` the number of
layer groups of the calibration (3; 1 in the no-layer-groups ablation, whose one group is every layer).

Occurrence rule (one rule for decode and prefill): a token is an occurrence of bucket ``(z, c)`` when ``z`` is among
its candidate tags (its labels, for a prompt token). A token with several candidates is an occurrence of each of
their buckets: every intervention that could lower it at deployment lowers it during calibration. At deployment the
table resolves such a token to the most protective action over its candidates (eq. 12), so a token that ends up
compressed there was compressed in each intervention of its candidates' buckets. Unresolved tokens (no candidates)
and stop tokens are occurrences of nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from ..policy.costs import GROUP_NAMES, TIED_GROUP_NAME, group_names

__all__ = ["Bucket", "bucket_order", "parse_bucket"]


class Bucket(NamedTuple):
    """One calibration bucket: a tag key (decode) or a prompt label (prefill), and a layer group (0, 1, 2) of
    ``groups`` (3, or 1 when every layer is one group)."""

    key: str
    group: int
    groups: int = 3

    def __str__(self) -> str:
        """``key::lower`` / ``key::middle`` / ``key::upper`` (the paper's ``z_t::{lower,middle,upper}``); ``key::all``
        with one group."""
        return f"{self.key}::{group_names(self.groups)[self.group]}"


def parse_bucket(text: str) -> Bucket:
    """Inverse of ``str(bucket)``.

    Raises:
        ValueError: ``text`` is not ``key::lower``, ``key::middle``, ``key::upper`` or ``key::all``.
    """
    key, sep, group = str(text).rpartition("::")
    if not sep or not key or group not in (*GROUP_NAMES, TIED_GROUP_NAME):
        raise ValueError(f"a bucket is written 'key::lower', 'key::middle', 'key::upper' or 'key::all', got {text!r}")
    if group == TIED_GROUP_NAME:
        return Bucket(key, 0, 1)
    return Bucket(key, GROUP_NAMES.index(group))


def bucket_order(buckets: Iterable[Bucket]) -> list[Bucket]:
    """The fixed serialized tie order of calibration (A.4): buckets sorted by ``(key, group)``."""
    return sorted(set(buckets))
