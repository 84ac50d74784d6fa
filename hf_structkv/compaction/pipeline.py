"""The end-to-end ``compact(...)``: read a context once, compact each KV head with `compact_head`, build a
`CompactedCache`.

This release serves the query-free methods of `HEAD_METHODS` (StreamingLLM, key norm, random); the calibrated
methods (KV-Surgeon, LOO, ...) need calibration queries captured from the model, which the pipeline does not
record yet.
"""

from __future__ import annotations

import math
import time

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from ..cache.compacted import CompactedCache
from ..hub import model_fingerprint
from .methods import HEAD_METHODS, compact_head

METHODS = tuple(sorted(name for name, rule in HEAD_METHODS.items() if not rule.needs_queries))


def prefill_context(
    model: PreTrainedModel, context_ids: torch.Tensor, chunk_tokens: int | None = None, progress: bool = False
) -> DynamicCache:
    """Run the context ``[1, T]`` through ``model``; returns the filled ``DynamicCache`` (sliding layers stay sliding).

    Args:
        chunk_tokens: feed the context in chunks of this many tokens (bounded activation memory, a progress bar);
            ``None`` reads it in one forward.
        progress: show a tqdm bar over the chunks.
    """
    if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or chunk_tokens < 1):
        raise ValueError(f"chunk_tokens must be a positive int or None, got {chunk_tokens!r}")
    cache = DynamicCache(config=model.config)
    ids = context_ids.to(model.device)
    step = ids.shape[1] if chunk_tokens is None else chunk_tokens
    with torch.no_grad(), tqdm(total=ids.shape[1], desc="prefill", unit="tok", disable=not progress) as bar:
        for start in range(0, ids.shape[1], step):
            model(ids[:, start : start + step], cache=cache, use_cache=True)
            bar.update(min(step, ids.shape[1] - start))
    return cache


def _context_ids(tokenizer: PreTrainedTokenizerBase | None, context: str | torch.Tensor) -> torch.Tensor:
    if isinstance(context, str):
        if tokenizer is None:
            raise ValueError("a text context needs its tokenizer; pass tokenizer= or token ids [1, T]")
        context = tokenizer(context, return_tensors="pt", add_special_tokens=False).input_ids
    if not isinstance(context, torch.Tensor) or context.dim() != 2 or context.shape[0] != 1 or context.shape[1] == 0:
        raise ValueError("context must be a non-empty text or a [1, T] tensor of token ids")
    return context


def compact(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    context: str | torch.Tensor,
    ratio: float = 4.0,
    method: str = "streaming_llm",
    seed: int = 0,
    chunk_tokens: int | None = 1024,
    progress: bool = False,
    **hparams,
) -> CompactedCache:
    """Compact ``context`` for ``model`` at compression ``ratio``.

    Every KV head of every global layer keeps ``max(1, floor(T / ratio))`` entries, so the kept keys and values take
    at most ``1/ratio`` of the context's bytes; sliding-window layers are kept as they are.

    Args:
        tokenizer: tokenizes a text context (as is, no special tokens added); its hash enters the fingerprint.
        context: text or token ids ``[1, T]``.
        ratio: original length / kept entries per KV head, a finite number >= 1.
        method: one of ``METHODS``.
        seed: for randomised methods.
        chunk_tokens, progress: see `prefill_context`.
        **hparams: the method's hyper-parameters (e.g. ``sink_tokens=4`` for StreamingLLM).
    """
    if method not in METHODS:
        raise ValueError(
            f"method must be one of {METHODS} (calibrated methods are not in the pipeline yet), got {method!r}"
        )
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 1 <= ratio < math.inf:
        raise ValueError(f"ratio must be a finite number >= 1 (original / kept entries), got {ratio!r}")
    HEAD_METHODS[method](**hparams)  # validate the hyper-parameters before the long prefill
    context_ids = _context_ids(tokenizer, context)
    start = time.perf_counter()
    cache = prefill_context(model, context_ids, chunk_tokens=chunk_tokens, progress=progress)
    budget = max(1, math.floor(context_ids.shape[1] / ratio))
    indices, biases, values = [], [], []
    for layer in tqdm(cache.layers, desc=f"compact ({method})", disable=not progress):
        if layer.is_sliding:
            indices.append(None), biases.append(None), values.append(None)
            continue
        heads = [
            compact_head(layer.keys[0, h], layer.values[0, h], None, budget, method=method, seed=seed, **hparams)
            for h in range(layer.keys.shape[1])
        ]
        indices.append([head.indices for head in heads])
        biases.append([head.bias for head in heads])
        values.append([head.values for head in heads])
    metadata = {
        "fingerprint": model_fingerprint(model, tokenizer),
        "method": method,
        "hyperparameters": {"ratio": float(ratio), "seed": seed, **hparams},
        "calibration": "none (query-free selection)",
        "compaction_seconds": round(time.perf_counter() - start, 3),
    }
    return CompactedCache.from_selection(cache, indices, biases, values, metadata=metadata)
