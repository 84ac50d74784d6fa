"""The compacted context of a composed `StructuredMixedPrecisionCache` (``context=``): which layer of a
`CompactedCache` each model layer reads, checked against the model before any forward.

A global-attention layer reads its `CompactedLayer` (the prefix, shared, through ``read_prefix``); a sliding-window
layer gets a `SharedContextSlidingLayer` that shares the context's window tensors (``fresh_copy``), exactly what a
`CompactedCache` serves for it.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from ..persistence import check_same_model, config_fingerprint
from .compacted import CompactedCache
from .compacted_layers import CompactedLayer, SharedContextSlidingLayer
from .layer_types import SLIDING_TYPES


def context_layers(
    context: CompactedCache, config: PretrainedConfig, layer_types: list[str]
) -> list[CompactedLayer | SharedContextSlidingLayer]:
    """Per model layer: the context's `CompactedLayer` itself (global layer; never copied) or a fresh
    `SharedContextSlidingLayer` over the context's window tensors (sliding layer).

    Args:
        context: the compacted context (e.g. a tool catalogue), nothing appended needed (appended tokens are ignored).
        config: the model's config (its text config is read).
        layer_types: the model's layer types, one per layer.

    Raises:
        TypeError: ``context`` is not a `CompactedCache`.
        ValueError: the context was made for another model (fingerprint, layer count, layer kinds, sliding window,
            KV heads, head dim).
    """
    if not isinstance(context, CompactedCache):
        raise TypeError(
            "context must be a CompactedCache (e.g. CompactedCache.from_pretrained(folder, model=model) of a compacted "
            f"tool catalogue), got {type(context).__name__}"
        )
    current = config_fingerprint(config)
    fingerprint = context.metadata.get("fingerprint")
    if isinstance(fingerprint, dict):
        check_same_model(fingerprint, current)
    if len(context.layers) != len(layer_types):
        raise ValueError(
            f"context was compacted for a model of {len(context.layers)} layers, this model has {len(layer_types)}: "
            "compact the context with this model"
        )
    layers: list[CompactedLayer | SharedContextSlidingLayer] = []
    for idx, (layer, layer_type) in enumerate(zip(context.layers, layer_types, strict=True)):
        sliding = layer_type in SLIDING_TYPES
        expected = SharedContextSlidingLayer if sliding else CompactedLayer
        if not isinstance(layer, expected):
            raise ValueError(
                f"context layer {idx} is a {type(layer).__name__}, the model's layer {idx} is {layer_type!r} "
                f"(expected a {expected.__name__}): compact the context with this model"
            )
        for field, held in (("num_key_value_heads", layer.num_kv_heads), ("head_dim", layer.head_dim())):
            if held != current[field]:
                raise ValueError(
                    f"context layer {idx} holds {field} {held}, the model has {current[field]}: compact the context "
                    "with this model"
                )
        if sliding and layer.sliding_window != current["sliding_window"]:
            raise ValueError(
                f"context layer {idx} has sliding window {layer.sliding_window}, the model {current['sliding_window']}"
            )
        layers.append(layer.fresh_copy() if sliding else layer)
    return layers
