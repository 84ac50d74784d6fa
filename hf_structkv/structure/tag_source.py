"""`TagSource`: what a `StructuredMixedPrecisionCache` reads from the processor that tags the generated tokens.

`StructuralLogitsProcessor` is the implementation; a test double only has to offer the same members (the protocol
is structural, checked with ``isinstance`` when the cache is built).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .tags import StructuralTag

__all__ = ["TagSource", "TokenTags"]

TokenTags = tuple[StructuralTag, ...] | None
"""One generated token's candidate tags: empty = unresolved (protect fully), ``None`` = a stop token (no charge)."""


@runtime_checkable
class TagSource(Protocol):
    """The structural tags of each generated token of each sequence of one ``generate`` call.

    Attributes:
        tag_view: the view the tags are emitted in (`TAG_VIEWS`); must be the policy's.
        position_bins: the bin starts of the ``"position_bins"`` view, ``()`` otherwise; must be the policy's.
        prompt_length: the (left-padded) prompt length, ``None`` before the first call: generated token ``i`` of a
            sequence sits at position ``prompt_length + i``.
    """

    tag_view: str
    position_bins: tuple[int, ...]

    @property
    def prompt_length(self) -> int | None: ...

    def num_tagged(self, seq: int) -> int:
        """Number of generated tokens of sequence ``seq`` tagged so far."""

    def tag_at(self, seq: int, index: int) -> TokenTags:
        """The tags of generated token ``index`` (``< num_tagged(seq)``) of sequence ``seq``."""
