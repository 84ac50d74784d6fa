"""Offline compaction: per-head methods (`compact_head`) and the end-to-end `compact(...)` pipeline."""

from .methods import HEAD_METHODS, CompactedHead, HeadMethod, compact_head, register, relative_loss
from .pipeline import METHODS, compact, prefill_context

__all__ = [
    "HEAD_METHODS",
    "METHODS",
    "CompactedHead",
    "HeadMethod",
    "compact",
    "compact_head",
    "prefill_context",
    "register",
    "relative_loss",
]
