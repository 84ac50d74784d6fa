"""The end-to-end ``compact(...)``: read a context once, compact each KV head with `compact_head`, build a
`CompactedCache`.

Query-free methods (StreamingLLM, key norm, random) select from the prefilled cache alone. Calibrated methods
(KV-Surgeon, LOO, ...) fit each head to calibration queries: ``queries="repeat"`` records the queries of a second copy
of the context after a "repeat the text" prompt; ``queries="self_study"`` adds the answers the model generates about
the context (`self_study.py`). With ``on_policy=True`` layer ``l`` is fitted to the queries it receives when layers
``< l`` are already compacted. A held-out share of the queries, never used for fitting, measures each head's relative
loss (eq. 4), recorded in the cache's metadata. A long context can be compacted chunk by chunk (``chunk_tokens``);
each KV head's budget is uniform or comes from a head-budget allocation (``budgets``).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from ..attention.modules import attention_scalings
from ..attention.registry import enable
from ..cache.compacted import CompactedCache
from ..hub import model_fingerprint
from ..validation import check_bool, is_int
from .block_replay import BlockReplay
from .budgets import CAP_FRACTION, HeadBudgets, UniformBudgets, default_head_budgets
from .chunks import Context, chunk_spans, context_documents
from .context_prefill import prefill_context
from .head_compaction import HEAD_METHODS, compact_head, relative_loss
from .head_method import CalibratedMethod
from .head_statistics import CompactedHead
from .queries import DEFAULT_CAP, DEFAULT_INSTRUCTION, Conversation, conversation_queries, repetition_conversation
from .self_study import SelfStudy, self_study_conversations

__all__ = ["METHODS", "QUERY_TIERS", "compact", "resolve_budgets"]

METHODS = tuple(sorted(HEAD_METHODS))
QUERY_TIERS = ("repeat", "self_study")
DEFAULT_REFIT_GUARD = 0.2
"""``compact``'s default ``refit_guard`` for refitting methods: per head, 20% of the fitting queries decide between the
refit and plain eviction of the same selection (`CalibratedMethod.complete`). The paper always refits
(``refit_guard=0``); on the embedded model some heads' value solves overfit the calibration queries (held-out loss
above 10 for LOO and AM-HAK on a SQuAD document at 10x), which the guard turns into eviction."""


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


def resolve_budgets(budgets, model: PreTrainedModel, ratio: float) -> tuple[object, dict]:
    """What ``compact(budgets=...)`` does with ``budgets`` at ``ratio``: (an object with
    ``token_budgets(ratio, length) -> {global layer: [kept entries per KV head]}``, its metadata record).

    ``"uniform"`` is `UniformBudgets`. ``"auto"`` is the shipped allocation when it was computed for ``model``'s
    structure and ``ratio`` is within its range (``ratio >= 1 / CAP_FRACTION``: no head keeps more than that share),
    uniform otherwise. A path or Hub id is read by ``HeadBudgets.load(path, model=model)``, which checks that it was
    computed for ``model``. An object with ``token_budgets`` is used as it is.

    Raises:
        TypeError: ``budgets`` is none of these.
    """
    uniform = {"source": "uniform", "rule": "max(1, floor(chunk_length / ratio)) per KV head"}
    if isinstance(budgets, str) and budgets == "uniform":
        return UniformBudgets.of(model), uniform
    if isinstance(budgets, str) and budgets == "auto":
        if ratio * CAP_FRACTION < 1:  # every head keeps more than the allocation's cap: only uniform fits
            return UniformBudgets.of(model), uniform | {"requested": "auto"}
        try:
            shipped = default_head_budgets(model)
        except ValueError:  # another attention structure: no shipped allocation applies
            return UniformBudgets.of(model), uniform | {"requested": "auto"}
        return shipped, {"source": "shipped", "requested": "auto", "provenance": shipped.provenance}
    if isinstance(budgets, (str, os.PathLike)):
        source, record = HeadBudgets.load(budgets, model=model), {"source": "HeadBudgets.load", "path": str(budgets)}
    elif callable(getattr(budgets, "token_budgets", None)):
        source, record = budgets, {"source": type(budgets).__name__}
    else:
        raise TypeError(
            "budgets must be 'uniform', 'auto', a HeadBudgets (an object with token_budgets(ratio, length)) or the "
            f"path of a saved one, got {type(budgets).__name__}"
        )
    provenance = getattr(source, "provenance", None)
    if provenance is not None:
        record["provenance"] = provenance
    return source, record


def _token_budgets(source, ratio: float, length: int, cache: DynamicCache) -> dict[int, list[int]]:
    """Kept entries per KV head of every global layer for a chunk of ``length`` tokens, each at least 1:
    ``source.token_budgets(ratio, length)`` checked against the cache's global layers and KV heads; a count of 0 is
    raised to 1 (as the uniform rule does), since a head keeps at least one entry."""
    heads = {i: layer.keys.shape[1] for i, layer in enumerate(cache.layers) if not layer.is_sliding}
    counts = source.token_budgets(ratio, length)
    budgets = {}
    for layer_idx, n_heads in heads.items():
        layer_counts = counts.get(layer_idx) if isinstance(counts, dict) else None
        if layer_counts is None or len(layer_counts) != n_heads:
            raise ValueError(
                f"budgets.token_budgets({ratio}, {length}) must give {n_heads} counts for global layer {layer_idx}, "
                f"got {layer_counts!r}: were the budgets computed for another model?"
            )
        if any(not is_int(c) or c < 0 for c in layer_counts):
            raise ValueError(f"budgets.token_budgets gave layer {layer_idx} counts {layer_counts!r}; need ints >= 0")
        budgets[layer_idx] = [max(1, c) for c in layer_counts]
    return budgets


def _calibration_conversations(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    context_ids: torch.Tensor,
    spans: list[tuple[int, int]],
    tier: str,
    config: SelfStudy,
    seed: int,
    full_cache: CompactedCache,
    progress: bool,
) -> list[list[Conversation]]:
    """Per chunk: its teacher-forced repetition and, for ``"self_study"``, its generated conversations (generated
    once, on the full cache, with seed ``seed + chunk index``; with several chunks each prompt quotes its chunk)."""
    conversations = []
    bar = tqdm(spans, desc="calibration conversations", disable=not progress or tier != "self_study")
    for index, (start, end) in enumerate(bar):
        chunk_ids = context_ids[:, start:end]
        chunk = [repetition_conversation(tokenizer, chunk_ids)]
        if tier == "self_study":
            excerpt = chunk_ids if len(spans) > 1 else None
            chunk += self_study_conversations(model, tokenizer, full_cache, config, seed + index, excerpt)
        conversations.append(chunk)
    return conversations


def _block_replays(
    model, conversations: list[list[Conversation]], context_cache, chunk_tokens: int | None
) -> list[list[BlockReplay]] | None:
    """Per chunk, a `BlockReplay` of each of its conversations with an answer (on-policy capture in about two and a
    half forwards per conversation, each run in pieces of ``chunk_tokens``); ``None`` when the model's blocks cannot
    be replayed (then a forward per layer)."""
    replays = []
    for chunk in conversations:
        chunk_replays = [
            BlockReplay.build(model, c, context_cache, chunk_tokens) for c in chunk if c.answer_ids.numel() > 0
        ]
        if not chunk_replays or any(replay is None for replay in chunk_replays):
            return None
        replays.append(chunk_replays)
    return replays


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


def compact(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    context: Context,
    ratio: float = 50.0,
    method: str = "kv_surgeon",
    queries: str = "repeat",
    budgets="auto",
    chunk_tokens: int | None = None,
    seed: int = 0,
    progress: bool = True,
    on_policy: bool = True,
    query_cap: int = DEFAULT_CAP,
    heldout_fraction: float = 0.1,
    self_study: SelfStudy | None = None,
    prefill_chunk_tokens: int | None = 1024,
    block_replay: bool = True,
    prefix: Context | None = None,
    **hparams,
) -> CompactedCache:
    """Compact ``context`` for ``model`` at compression ``ratio``.

    The context is prefilled once; each chunk (``chunk_tokens``) of every global layer's KV heads is then compacted
    on its own and the kept entries of the chunks are concatenated in order. With uniform budgets every KV head keeps
    ``max(1, floor(T_c / ratio))`` entries of a chunk of ``T_c`` tokens, so the kept keys and values take at most
    ``1/ratio`` of the context's bytes (unless chunks are shorter than ``ratio``). Sliding-window layers are kept as
    they are. ``model`` is switched to hf_structkv's attention (``enable``), which the returned cache needs and which
    serves ordinary caches as SDPA does.

    Chunks and attention mass: a chunk ``c`` is fitted to its own calibration queries (its repetition and, for
    self-study, conversations about it) against its own keys only, so the refit multipliers ``w = exp(bias)``
    (eq. 22) are fitted so that, for each calibration query ``q_i`` of the chunk, the mass the compacted chunk
    receives equals the full chunk's, ``sum_{j in S_c} w_j exp(z_ij) ~= sum_{j in c} exp(z_ij)`` (``z`` the scaled
    logits): a least-squares fit with ``w`` in ``[e^-3, e^3]``, not an identity, and only for queries like the
    calibration ones. Served side by side, each compacted chunk thus keeps its share of the attention next to its
    neighbours and the question (the seed's Lemma 1). Methods without a refit (query-free ones, a head in the
    mild-compaction fallback) keep unit multipliers, whose mass is that of the kept entries only.

    The cache's metadata records what reproduces it: the model fingerprint, ``method`` and its hyper-parameters
    (with ``ratio`` and ``seed``), the calibration (tier, repeat instruction, on-policy, query cap, held-out share,
    the self-study prompts, lengths and sampling, and the answer tokens of every conversation of every chunk), the
    budget source (with the per-chunk counts of a non-uniform one), the chunking (``chunk_tokens``, the prefix's
    tokens, document lengths, chunk spans in cache positions), ``prefill_chunk_tokens``, the time taken and, for
    calibrated methods, the held-out relative loss per layer (mean over chunks and KV heads, each measured against its
    chunk's keys).

    Args:
        tokenizer: tokenizes a text context (as is, no special tokens added) and the calibration prompts; its hash
            enters the fingerprint. Calibrated methods need it.
        context: a text or token ids ``[1, T]`` (one document), or a list of documents (texts or ``[1, T_i]``
            tensors, each tokenized on its own and concatenated in order).
        ratio: original length / kept entries per KV head, a finite number >= 1.
        method: one of ``METHODS``.
        queries: calibration tier for calibrated methods, one of ``QUERY_TIERS``: ``"repeat"`` (one teacher-forced
            repetition per chunk) or ``"self_study"`` (the repetition and four generated conversations per chunk).
        budgets: ``"auto"`` (default): the sensitivity-based allocation shipped for the embedded model
            (`default_head_budgets`) when ``model`` has its attention structure, else uniform; ``"uniform"`` (every
            KV head keeps the same share: the ablation); a ``HeadBudgets`` (any object with
            ``token_budgets(ratio, length) -> {global layer: [kept entries per KV head]}``), asked once per chunk;
            or the folder, file or Hub id of a saved one
            (``HeadBudgets.load(budgets, model=model)``). A count of 0 is raised to 1.
        chunk_tokens: compact chunk by chunk, each of at most this many tokens, packing whole consecutive documents
            (a document longer than ``chunk_tokens`` is cut into near-equal pieces; see `chunk_spans`); ``None``: the
            whole context is one chunk.
        seed: for randomised methods, query sampling and self-study generation.
        progress: show tqdm bars (prefill, conversations, layers).
        on_policy: fit layer ``l`` to queries computed with layers ``< l`` already compacted (one forward per layer,
            conversation and chunk, stopped after layer ``l``, where the model's decoder blocks cannot be replayed one
            at a time; else `BlockReplay`: about two and a half forwards per conversation in all); ``False`` captures
            the queries once, from the full cache. Self-study answers are generated once, from the full cache, and
            re-run on-policy as fixed token sequences.
        query_cap: at most this many fitting queries per KV head and chunk (seeded subsample).
        heldout_fraction: share of each chunk's captured queries held out to measure the relative loss.
        self_study: lengths and sampling of the self-study conversations (default ``SelfStudy()``: CPU-sized;
            ``SelfStudy.paper()``: the seed's).
        prefill_chunk_tokens: read the context, and run each calibration conversation after it, in pieces of this
            many tokens (bounds activation and attention-score memory: a piece's scores take ``piece x keys`` per
            head; the cache and the queries are those of one forward, up to rounding); see `prefill_context` and
            `conversation_queries`. ``None``: one forward each.
        block_replay: capture on-policy queries by `BlockReplay` where the model's blocks allow it; ``False``: one
            forward per layer always (the same queries up to rounding, more compute; for a model whose replay is in
            doubt). The metadata's ``calibration.on_policy_capture`` says which path ran.
        prefix: text (or ids ``[1, P]``, or a list of either) kept whole before the context, e.g. the system turn
            and user-turn header of a chat template: prefilled first, served with its ``P`` entries as they are in
            every layer (bias 0, original values), and never compacted or counted in the ratio (the chunks' budgets
            come from the context's tokens alone); the calibration conversations run after prefix + context. The
            seed serves a system prompt uncompacted next to the compacted context (on the embedded model, keeping
            its 24-token chat scaffold whole did not change the QA accuracy at 10x; docs/BENCHMARKS.md).
            ``None``: no prefix.
        **hparams: the method's hyper-parameters (e.g. ``sink_tokens=4`` for StreamingLLM, ``pool_factor`` for
            KV-Surgeon); refitting methods get ``refit_guard=DEFAULT_REFIT_GUARD`` unless given (``0``: the paper's
            unconditional refit). They are recorded in the metadata.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 1 <= ratio < math.inf:
        raise ValueError(f"ratio must be a finite number >= 1 (original / kept entries), got {ratio!r}")
    if issubclass(HEAD_METHODS[method], CalibratedMethod):
        hparams.setdefault("refit_guard", DEFAULT_REFIT_GUARD)
    rule = HEAD_METHODS[method](**hparams)  # validates the hyper-parameters before the long prefill
    if rule.needs_queries and queries not in QUERY_TIERS:
        raise ValueError(f"queries must be one of {QUERY_TIERS} for method {method!r}, got {queries!r}")
    if rule.needs_queries and tokenizer is None:
        raise ValueError(f"method {method!r} needs the tokenizer for its calibration prompts; pass tokenizer=")
    if not 0 <= heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction!r}")
    check_bool("block_replay", block_replay)
    if self_study is not None and not isinstance(self_study, SelfStudy):
        raise TypeError(f"self_study must be a SelfStudy or None, got {type(self_study).__name__}")
    self_study = SelfStudy() if self_study is None else self_study
    budget_source, budget_record = resolve_budgets(budgets, model, ratio)
    context_ids, document_lengths = context_documents(tokenizer, context)
    prefix_ids = context_ids[:, :0] if prefix is None else context_documents(tokenizer, prefix, "prefix")[0]
    prefix_tokens = prefix_ids.shape[1]
    context_ids = torch.cat([prefix_ids.to(context_ids), context_ids], dim=1)
    spans = [(begin + prefix_tokens, end + prefix_tokens) for begin, end in chunk_spans(document_lengths, chunk_tokens)]
    start = time.perf_counter()
    cache = prefill_context(model, context_ids, prefill_chunk_tokens=prefill_chunk_tokens, progress=progress)
    chunk_budgets = [_token_budgets(budget_source, ratio, end - begin, cache) for begin, end in spans]
    selection = _Selection.keep_everything(cache)
    scalings = attention_scalings(model)
    conversations, captured, replays, heldout_losses = None, None, None, {}
    enable(model)
    if rule.needs_queries:
        conversations = _calibration_conversations(
            model, tokenizer, context_ids, spans, queries, self_study, seed, selection.build(cache), progress
        )
        if on_policy and block_replay:
            replays = _block_replays(model, conversations, selection.build(cache), prefill_chunk_tokens)
    global_layers = [i for i, layer in enumerate(cache.layers) if not layer.is_sliding]
    for layer_idx in tqdm(global_layers, desc=f"compact ({method})", disable=not progress):
        if rule.needs_queries and (captured is None or on_policy):
            # off-policy, nothing is compacted yet: the plain prefilled cache serves the same context through stock
            # SDPA (an all-kept CompactedCache would copy every kept key beside the appended ones at each call)
            context_cache = selection.build(cache) if on_policy else cache
            if replays is not None:
                captured = [
                    {layer_idx: torch.cat([replay.queries(layer_idx, context_cache) for replay in chunk], dim=1)}
                    for chunk in replays
                ]
            else:
                layers = [layer_idx] if on_policy else None
                captured = [
                    conversation_queries(model, context_ids, chunk, context_cache, layers, prefill_chunk_tokens)
                    for chunk in conversations
                ]
        layer, scaling = cache.layers[layer_idx], scalings.get(layer_idx)
        per_chunk = []
        for index, (begin, end) in enumerate(spans):
            fit = heldout = None
            if rule.needs_queries:
                fit, heldout = _split_queries(captured[index][layer_idx], heldout_fraction, query_cap, seed)
            heads = []
            for h in range(layer.keys.shape[1]):
                keys, values = layer.keys[0, h, begin:end], layer.values[0, h, begin:end]
                budget = chunk_budgets[index][layer_idx][h]
                head_queries = None if fit is None else fit[h]
                heads.append(compact_head(keys, values, head_queries, budget, method, scaling, seed, **hparams))
                if heldout is not None and heldout.shape[1] > 0:
                    loss = relative_loss(heads[-1], keys, heldout[h], values, scaling)
                    heldout_losses.setdefault(layer_idx, []).append(loss)
            per_chunk.append(heads)
        whole = [_kept_whole(layer.values[0, h, :prefix_tokens]) for h in range(layer.keys.shape[1])]
        in_context = [_in_context(list(heads), spans, whole[h]) for h, heads in enumerate(zip(*per_chunk))]
        selection.set_layer(layer_idx, in_context)
    if not isinstance(budget_source, UniformBudgets):  # the uniform rule is in the record already
        budget_record["kept_per_chunk"] = [{str(k): v for k, v in counts.items()} for counts in chunk_budgets]
    metadata = {
        "fingerprint": model_fingerprint(model, tokenizer),
        "method": method,
        "hyperparameters": {"ratio": float(ratio), "seed": seed, **hparams},
        "calibration": _calibration_description(
            rule.needs_queries,
            queries,
            on_policy,
            replays is not None,
            query_cap,
            heldout_fraction,
            self_study,
            conversations,
        ),
        "budgets": budget_record,
        "chunking": {
            "chunk_tokens": chunk_tokens,
            "prefix_tokens": prefix_tokens,
            "document_lengths": document_lengths,
            "chunk_spans": [list(span) for span in spans],
        },
        "prefill_chunk_tokens": prefill_chunk_tokens,
        "compaction_seconds": round(time.perf_counter() - start, 3),
    }
    if heldout_losses:
        metadata["quality"] = _quality(heldout_losses)
    return selection.build(cache, metadata=metadata)


def _calibration_description(
    needs_queries: bool,
    queries: str,
    on_policy: bool,
    replayed: bool,
    cap: int,
    heldout: float,
    self_study: SelfStudy,
    conversations: list[list[Conversation]] | None,
):
    if not needs_queries:
        return "none (query-free selection)"
    description = {
        "queries": queries,
        "instruction": DEFAULT_INSTRUCTION,
        "on_policy": on_policy,
        "on_policy_capture": ("block replay" if replayed else "forward per layer") if on_policy else None,
        "query_cap_per_head": cap,
        "heldout_fraction": heldout,
        "answer_tokens_per_chunk": [
            {conversation.name: conversation.answer_ids.numel() for conversation in chunk} for chunk in conversations
        ],
    }
    if queries == "self_study":
        description["self_study"] = {**self_study.describe(), "seed_of_chunk_c": "seed + c"}
    return description


def _quality(heldout_losses: dict[int, list[float]]) -> dict:
    """Held-out relative loss ``L / ‖O‖_F²`` per layer (mean over its KV heads) and overall (mean over heads)."""
    every_head = [loss for losses in heldout_losses.values() for loss in losses]
    return {
        "heldout_relative_loss_mean": sum(every_head) / len(every_head),
        "heldout_relative_loss_per_layer": {
            str(layer): sum(losses) / len(losses) for layer, losses in sorted(heldout_losses.items())
        },
    }
