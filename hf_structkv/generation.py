"""Inputs for ``model.generate`` on a pre-filled cache whose context tokens the caller may not hold, and fresh copies
of such a cache for a batch of questions."""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import Cache

from .cache.compacted import CompactedCache


def context_copy(cache: Cache, batch: int | None = None) -> Cache:
    """A copy of a context cache to continue without touching it, ready for ``batch`` rows; ``cache`` itself is not
    changed.

    A `CompactedCache` shares its context tensors with the copy (its context serves any batch; it must hold nothing
    appended); any other cache (a prefilled ``DynamicCache``) is deep-copied (transformers' documented way to reuse a
    prompt cache) and, when it holds one row, repeated to ``batch`` rows. ``batch=None`` keeps the cache's rows.

    Raises:
        ValueError: ``batch`` is neither ``None`` nor an integer >= 1, or a non-compacted cache holds neither 1 nor
            ``batch`` rows.
    """
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise ValueError(f"batch must be None or an integer >= 1, got {batch!r}")
    if isinstance(cache, CompactedCache):
        return cache.copy()
    if batch is None:
        return copy.deepcopy(cache)
    rows = cache.layers[0].keys.shape[0]
    if rows not in (1, batch):
        raise ValueError(f"cache holds {rows} rows; copy it for batch 1 or {rows}, not {batch}")
    copied = copy.deepcopy(cache)
    if rows != batch:
        copied.batch_repeat_interleave(batch)
    return copied


def generation_inputs(
    cache: Cache, question_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """``input_ids`` / ``attention_mask`` for ``model.generate(**inputs, cache=cache)``.

    ``generate`` reads only the tokens after the cache's (logical) length and derives positions from the mask, so the
    context part is a run of placeholder ids with mask 1; a left-padded batch of questions keeps its padding, which
    then sits between the shared context and each question.

    A ``CompactedCache`` knows its context's length, so one that already holds appended tokens (a question answered
    on it) is refused: placeholders for those tokens would silently answer the new question after the old one. A
    ``DynamicCache`` cannot tell its context from tokens appended later, so everything it holds is read as context;
    pass ``context_copy(cache)`` to ``generate`` to keep it reusable.

    Args:
        cache: a cache pre-filled with the context (``CompactedCache`` or ``DynamicCache``), nothing appended yet.
        question_ids: ``[B, q]`` token ids (left padded for B > 1).
        attention_mask: ``[B, q]`` tokenizer mask of the question tokens (default: all ones).

    Returns:
        ``{"input_ids": [B, T + q], "attention_mask": [B, T + q]}`` with ``T = cache.get_seq_length()``.

    Raises:
        TypeError: ``cache`` is not a transformers ``Cache``, or ``attention_mask`` is not a tensor.
        ValueError: ``question_ids`` is not ``[B, q]``, ``attention_mask`` has another shape, the cache is empty, or
            a ``CompactedCache`` holds appended tokens.
    """
    if not isinstance(cache, Cache):
        raise TypeError(f"cache must be a transformers Cache pre-filled with the context, got {type(cache).__name__}")
    if not isinstance(question_ids, torch.Tensor) or question_ids.dim() != 2:
        raise ValueError("question_ids must be a [batch, length] LongTensor (tokenizer(..., return_tensors='pt'))")
    if attention_mask is None:
        attention_mask = torch.ones_like(question_ids)
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a tensor [batch, length] or None, got {type(attention_mask).__name__}")
    if attention_mask.shape != question_ids.shape:
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)} but question_ids {tuple(question_ids.shape)}"
        )
    context_length = cache.get_seq_length()
    if context_length == 0:
        raise ValueError("cache is empty: prefill it with the context (or load a CompactedCache) first")
    if isinstance(cache, CompactedCache) and context_length != cache.original_length:
        raise ValueError(
            f"cache holds {context_length - cache.original_length} appended tokens after its "
            f"{cache.original_length}-token context (an earlier question and answer): pass cache.copy() to generate, "
            "or call cache.reset() first"
        )
    batch = question_ids.shape[0]
    placeholders = question_ids.new_zeros(batch, context_length)
    return {
        "input_ids": torch.cat([placeholders, question_ids], dim=1),
        "attention_mask": torch.cat([torch.ones_like(placeholders), attention_mask.to(question_ids.dtype)], dim=1),
    }
