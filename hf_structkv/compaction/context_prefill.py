"""Read a context once into a plain ``DynamicCache`` (the cache every compaction starts from)."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel

from ..validation import check_int
from .queries import piece_spans


def prefill_context(
    model: PreTrainedModel,
    context_ids: torch.Tensor,
    prefill_chunk_tokens: int | None = None,
    progress: bool = False,
) -> DynamicCache:
    """Run the context ``[1, T]`` through ``model``; returns the filled ``DynamicCache`` (sliding layers stay sliding).

    Args:
        prefill_chunk_tokens: feed the context in pieces of this many tokens (bounded activation memory, a progress
            bar; the cache is the same as one forward's); ``None`` reads it in one forward.
        progress: show a tqdm bar over the pieces.
    """
    step = check_int("prefill_chunk_tokens", prefill_chunk_tokens, 1, counts="tokens per forward", none_ok=True)
    cache = DynamicCache(config=model.config)
    ids = context_ids.to(model.device)
    step = ids.shape[1] if step is None else step
    with torch.no_grad(), tqdm(total=ids.shape[1], desc="prefill", unit="tok", disable=not progress) as bar:
        for start, end in piece_spans(ids.shape[1], step):
            model(ids[:, start:end], cache=cache, use_cache=True, logits_to_keep=1)
            bar.update(end - start)
    return cache
