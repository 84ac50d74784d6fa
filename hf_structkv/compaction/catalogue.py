"""Compacting a tool catalogue: the tools rendered by the chat template's tool format (`catalogue_text`), compacted
once and served before every conversation (``generate_calls(..., context=)``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..cache.compacted import CompactedCache
from ..structure.function_calls import function_call_schema
from ..structured_generation import catalogue_metadata, catalogue_text
from .pipeline import compact


def compact_catalogue(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tools: Sequence[Mapping[str, Any]],
    **compact_kwargs,
) -> CompactedCache:
    """`compact` ``catalogue_text(tokenizer, tools)`` and record it in ``metadata["catalogue"]``
    (`catalogue_metadata`: its SHA-256, tokens and tool count), which ``generate_calls(..., context=)`` checks.

    Args:
        tools: BFCL- or OpenAI-style tool definitions (checked first, `function_call_schema`).
        compact_kwargs: `compact`'s options (``ratio``, ``method``, ``queries``, ...).

    Raises:
        TypeError / ValueError: malformed ``tools`` (before any work), or what `compact` raises for its options.
    """
    function_call_schema(tools)
    cache = compact(model, tokenizer, catalogue_text(tokenizer, tools), **compact_kwargs)
    cache.metadata["catalogue"] = catalogue_metadata(tokenizer, tools)
    return cache
