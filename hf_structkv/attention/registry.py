"""hf_structkv's attention function, registered with transformers' ``AttentionInterface`` under our own name.

Nothing is registered at import: ``enable(model)`` registers (idempotently) and switches the model to it. For
ordinary caches the function is transformers' own SDPA path and its mask is transformers' ``sdpa_mask`` (sliding
windows over padded rows measured in positions, see ``masks``), so an enabled model behaves as the stock ``"sdpa"``
implementation; for a compacted layer it serves the compacted prefix with its biases.

With the environment variable ``HF_STRUCTKV_DEBUG=1`` every output served over a compacted or mixed-precision cache is
checked for NaN and inf (one reduction per layer and step), so a cache that the checks at load could not catch fails
at the layer that produced the bad value instead of as wrong tokens.
"""

from __future__ import annotations

import os

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from .backend import compacted_attention_for, mixed_precision_attention_for
from .compacted_inputs import AppendedTokens
from .kwargs import MIXED_KWARG, PREFIX_KWARG
from .masks import structkv_mask
from .mixed_reference import PrefixPartition

ATTENTION_NAME = "hf_structkv"
DEBUG_VARIABLE = "HF_STRUCTKV_DEBUG"


def _checked(out: torch.Tensor, module: torch.nn.Module, cache: str) -> tuple[torch.Tensor, None]:
    """``(out, None)``; under ``HF_STRUCTKV_DEBUG=1``, after checking that ``out`` is finite."""
    if os.environ.get(DEBUG_VARIABLE) == "1" and not torch.isfinite(out).all():
        raise ValueError(
            f"the attention output of layer {getattr(module, 'layer_idx', '?')} over the {cache} cache holds NaN or "
            f"inf ({DEBUG_VARIABLE}=1): the cache holds values this model cannot serve"
        )
    return out, None


def structkv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention for models switched to ``"hf_structkv"``.

    Args:
        query: ``[B, H_q, q, D]``; key / value: ``[B, H_kv, n, D]`` as returned by the cache layer's ``update``.
        attention_mask: the mask built by the registered mask function (``None``, boolean or additive 4D).
        kwargs: the model's attention kwargs; a `CompactedLayer` puts itself under ``"compacted_prefix"``, a
            `MixedPrecisionLayer` under ``"mixed_precision_layer"`` (its partitions: a compacted context's prefix,
            the stores, the recent region).

    Returns:
        ``([B, q, H_q, D_v], None)``.
    """
    mixed_layer = kwargs.pop(MIXED_KWARG, None)
    if mixed_layer is not None:
        if dropout and module.training:
            raise ValueError("a mixed-precision cache is for inference: put the model in eval mode (dropout must be 0)")
        partitions = mixed_layer.partitions(attention_mask, query.shape[-2], module)
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        # The Triton kernel reads slot stores only: a compacted prefix (PrefixPartition) goes to the torch paths.
        with_prefix = any(isinstance(part, PrefixPartition) for part in partitions)
        attend = mixed_precision_attention_for(query, with_prefix=with_prefix)
        out = attend(query, partitions, scaling=scaling, softcap=kwargs.get("softcap"))
        mixed_layer.record_attention(query, partitions, scaling, kwargs.get("softcap"), module)  # no-op unless asked
        return _checked(out, module, "mixed-precision")
    prefix_layer = kwargs.pop(PREFIX_KWARG, None)
    if prefix_layer is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if dropout and module.training:
        raise ValueError("a compacted cache is for inference: put the model in eval mode (dropout must be 0)")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("a sliding-window layer cannot hold a compacted context; only global layers are compacted")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("attention sinks (s_aux) are not supported with a compacted cache")
    out = compacted_attention_for(query)(
        query,
        prefix_layer.served_prefix(module),
        AppendedTokens(key, value, attention_mask),
        scaling=query.shape[-1] ** -0.5 if scaling is None else scaling,
        softcap=kwargs.get("softcap"),
    )
    return _checked(out, module, "compacted")


def register() -> None:
    """Register the attention function and its mask function under ``ATTENTION_NAME`` (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, structkv_attention)
    # The mask of an appended region is the ordinary causal/padding/sliding mask, sized by the cache's
    # get_mask_sizes; without a registered mask function transformers would silently pass no mask at all.
    AttentionMaskInterface.register(ATTENTION_NAME, structkv_mask)


def enable(model: PreTrainedModel) -> PreTrainedModel:
    """Switch ``model`` (in place) to hf_structkv's attention so it can serve compacted caches; returns it.

    The model keeps behaving exactly as with ``attn_implementation="sdpa"`` for ordinary caches.
    """
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    register()
    model.set_attn_implementation(ATTENTION_NAME)
    return model


def is_enabled(model: PreTrainedModel) -> bool:
    """Whether ``model`` runs hf_structkv's attention."""
    return getattr(model.config, "_attn_implementation", None) == ATTENTION_NAME
