"""The end-to-end ``compact(...)``: read a context once, compact each KV head with `compact_head`, build a
`CompactedCache`.

Query-free methods (StreamingLLM, key norm, random) select from the prefilled cache alone. Calibrated methods
(KV-Surgeon, LOO, ...) fit each head to calibration queries: ``queries="repeat"`` records the queries of a second copy
of the context after a "repeat the text" prompt; ``queries="self_study"`` adds the answers the model generates about
the context (`self_study.py`). With ``on_policy=True`` layer ``l`` is fitted to the queries it receives when layers
``< l`` are already compacted. A held-out share of the queries, never used for fitting, measures each head's relative
loss (eq. 4), recorded in the cache's metadata. A long context can be compacted chunk by chunk (``chunk_tokens``);
each KV head's budget is uniform or comes from a head-budget allocation (``budgets``).

The parts: `CompactionSettings` (the arguments, validated), `calibration_conversations` and a query source per way of
capturing the queries (`query_sources.py`), and the per-layer step `compact_layer` (`layer_compaction.py`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from functools import partial

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from ..attention.modules import attention_scalings
from ..attention.registry import enable
from ..cache.compacted import CompactedCache
from ..persistence import model_fingerprint
from ..validation import is_int
from .budgets import CAP_FRACTION, HeadBudgets, UniformBudgets, default_head_budgets
from .byte_budgets import head_byte_budgets
from .chunks import Context, chunk_spans, context_documents
from .context_prefill import prefill_context
from .layer_compaction import CacheSelection, compact_layer
from .queries import DEFAULT_CAP, DEFAULT_INSTRUCTION, Conversation
from .query_sources import ConversationRuns, QuerySource, calibration_conversations, query_source
from .self_study import SelfStudy
from .settings import MAX_LOSS_RATIOS, CompactionSettings, check_budgets

__all__ = ["compact", "resolve_budgets"]


def resolve_budgets(budgets, model: PreTrainedModel, ratio: float) -> tuple[object, dict]:
    """What ``compact(budgets=...)`` does with ``budgets`` at ``ratio``: (an object with
    ``token_budgets(ratio, length) -> {global layer: [kept entries per KV head]}``, its metadata record).

    ``"uniform"`` is `UniformBudgets`. ``"auto"`` is the shipped allocation when it was computed for ``model``'s
    structure and ``ratio`` is within its range (``ratio >= 1 / CAP_FRACTION``: no head keeps more than that share),
    uniform otherwise. A path or Hub id is read by ``HeadBudgets.load(path, model=model)``, which checks that it was
    computed for ``model``. An object with ``token_budgets`` is used as it is.

    Raises:
        TypeError, ValueError: ``budgets`` is none of these (`check_budgets`).
    """
    check_budgets(budgets)
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
        try:
            loaded = HeadBudgets.load(budgets, model=model)
        except ValueError as err:  # named as the argument: the file may be fine, the model another
            raise ValueError(f"budgets {str(budgets)!r}: {err}") from None
        source, record = loaded, {"source": "HeadBudgets.load", "path": str(budgets)}
    else:
        source, record = budgets, {"source": type(budgets).__name__}
        if isinstance(budgets, HeadBudgets):  # per-layer counts of another model would silently fit a smaller one
            try:
                budgets.check_model(model)
            except ValueError as err:
                raise ValueError(f"budgets were computed for another model: {err}") from None
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


def _byte_budgets(
    entry_budgets: dict[int, list[int]], span: tuple[int, int], cache: DynamicCache, settings: CompactionSettings
) -> dict[int, list[int]]:
    """`head_byte_budgets` of the chunk ``span`` of the prefilled ``cache`` (its global layers' key and value widths
    and dtype, which must agree)."""
    shapes = {
        (layer.keys.shape[-1], layer.values.shape[-1], layer.values.element_size())
        for i, layer in enumerate(cache.layers)
        if i in entry_budgets
    }
    if len(shapes) != 1:
        raise ValueError(f"storage={settings.storage!r} needs one key/value width and dtype over the global layers")
    (key_dim, value_dim, element_bytes), length = shapes.pop(), span[1] - span[0]
    layout = (key_dim, value_dim, element_bytes, settings.storage, settings.key_group)
    return head_byte_budgets(entry_budgets, length, *layout)


@dataclass(frozen=True)
class ContextLayout:
    """The token ids ``compact`` prefills and how they divide: ``ids [1, P + T]`` (the prefix's ``P`` tokens, then the
    context's documents in order), the documents' lengths and the chunks ``spans`` (``(begin, end)`` in cache
    positions, after the prefix)."""

    ids: torch.Tensor
    prefix_tokens: int
    document_lengths: list[int]
    spans: list[tuple[int, int]]

    @classmethod
    def read(
        cls,
        tokenizer: PreTrainedTokenizerBase | None,
        context: Context,
        prefix: Context | None,
        chunk_tokens: int | None,
    ) -> ContextLayout:
        """Tokenize ``prefix`` and ``context`` (`context_documents`) and cut the context into chunks (`chunk_spans`)."""
        context_ids, document_lengths = context_documents(tokenizer, context)
        prefix_ids = context_ids[:, :0] if prefix is None else context_documents(tokenizer, prefix, "prefix")[0]
        prefix_tokens = prefix_ids.shape[1]
        ids = torch.cat([prefix_ids.to(context_ids), context_ids], dim=1)
        spans = [
            (begin + prefix_tokens, end + prefix_tokens) for begin, end in chunk_spans(document_lengths, chunk_tokens)
        ]
        return cls(ids, prefix_tokens, document_lengths, spans)

    def record(self, chunk_tokens: int | None) -> dict:
        """The metadata's ``chunking`` record."""
        return {
            "chunk_tokens": chunk_tokens,
            "prefix_tokens": self.prefix_tokens,
            "document_lengths": self.document_lengths,
            "chunk_spans": [list(span) for span in self.spans],
        }


def compact(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    context: Context,
    ratio: float | None = None,
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
    storage: str = "bf16",
    key_group: int | None = None,
    max_loss: float | None = None,
    **hparams,
) -> CompactedCache:
    """Compact ``context`` for ``model`` at compression ``ratio``.

    The context is prefilled once; each chunk (``chunk_tokens``) of every global layer's KV heads is then compacted
    on its own and the kept entries of the chunks are concatenated in order. With uniform budgets every KV head keeps
    ``max(1, floor(T_c / ratio))`` entries of a chunk of ``T_c`` tokens, so the kept keys and values take at most
    ``1/ratio`` of the context's bytes (unless chunks are shorter than ``ratio``). Sliding-window layers are kept as
    they are. ``model`` is switched to hf_structkv's attention (``enable``), which the returned cache needs and which
    serves ordinary caches as SDPA does. The keyword arguments are checked first, before the long prefill: they
    become a `CompactionSettings`, whose errors name the argument.

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
        ratio: original length / kept entries per KV head, a finite number >= 1 (None: 50, unless ``max_loss``); with
            ``storage="int4"`` or ``"auto"`` the byte ratio ``full_nbytes() / nbytes()`` (see ``storage``).
        method: one of ``METHODS``.
        queries: calibration tier for calibrated methods, one of ``QUERY_TIERS``: ``"repeat"`` (one teacher-forced
            repetition per chunk) or ``"self_study"`` (per chunk the repetition, four generated conversations and one
            conversation per task prompt of ``self_study.prompts``, whose prompt's tokens are calibration queries too).
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
        self_study: lengths, sampling, turn framing and task prompts of the self-study conversations (default
            ``SelfStudy()``: CPU-sized, no framing, no task prompts; ``SelfStudy.paper()``: the seed's lengths).
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
        storage: ``"bf16"`` (default): kept keys and values in the model's dtype, ``ratio`` counts entries as above;
            ``"int4"``: each head is compacted by ``compact_head(..., storage="int4")`` (packed INT4 codes, keys with
            FP16 scales and offsets per channel, the refit redone with the quantized keys; a head that serves its
            calibration queries better in the model's dtype at the same bytes falls back to it) and ``ratio`` is a
            **byte** ratio against the full cache in the model's dtype, whatever that dtype (4 bytes per element
            for FP32, 2 for BF16): the context's stored bytes (`CompactedCache.nbytes`: codes, scales, key offsets,
            FP32 biases, row offsets, dtype rows) are at most ``full_nbytes() / ratio``. The heads' entry budgets
            ``t_h`` (``floor(T / ratio)`` under uniform budgets) buy ``Σ t_h · (D + D_v) · element_bytes`` bytes,
            shared in proportion to ``t_h`` with each head capped at the bytes of its whole head in INT4
            (`head_byte_budgets`), and each head keeps the most INT4 entries whose bytes (`StorageLayout`) fit in its
            share; the achieved ratio exceeds ``ratio`` by the rounding to whole entries and key-scale rows, or, when
            ``ratio`` is below the ratio of the whole cache in INT4 (6.6 in FP32, 3.3 in BF16 for ``D = 64``, g = 32),
            every head is kept whole in INT4 and that ratio is reached (a ``UserWarning`` says so); ``"auto"``: the same
            byte shares, and each head keeps the better, on its calibration queries, of the head in the model's dtype on
            the most entries its bytes buy and the INT4 head on the most INT4 entries they buy (the INT4 head also
            passing the held-back-queries guard; `compact_head_to_bytes`); below the whole-INT4 ratio the bytes left
            keep whole heads in the dtype, largest budget first; needs a calibrated method. ``"int4"`` and ``"auto"``
            need one chunk and no ``prefix``. The metadata's ``storage`` counts the heads stored in INT4 and the others
            (``fallback_heads``: kept in the model's dtype) and records the achieved ``byte_ratio``.
        key_group: ``storage="int4"`` / ``"auto"`` only: kept entries per row of key scales and offsets (None, the
            default: one row per head, which served every byte ratio better than rows of 32 entries on the embedded
            model's 48 heads: docs/RESULTS.md, "INT4 compacted heads at equal bytes").
        max_loss: quality first, instead of ``ratio``: each KV head of each chunk is compacted at the sizes of
            `MAX_LOSS_RATIOS` in turn, fewest bytes first (each as ``ratio`` would size it, in ``storage``), and keeps
            the first whose relative loss (eq. 4) on its held-out queries is at most ``max_loss``, or every entry
            (ratio 1, loss 0) when none is. The held-out queries are the seeded ``heldout_fraction`` share of the
            head's own calibration queries (the repeat pass, and the self-study conversations with
            ``queries="self_study"``), never fitted; no test question is used. Since they choose the size, the
            metadata's held-out losses are then at most ``max_loss`` by construction, not an independent estimate.
            The metadata's ``max_loss`` records the target, the sizes tried, the ratio each head got and the
            resulting byte ratio of the whole cache (``full_nbytes() / nbytes()``). Needs a calibrated method and
            ``heldout_fraction > 0``; excludes ``ratio`` and ``budgets``.
        **hparams: the method's hyper-parameters (e.g. ``sink_tokens=4`` for StreamingLLM, ``pool_factor`` for
            KV-Surgeon); refitting methods get ``refit_guard=DEFAULT_REFIT_GUARD`` unless given (``0``: the paper's
            unconditional refit). They are recorded in the metadata.
    """
    settings = CompactionSettings(
        ratio=ratio,
        method=method,
        queries=queries,
        budgets=budgets,
        chunk_tokens=chunk_tokens,
        seed=seed,
        progress=progress,
        on_policy=on_policy,
        query_cap=query_cap,
        heldout_fraction=heldout_fraction,
        self_study=self_study,
        prefill_chunk_tokens=prefill_chunk_tokens,
        block_replay=block_replay,
        prefix=prefix,
        storage=storage,
        key_group=key_group,
        max_loss=max_loss,
        hparams=hparams,
    )
    settings.check_tokenizer(tokenizer)
    if settings.max_loss is None:
        budget_source, budget_record = resolve_budgets(settings.budgets, model, settings.ratio)
    else:
        budget_source, budget_record = None, {"source": "max_loss", "sizes_tried": list(MAX_LOSS_RATIOS)}
    layout = ContextLayout.read(tokenizer, context, settings.prefix, settings.chunk_tokens)
    vocabulary = model.get_input_embeddings().num_embeddings
    if int(layout.ids.max()) >= vocabulary:
        raise ValueError(f"context holds the token id {int(layout.ids.max())}, beyond the model's {vocabulary} ids")
    if settings.storage != "bf16" and (len(layout.spans) > 1 or layout.prefix_tokens):
        raise ValueError(
            f"storage={settings.storage!r} compacts the context as one chunk without a prefix, got "
            f"{len(layout.spans)} chunks and a {layout.prefix_tokens}-token prefix: pass one document, "
            "chunk_tokens=None and prefix=None, or storage='bf16'"
        )
    start = time.perf_counter()
    cache = prefill_context(model, layout.ids, settings.prefill_chunk_tokens, settings.progress)
    chunk_budgets = head_budgets = None
    if budget_source is not None:
        chunk_budgets = [_token_budgets(budget_source, settings.ratio, end - b, cache) for b, end in layout.spans]
        head_budgets = chunk_budgets
        if settings.storage != "bf16":  # one chunk (checked above): the entries' bytes, spent
            head_budgets = [_byte_budgets(chunk_budgets[0], layout.spans[0], cache, settings)]
    selection = CacheSelection.keep_everything(cache, settings.key_group if settings.storage != "bf16" else None)
    scalings = attention_scalings(model)
    enable(model)
    conversations, source = None, None
    if settings.needs_queries:
        full_cache = selection.build(cache)
        conversations = calibration_conversations(model, tokenizer, layout.ids, layout.spans, settings, full_cache)
        runs = ConversationRuns(model, layout.ids, conversations, settings.prefill_chunk_tokens)
        source = query_source(runs, cache, partial(selection.build, cache), settings)
    heldout_losses, head_ratios = {}, {}
    global_layers = [i for i, layer in enumerate(cache.layers) if not layer.is_sliding]
    for layer_idx in tqdm(global_layers, desc=f"compact ({settings.method})", disable=not settings.progress):
        layer_budgets = None if head_budgets is None else [counts[layer_idx] for counts in head_budgets]
        layer_queries = None if source is None else source.layer_queries(layer_idx)
        layer, scaling = cache.layers[layer_idx], scalings.get(layer_idx)
        result = compact_layer(
            layer, layout.spans, layer_budgets, layer_queries, settings, scaling, layout.prefix_tokens
        )
        selection.set_layer(layer_idx, result.heads)
        if result.heldout_losses:
            heldout_losses[layer_idx] = result.heldout_losses
        if result.ratios:
            head_ratios[layer_idx] = result.ratios
    if chunk_budgets is not None and not isinstance(budget_source, UniformBudgets):  # uniform: the rule is recorded
        budget_record["kept_per_chunk"] = [{str(k): v for k, v in counts.items()} for counts in chunk_budgets]
    if head_budgets is not None and settings.storage != "bf16":
        budget_record["bytes_per_chunk"] = [{str(k): v for k, v in counts.items()} for counts in head_budgets]
    metadata = {
        "fingerprint": model_fingerprint(model, tokenizer),
        "method": settings.method,
        "hyperparameters": {**_size(settings), "seed": settings.seed, **settings.hparams},
        "calibration": _calibration_description(settings, source, conversations),
        "budgets": budget_record,
        "chunking": layout.record(settings.chunk_tokens),
        "prefill_chunk_tokens": settings.prefill_chunk_tokens,
        "compaction_seconds": round(time.perf_counter() - start, 3),
    }
    if settings.storage != "bf16":
        metadata["storage"] = _storage_record(settings, selection)
    if heldout_losses:
        metadata["quality"] = _quality(heldout_losses)
    compacted = selection.build(cache, metadata=metadata)
    if settings.storage != "bf16":
        compacted.metadata["storage"]["byte_ratio"] = compacted.full_nbytes() / compacted.nbytes()
    if settings.max_loss is not None:
        compacted.metadata["max_loss"] = _max_loss_record(settings.max_loss, head_ratios, compacted)
    return compacted


def _size(settings: CompactionSettings) -> dict:
    """The hyper-parameters that size the cache: ``ratio``, or ``max_loss`` (``ratio`` None)."""
    if settings.max_loss is None:
        return {"ratio": float(settings.ratio)}
    return {"ratio": None, "max_loss": float(settings.max_loss)}


def _max_loss_record(max_loss: float, head_ratios: dict[int, list[float]], cache: CompactedCache) -> dict:
    """What ``max_loss`` chose: the target, where its held-out queries came from, the sizes tried, each global layer's
    ratio per KV head (chunk by chunk; 1.0: kept whole) and the byte ratio of the whole cache."""
    every_head = [ratio for ratios in head_ratios.values() for ratio in ratios]
    return {
        "max_loss": float(max_loss),
        "heldout_queries": "the seeded heldout_fraction share of each chunk's calibration queries, never fitted",
        "sizes_tried": list(MAX_LOSS_RATIOS),
        "head_ratios": {str(layer): ratios for layer, ratios in sorted(head_ratios.items())},
        "heads_kept_whole": sum(ratio == 1.0 for ratio in every_head),
        "byte_ratio": cache.full_nbytes() / cache.nbytes(),
    }


def _calibration_description(
    settings: CompactionSettings, source: QuerySource | None, conversations: list[list[Conversation]] | None
):
    if source is None:
        return "none (query-free selection)"
    description = {
        "queries": settings.queries,
        "instruction": DEFAULT_INSTRUCTION,
        "on_policy": settings.on_policy,
        "on_policy_capture": source.capture,
        "query_cap_per_head": settings.query_cap,
        "heldout_fraction": settings.heldout_fraction,
        "answer_tokens_per_chunk": [
            {conversation.name: conversation.answer_ids.numel() for conversation in chunk} for chunk in conversations
        ],
    }
    if settings.queries == "self_study":
        description["self_study"] = {**settings.self_study.describe(), "seed_of_chunk_c": "seed + c"}
    return description


def _storage_record(settings: CompactionSettings, selection: CacheSelection) -> dict:
    """The storage asked for, how ``ratio`` counts, how many KV heads are stored in INT4 and how many fell back."""
    stored = [head is not None for layer in selection.int4 if layer is not None for head in layer]
    return {
        "requested": settings.storage,
        "ratio_counts": "bytes of the full cache in the model's dtype (head_byte_budgets)",
        "key_group": settings.key_group,
        "int4_heads": sum(stored),
        "fallback_heads": len(stored) - sum(stored),
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
