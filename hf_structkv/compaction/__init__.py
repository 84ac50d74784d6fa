"""Offline compaction: per-head methods (`compact_head`) and the end-to-end `compact(...)` pipeline."""

from .methods import HEAD_METHODS, CompactedHead, HeadMethod, compact_head, register, relative_loss
from .pipeline import METHODS, compact, prefill_context
from .queries import capture_queries, repeat_pass_queries, subsample_queries

__all__ = [
    "HEAD_METHODS",
    "METHODS",
    "CompactedHead",
    "HeadMethod",
    "capture_queries",
    "compact",
    "compact_head",
    "prefill_context",
    "register",
    "relative_loss",
    "repeat_pass_queries",
    "subsample_queries",
]
