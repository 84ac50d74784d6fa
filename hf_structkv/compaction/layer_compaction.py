"""The per-layer step of ``compact(...)``: every KV head of every chunk of one global layer compacted with
`compact_head`, stitched behind the prefix into the layer's compacted context, and the record of kept entries
(`CacheSelection`) the compacted cache is built from."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..cache.compacted import CompactedCache
from ..cache.compacted_layers import Int4Head
from .head_compaction import compact_head, compact_head_to_bytes, relative_loss
from .head_statistics import CompactedHead, QuantizedHead
from .settings import MAX_LOSS_RATIOS, CompactionSettings

__all__ = ["CacheSelection", "LayerResult", "compact_layer", "split_queries"]


@dataclass(frozen=True)
class CacheSelection:
    """Per-layer ``indices`` / ``biases`` / ``values`` / ``int4`` lists in `CompactedCache.from_selection`'s format
    (``int4``: an `Int4Head` for each head stored in INT4, with the ``key_group`` of every such head)."""

    indices: list
    biases: list
    values: list
    int4: list
    key_group: int | None = None

    @classmethod
    def keep_everything(cls, cache: DynamicCache, key_group: int | None = None) -> CacheSelection:
        """Every position of every global layer (None for sliding layers), bias 0, original values, nothing in INT4
        (INT4 heads set later share ``key_group``)."""
        length = cache.get_seq_length()
        indices = [
            None if layer.is_sliding else [torch.arange(length) for _ in range(layer.keys.shape[1])]
            for layer in cache.layers
        ]
        n_layers = len(cache.layers)
        return cls(indices, [None] * n_layers, [None] * n_layers, [None] * n_layers, key_group)

    def set_layer(self, layer_idx: int, heads: list[CompactedHead]) -> None:
        """Layer ``layer_idx`` keeps ``heads`` (one per KV head, positions in the cache)."""
        self.indices[layer_idx] = [head.indices for head in heads]
        self.biases[layer_idx] = [head.bias for head in heads]
        self.values[layer_idx] = [head.values for head in heads]
        self.int4[layer_idx] = [_int4_head(head, self.key_group) for head in heads]

    def build(self, cache: DynamicCache, metadata: dict | None = None) -> CompactedCache:
        """The `CompactedCache` of ``cache`` keeping this selection."""
        return CompactedCache.from_selection(
            cache, self.indices, self.biases, self.values, metadata=metadata, int4=self.int4, key_group=self.key_group
        )


def _int4_head(head: CompactedHead, key_group: int | None) -> Int4Head | None:
    """The stored codes and scales of a head kept in INT4 (None for a head in the cache's dtype)."""
    if not isinstance(head, QuantizedHead):
        return None
    if head.key_group != key_group:
        raise ValueError(f"an INT4 head has key_group {head.key_group}, the selection {key_group}")
    return Int4Head(head.key_codes, head.key_scales, head.key_offsets, head.value_codes, head.value_scales)


def byte_budget(budget: int, keys: torch.Tensor, values: torch.Tensor) -> int:
    """The bytes of a head whose budget is ``budget`` entries in the cache's dtype: those of ``budget`` keys and values
    ``[T, D]`` / ``[T, D_v]`` in their dtype, ``budget · (D + D_v) · element_bytes`` (what ``"int4"`` and ``"auto"``
    heads spend, `compact_head_to_bytes`)."""
    return budget * (keys.shape[-1] + values.shape[-1]) * values.element_size()


def split_queries(
    queries: torch.Tensor, heldout_fraction: float, cap: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[H_kv, N, D]`` -> seeded (fit ``[H_kv, <= cap, D]``, held-out ``[H_kv, n_h, D]``) split, disjoint."""
    n = queries.shape[1]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(queries.device)
    n_heldout = min(int(n * heldout_fraction), cap) if n > 1 else 0
    return queries[:, order[n_heldout:][:cap]], queries[:, order[:n_heldout]]


@dataclass(frozen=True)
class LayerResult:
    """One layer compacted: ``heads`` (one `CompactedHead` per KV head, positions in the cache), the held-out
    relative loss of each chunk's heads, chunk by chunk (empty without held-out queries) and, with ``max_loss``, the
    ratio each chunk's heads were given, chunk by chunk (1.0: kept whole; empty without ``max_loss``)."""

    heads: list[CompactedHead]
    heldout_losses: list[float]
    ratios: list[float] = field(default_factory=list)


def compact_within(
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor | None,
    budget: int,
    settings: CompactionSettings,
    scaling: float | None,
) -> CompactedHead:
    """One KV head (``keys [T, D]``, ``values [T, D_v]``, fitting ``queries [N, D]`` or None) within ``budget``:
    kept entries for ``"bf16"`` (``compact_head``), bytes for ``"int4"`` and ``"auto"`` (``compact_head_to_bytes``)."""
    method = (settings.method, scaling, settings.seed)
    if settings.storage == "bf16":
        return compact_head(keys, values, queries, budget, *method, **settings.hparams)
    storage = {"storage": settings.storage, "key_group": settings.key_group}
    return compact_head_to_bytes(keys, values, queries, budget, *method, **storage, **settings.hparams)


def fewest_bytes_within(
    keys: torch.Tensor,
    values: torch.Tensor,
    fit: torch.Tensor,
    heldout: torch.Tensor,
    settings: CompactionSettings,
    scaling: float | None,
) -> tuple[CompactedHead, float, float]:
    """``max_loss``: one KV head at the first size of `MAX_LOSS_RATIOS` (fewest bytes first, `compact_within` ``max(1,
    floor(T / r))`` entries in the cache's dtype, or their bytes (`byte_budget`), fitted to ``fit [N, D]``) whose
    relative loss on ``heldout [N_h, D]`` is at most ``settings.max_loss``; kept whole (every entry in the cache's
    dtype, bias 0, original values, loss 0) when none is. Sizes whose budget equals the previous one are not refitted.

    Returns:
        ``(head, ratio, held-out loss)``, ratio 1.0 for a head kept whole.
    """
    length, tried = keys.shape[0], None
    for ratio in MAX_LOSS_RATIOS:
        budget = max(1, math.floor(length / ratio))
        if budget == tried:
            continue
        tried = budget
        size = budget if settings.storage == "bf16" else byte_budget(budget, keys, values)
        head = compact_within(keys, values, fit, size, settings, scaling)
        loss = relative_loss(head, keys, heldout, values, scaling)
        if loss <= settings.max_loss:
            return head, float(ratio), loss
    head = compact_head(keys, values, fit, length, settings.method, scaling, settings.seed, **settings.hparams)
    return head, 1.0, relative_loss(head, keys, heldout, values, scaling)


def _compact_chunk(
    layer: DynamicLayer,
    span: tuple[int, int],
    budgets: list[int] | None,
    queries: torch.Tensor | None,
    settings: CompactionSettings,
    scaling: float | None,
) -> LayerResult:
    """The KV heads of one chunk ``span`` of ``layer``, each within its entry of ``budgets`` (`compact_within`: entries
    for ``"bf16"``, bytes otherwise; None with ``max_loss``: `fewest_bytes_within`), fitted to a seeded share of the
    chunk's ``queries [H_kv, N, D]`` (None: query-free) and scored on the rest; positions chunk-local."""
    begin, end = span
    fit = heldout = None
    if queries is not None:
        fit, heldout = split_queries(queries, settings.heldout_fraction, settings.query_cap, settings.seed)
    scored = heldout is not None and heldout.shape[1] > 0
    if settings.max_loss is not None and not scored:
        raise ValueError(
            f"max_loss needs held-out queries; heldout_fraction={settings.heldout_fraction} of the chunk's "
            f"{queries.shape[1]} calibration queries holds none: raise heldout_fraction"
        )
    heads, losses, ratios = [], [], []
    for h in range(layer.keys.shape[1]):
        keys, values = layer.keys[0, h, begin:end], layer.values[0, h, begin:end]
        head_queries = None if fit is None else fit[h]
        if settings.max_loss is not None:
            head, ratio, loss = fewest_bytes_within(keys, values, head_queries, heldout[h], settings, scaling)
            ratios.append(ratio)
        else:
            head = compact_within(keys, values, head_queries, budgets[h], settings, scaling)
            loss = relative_loss(head, keys, heldout[h], values, scaling) if scored else None
        heads.append(head)
        if scored:
            losses.append(loss)
    return LayerResult(heads, losses, ratios)


def _kept_whole(values: torch.Tensor) -> CompactedHead:
    """The prefix's ``P`` entries of one KV head as they are: positions ``0..P-1``, bias 0, ``values`` ``[P, D_v]``."""
    length = values.shape[0]
    return CompactedHead(torch.arange(length, device=values.device), torch.zeros(length, device=values.device), values)


def _in_context(heads: list[CompactedHead], spans: list[tuple[int, int]], prefix: CompactedHead) -> CompactedHead:
    """One KV head's per-chunk compactions (chunk-local positions) as one head: the ``prefix`` head kept whole
    (`_kept_whole`), then the chunks' entries, positions shifted by each chunk's start (in cache positions) and
    concatenated in chunk order, with their biases and values."""
    return CompactedHead(
        torch.cat([prefix.indices, *(head.indices + start for head, (start, _) in zip(heads, spans, strict=True))]),
        torch.cat([prefix.bias, *(head.bias for head in heads)]),
        torch.cat([prefix.values, *(head.values for head in heads)]),
    )


def compact_layer(
    layer: DynamicLayer,
    spans: list[tuple[int, int]],
    budgets: list[list[int]] | None,
    queries: list[torch.Tensor] | None,
    settings: CompactionSettings,
    scaling: float | None,
    prefix_tokens: int,
) -> LayerResult:
    """One global layer of the prefilled cache compacted chunk by chunk, the first ``prefix_tokens`` entries kept.

    Args:
        layer: the prefilled layer, keys and values ``[1, H_kv, T, D]``.
        spans: the chunks, ``(begin, end)`` in cache positions, after the prefix.
        budgets: per chunk, each KV head's budget: kept entries for ``"bf16"`` storage, bytes for ``"int4"`` and
            ``"auto"`` (`head_byte_budgets`); None with ``settings.max_loss`` (each head's size is
            chosen by `fewest_bytes_within`).
        queries: per chunk, the layer's calibration queries ``[H_kv, N_c, D]``; None for a query-free method.
        scaling: the layer's logit scale (None: ``1/sqrt(D)``).
    """
    chunks = [
        _compact_chunk(
            layer,
            span,
            None if budgets is None else budgets[index],
            None if queries is None else queries[index],
            settings,
            scaling,
        )
        for index, span in enumerate(spans)
    ]
    losses = [loss for chunk in chunks for loss in chunk.heldout_losses]
    ratios = [ratio for chunk in chunks for ratio in chunk.ratios]
    if settings.storage != "bf16":  # one chunk and no prefix (checked by compact): INT4 heads kept as they are
        heads = [replace(head, indices=head.indices + spans[0][0]) for head in chunks[0].heads]
        return LayerResult(heads, losses, ratios)
    heads = []
    for h, per_chunk in enumerate(zip(*(chunk.heads for chunk in chunks))):
        heads.append(_in_context(list(per_chunk), spans, _kept_whole(layer.values[0, h, :prefix_tokens])))
    return LayerResult(heads, losses, ratios)
