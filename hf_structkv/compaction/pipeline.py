"""The end-to-end ``compact(...)``: read a context once, select per KV head, build a `CompactedCache`.

Only the query-free StreamingLLM rule (attention sinks + the most recent tokens) is available in this release; the
calibrated methods of the KV-Surgeon paper plug in behind the same ``method`` argument.
"""

from __future__ import annotations

import math
import time

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from ..cache.compacted import CompactedCache
from ..hub import model_fingerprint

METHODS = ("streaming_llm",)


def prefill_context(model: PreTrainedModel, context_ids: torch.Tensor) -> DynamicCache:
    """Run the context ``[1, T]`` through ``model`` once; returns the filled ``DynamicCache`` (sliding layers stay sliding)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(context_ids.to(model.device), cache=cache, use_cache=True)
    return cache


def streaming_llm_positions(length: int, budget: int, sink_tokens: int) -> torch.Tensor:
    """Kept positions of StreamingLLM: the first ``sink_tokens`` and the most recent ``budget - sink_tokens``."""
    budget = max(1, min(budget, length))
    sinks = min(sink_tokens, budget)
    recent = torch.arange(length - (budget - sinks), length)
    return torch.cat([torch.arange(sinks), recent])


def compact(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    context: str | torch.Tensor,
    ratio: float = 4.0,
    method: str = "streaming_llm",
    sink_tokens: int = 4,
) -> CompactedCache:
    """Compact ``context`` for ``model`` at compression ``ratio`` (kept entries per KV head = max(1, floor(T / ratio)), so the kept keys and values take at most 1/ratio of the bytes).

    Args:
        context: text (tokenized as is, no special tokens added) or token ids ``[1, T]``.
        ratio: original length / kept entries per KV head, >= 1.
        method: one of ``METHODS``.
        sink_tokens: StreamingLLM attention sinks kept at the start.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if not isinstance(ratio, (int, float)) or not 1 <= ratio < math.inf:
        raise ValueError(f"ratio must be a finite number >= 1 (original / kept entries), got {ratio!r}")
    if not isinstance(sink_tokens, int) or sink_tokens < 0:
        raise ValueError(f"sink_tokens must be an integer >= 0, got {sink_tokens!r}")
    if isinstance(context, str):
        context_ids = tokenizer(context, return_tensors="pt", add_special_tokens=False).input_ids
    else:
        context_ids = context
    if context_ids.dim() != 2 or context_ids.shape[0] != 1 or context_ids.shape[1] == 0:
        raise ValueError("context must be a non-empty text or a [1, T] tensor of token ids")
    start = time.perf_counter()
    cache = prefill_context(model, context_ids)
    length = context_ids.shape[1]
    kept = streaming_llm_positions(length, max(1, math.floor(length / ratio)), sink_tokens)
    indices = [
        None if layer.is_sliding else [kept.clone() for _ in range(layer.keys.shape[1])] for layer in cache.layers
    ]
    metadata = {
        "fingerprint": model_fingerprint(model, tokenizer),
        "method": method,
        "hyperparameters": {"ratio": float(ratio), "sink_tokens": sink_tokens},
        "calibration": "none (query-free selection)",
        "compaction_seconds": round(time.perf_counter() - start, 3),
    }
    return CompactedCache.from_selection(cache, indices, metadata=metadata)
