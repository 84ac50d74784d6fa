"""The end-to-end ``compact(...)``: read a context once, compact each KV head with `compact_head`, build a
`CompactedCache`.

Query-free methods (StreamingLLM, key norm, random) select from the prefilled cache alone. Calibrated methods
(KV-Surgeon, LOO, ...) fit each head to calibration queries from the repeat pass (``queries="repeat"``: the queries
of a second copy of the context, after a "repeat the text" prompt); with ``on_policy=True`` layer ``l`` is fitted to
the queries it receives when layers ``< l`` are already compacted. A held-out share of the queries, never used for
fitting, measures each head's relative loss (eq. 4), recorded in the cache's metadata.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from ..attention.registry import enable
from ..cache.compacted import CompactedCache
from ..hub import model_fingerprint
from .methods import HEAD_METHODS, compact_head, relative_loss
from .queries import DEFAULT_CAP, DEFAULT_INSTRUCTION, repeat_pass_queries

METHODS = tuple(sorted(HEAD_METHODS))
QUERY_TIERS = ("repeat",)


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
            model(ids[:, start : start + step], cache=cache, use_cache=True, logits_to_keep=1)
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


def _attention_scalings(model: PreTrainedModel) -> dict[int, float]:
    """The logit scale of each attention layer, as its module applies it (``1/sqrt(d)`` or the model's own)."""
    return {
        module.layer_idx: float(module.scaling)
        for module in model.modules()
        if isinstance(getattr(module, "layer_idx", None), int) and isinstance(getattr(module, "scaling", None), float)
    }


@dataclass(frozen=True)
class _Selection:
    """Per-layer ``indices`` / ``biases`` / ``values`` lists in `CompactedCache.from_selection`'s format."""

    indices: list
    biases: list
    values: list

    @classmethod
    def keep_everything(cls, cache: DynamicCache) -> _Selection:
        """Every position of every global layer (None for sliding layers), bias 0, original values."""
        length = cache.get_seq_length()
        indices = [
            None if layer.is_sliding else [torch.arange(length) for _ in range(layer.keys.shape[1])]
            for layer in cache.layers
        ]
        n_layers = len(cache.layers)
        return cls(indices, [None] * n_layers, [None] * n_layers)

    def set_layer(self, layer_idx: int, heads: list) -> None:
        self.indices[layer_idx] = [head.indices for head in heads]
        self.biases[layer_idx] = [head.bias for head in heads]
        self.values[layer_idx] = [head.values for head in heads]

    def build(self, cache: DynamicCache, metadata: dict | None = None) -> CompactedCache:
        return CompactedCache.from_selection(cache, self.indices, self.biases, self.values, metadata=metadata)


def _split_queries(queries: torch.Tensor, heldout_fraction: float, cap: int, seed: int):
    """``[H_kv, N, D]`` -> seeded (fit ``[H_kv, <= cap, D]``, held-out ``[H_kv, n_h, D]``) split, disjoint."""
    n = queries.shape[1]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(queries.device)
    n_heldout = min(int(n * heldout_fraction), cap) if n > 1 else 0
    return queries[:, order[n_heldout:][:cap]], queries[:, order[:n_heldout]]


def compact(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    context: str | torch.Tensor,
    ratio: float = 50.0,
    method: str = "kv_surgeon",
    queries: str = "repeat",
    on_policy: bool = True,
    query_cap: int = DEFAULT_CAP,
    heldout_fraction: float = 0.1,
    seed: int = 0,
    chunk_tokens: int | None = 1024,
    progress: bool = False,
    **hparams,
) -> CompactedCache:
    """Compact ``context`` for ``model`` at compression ``ratio``.

    Every KV head of every global layer keeps ``max(1, floor(T / ratio))`` entries, so the kept keys and values take
    at most ``1/ratio`` of the context's bytes; sliding-window layers are kept as they are. A calibrated method
    switches ``model`` to hf_structkv's attention (``enable``), which serves ordinary caches as SDPA does.

    Args:
        tokenizer: tokenizes a text context (as is, no special tokens added) and the repeat prompt; its hash enters
            the fingerprint.
        context: text or token ids ``[1, T]``.
        ratio: original length / kept entries per KV head, a finite number >= 1.
        method: one of ``METHODS``.
        queries: calibration tier for calibrated methods, one of ``QUERY_TIERS``.
        on_policy: fit layer ``l`` to queries computed with layers ``< l`` already compacted (one forward per layer);
            ``False`` captures the queries once, from the full cache.
        query_cap: at most this many fitting queries per KV head (seeded subsample).
        heldout_fraction: share of the captured queries held out to measure the relative loss.
        seed: for randomised methods and query sampling.
        chunk_tokens, progress: see `prefill_context`.
        **hparams: the method's hyper-parameters (e.g. ``sink_tokens=4`` for StreamingLLM, ``pool_factor`` for
            KV-Surgeon).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 1 <= ratio < math.inf:
        raise ValueError(f"ratio must be a finite number >= 1 (original / kept entries), got {ratio!r}")
    rule = HEAD_METHODS[method](**hparams)  # validates the hyper-parameters before the long prefill
    if rule.needs_queries and queries not in QUERY_TIERS:
        raise ValueError(f"queries must be one of {QUERY_TIERS} for method {method!r}, got {queries!r}")
    if not 0 <= heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction!r}")
    context_ids = _context_ids(tokenizer, context)
    start = time.perf_counter()
    cache = prefill_context(model, context_ids, chunk_tokens=chunk_tokens, progress=progress)
    budget = max(1, math.floor(context_ids.shape[1] / ratio))
    selection = _Selection.keep_everything(cache)
    scalings = _attention_scalings(model)
    captured, heldout_losses = None, {}
    global_layers = [i for i, layer in enumerate(cache.layers) if not layer.is_sliding]
    for layer_idx in tqdm(global_layers, desc=f"compact ({method})", disable=not progress):
        layer = cache.layers[layer_idx]
        fit = heldout = None
        if rule.needs_queries:
            if captured is None or on_policy:
                enable(model)
                captured = repeat_pass_queries(
                    model, tokenizer, context_ids, cap=None, context_cache=selection.build(cache)
                )
            fit, heldout = _split_queries(captured[layer_idx], heldout_fraction, query_cap, seed)
        heads = []
        for h in range(layer.keys.shape[1]):
            keys, values = layer.keys[0, h], layer.values[0, h]
            head_queries = None if fit is None else fit[h]
            scaling = scalings.get(layer_idx)
            heads.append(compact_head(keys, values, head_queries, budget, method, scaling, seed, **hparams))
            if heldout is not None and heldout.shape[1] > 0:
                loss = relative_loss(heads[-1], keys, heldout[h], values, scaling)
                heldout_losses.setdefault(layer_idx, []).append(loss)
        selection.set_layer(layer_idx, heads)
    metadata = {
        "fingerprint": model_fingerprint(model, tokenizer),
        "method": method,
        "hyperparameters": {"ratio": float(ratio), "seed": seed, **hparams},
        "calibration": _calibration_description(rule.needs_queries, queries, on_policy, query_cap, heldout_fraction),
        "compaction_seconds": round(time.perf_counter() - start, 3),
    }
    if heldout_losses:
        metadata["quality"] = _quality(heldout_losses)
    return selection.build(cache, metadata=metadata)


def _calibration_description(needs_queries: bool, queries: str, on_policy: bool, cap: int, heldout: float):
    if not needs_queries:
        return "none (query-free selection)"
    return {
        "queries": queries,
        "instruction": DEFAULT_INSTRUCTION,
        "on_policy": on_policy,
        "query_cap_per_head": cap,
        "heldout_fraction": heldout,
    }


def _quality(heldout_losses: dict[int, list[float]]) -> dict:
    """Held-out relative loss ``L / ‖O‖_F²`` per layer (mean over its KV heads) and overall (mean over heads)."""
    every_head = [loss for losses in heldout_losses.values() for loss in losses]
    return {
        "heldout_relative_loss_mean": sum(every_head) / len(every_head),
        "heldout_relative_loss_per_layer": {
            str(layer): sum(losses) / len(losses) for layer, losses in sorted(heldout_losses.items())
        },
    }
