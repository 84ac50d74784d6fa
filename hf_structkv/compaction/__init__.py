"""Offline compaction: a context's KV cache in, a `CompactedCache` out."""

from .pipeline import METHODS, compact, prefill_context

__all__ = ["METHODS", "compact", "prefill_context"]
