"""The attention-kwarg names under which a cache layer hands itself to hf_structkv's attention function.

A cache layer's ``update`` puts itself into the kwargs dict that the model later splats into its attention call;
the registered attention function (`registry.structkv_attention`) pops it from there. The names live here, below the
cache, so that the attention layer owns them and the cache layers import them downward.
"""

PREFIX_KWARG = "compacted_prefix"  # a `CompactedLayer`: its compacted context is served beside the appended tokens
MIXED_KWARG = "mixed_precision_layer"  # a `MixedPrecisionLayer`: its partitions replace the dense keys and values
