"""Which attention kind each decoder layer of a model has, as the caches read it from the config."""

from __future__ import annotations

from transformers import PretrainedConfig

__all__ = ["SLIDING_TYPES", "model_layer_types"]

SLIDING_TYPES = ("sliding_attention", "chunked_attention")
"""Layer types served by a sliding-window layer (every other type is a global-attention layer)."""


def model_layer_types(text_config: PretrainedConfig) -> list[str]:
    """One type per decoder layer: the config's ``layer_types``, or ``"full_attention"`` for every layer."""
    return getattr(text_config, "layer_types", None) or ["full_attention"] * text_config.num_hidden_layers
