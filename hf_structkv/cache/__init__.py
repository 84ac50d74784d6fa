"""Cache layers and caches."""

from .compacted import CompactedCache
from .compacted_layers import CompactedLayer, SharedContextSlidingLayer

__all__ = ["CompactedCache", "CompactedLayer", "SharedContextSlidingLayer"]
