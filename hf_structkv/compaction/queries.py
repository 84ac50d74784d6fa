"""Calibration queries: the post-RoPE query vectors each global attention layer receives, grouped per KV head.

The queries are recorded by `hf_structkv.attention.recording` (`capture_queries`, `recording`).

A calibration `Conversation` is a prompt and an answer that follow the context; its queries are those of the answer
tokens, teacher-forced (`conversation_queries`). `repeat_pass_queries` is the "-fast" tier: the one conversation
"repeat the text verbatim" whose answer is the context itself (the second copy in ``context + instruction +
context``), capped per KV head. The self-study tier adds generated conversations (`self_study.py`). A long
conversation can run in pieces that continue one cache (`answer_pieces`, `join_pieces`): the attention scores of a
piece take ``piece x keys`` per head instead of ``sequence x keys``, with the queries of one forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from ..attention.recording import capture_queries
from ..generation import context_copy
from ..validation import check_int

__all__ = [
    "Conversation",
    "cap_queries",
    "conversation_queries",
    "Piece",
    "answer_pieces",
    "join_pieces",
    "piece_spans",
    "repeat_pass_queries",
    "repetition_conversation",
    "subsample_queries",
]

DEFAULT_CAP = 50_000
DEFAULT_INSTRUCTION = "Repeat the text above verbatim."


def piece_spans(length: int, step: int) -> list[tuple[int, int]]:
    """``[start, end)`` of the consecutive pieces of at most ``step`` tokens that cover ``length`` tokens."""
    return [(start, min(start + step, length)) for start in range(0, length, step)]


@dataclass(frozen=True)
class Piece:
    """Tokens ``[start, end)`` of a sequence whose queries from ``answer_start`` on are wanted."""

    start: int
    end: int
    answer_start: int

    @property
    def positions(self) -> slice:
        """The wanted positions within the piece (empty when the piece ends before the answer)."""
        return slice(max(self.answer_start - self.start, 0), None)

    @property
    def count(self) -> int:
        """How many wanted positions the piece holds."""
        return max(self.end - max(self.answer_start, self.start), 0)


def answer_pieces(length: int, answer_start: int, chunk_tokens: int | None) -> list[Piece]:
    """The pieces of at most ``chunk_tokens`` tokens (``None``: one piece) that cover a ``length``-token sequence."""
    step = check_int("chunk_tokens", chunk_tokens, 1, counts="tokens per forward", none_ok=True)
    return [Piece(start, end, answer_start) for start, end in piece_spans(length, step or length)]


def join_pieces(parts: Sequence[dict[int, torch.Tensor]], pieces: Sequence[Piece]) -> dict[int, torch.Tensor]:
    """Captures of consecutive pieces of one sequence as the capture of one forward over them all.

    Args:
        parts: per piece, ``{layer: [H_kv, g * P_i, D]}`` as `capture_queries` returns it for the piece's
            ``positions`` (``P_i`` = its ``count``, possibly 0).
        pieces: the pieces, in order.

    Returns:
        ``{layer: [H_kv, g * sum(P_i), D]}``, query head ``j`` of a KV head in rows ``j * P .. (j + 1) * P - 1`` with
        its positions in sequence order (plain concatenation would interleave the query heads piece by piece).
    """
    total = sum(piece.count for piece in pieces)
    joined = {}
    for layer in parts[0]:
        n_kv_heads, _, dim = parts[0][layer].shape
        group = sum(part[layer].shape[1] for part in parts) // max(total, 1)
        per_head = [
            part[layer].reshape(n_kv_heads, group, piece.count, dim) for part, piece in zip(parts, pieces, strict=True)
        ]
        joined[layer] = torch.cat(per_head, dim=2).reshape(n_kv_heads, group * total, dim)
    return joined


def subsample_queries(queries: torch.Tensor, cap: int = DEFAULT_CAP, seed: int = 0) -> torch.Tensor:
    """Seeded random subsample without replacement, kept in the original order: ``[N, D] -> [min(N, cap), D]``."""
    check_int("cap", cap, 1, counts="queries per head")
    n = queries.shape[0]
    if n <= cap:
        return queries
    kept = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:cap].sort().values
    return queries[kept.to(queries.device)]


def cap_queries(queries: dict[int, torch.Tensor], cap: int | None, seed: int = 0) -> dict[int, torch.Tensor]:
    """``{layer: [H_kv, N, D]}`` -> ``{layer: [H_kv, min(N, cap), D]}`` by `subsample_queries` per KV head (the same
    draw for every head); ``cap=None`` returns ``queries`` as they are."""
    if cap is None:
        return queries
    return {
        layer: torch.stack([subsample_queries(head, cap, seed) for head in per_head])
        for layer, per_head in queries.items()
    }


@dataclass(frozen=True)
class Conversation:
    """A calibration turn that follows the context: ``prompt_ids [P]`` then ``answer_ids [A]`` (1-D LongTensors).

    Its calibration queries are those of the answer tokens. ``name`` says which conversation it is (``repetition``,
    ``summary``, ...).
    """

    name: str
    prompt_ids: torch.Tensor
    answer_ids: torch.Tensor

    def __post_init__(self):
        for field_name in ("prompt_ids", "answer_ids"):
            ids = getattr(self, field_name)
            if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point():
                raise ValueError(f"Conversation.{field_name} must be a 1-D tensor of token ids, got {ids!r}")


def _instruction_ids(
    tokenizer: PreTrainedTokenizerBase | None, instruction: str, instruction_ids: torch.Tensor | None
) -> torch.Tensor:
    """The instruction prompt as ids ``[P]``: ``instruction_ids`` if given, else ``instruction`` tokenized as is."""
    if instruction_ids is not None:
        return instruction_ids.reshape(-1)
    if tokenizer is None:
        raise ValueError("the repeat prompt needs a tokenizer, or the prompt as instruction_ids [1, P]")
    return tokenizer(instruction, return_tensors="pt", add_special_tokens=False).input_ids.reshape(-1)


def repetition_conversation(
    tokenizer: PreTrainedTokenizerBase | None,
    text_ids: torch.Tensor,
    instruction: str = DEFAULT_INSTRUCTION,
    instruction_ids: torch.Tensor | None = None,
) -> Conversation:
    """The teacher-forced verbatim repetition: prompt ``instruction``, answer ``text_ids`` (``[1, T]`` or ``[T]``,
    the context or one chunk of it)."""
    return Conversation("repetition", _instruction_ids(tokenizer, instruction, instruction_ids), text_ids.reshape(-1))


def conversation_queries(
    model: PreTrainedModel,
    context_ids: torch.Tensor,
    conversations: Sequence[Conversation],
    context_cache=None,
    layers=None,
    chunk_tokens: int | None = None,
) -> dict[int, torch.Tensor]:
    """Queries of the answer tokens of each conversation after the context, teacher-forced, one forward each (or a
    forward per piece of ``chunk_tokens``).

    Args:
        context_ids: ``[1, T]``.
        conversations: each runs as ``context + prompt + answer``; those with an empty answer add nothing.
        context_cache: a cache holding exactly the context (e.g. a `CompactedCache` whose earlier layers are
            compacted, for on-policy calibration); each conversation then continues a `context_copy` of it
            and the given cache is left as it is. ``None`` runs the context in every conversation's forward.
        layers: only these global layers, each forward stopped after the last of them (`capture_queries`).
        chunk_tokens: run each conversation's sequence (with the context when ``context_cache`` is ``None``) in
            consecutive pieces of at most this many tokens, each continuing the cache of the pieces before it: the
            attention scores then take ``chunk_tokens x keys`` instead of ``sequence x keys`` per head, and the
            queries are those of one forward (up to rounding). ``None``: one forward per conversation.

    Returns:
        ``{layer_idx: [H_kv, g * A, D]}`` for each global layer (of ``layers``), ``A`` = total answer tokens: the
        captures of the conversations concatenated in order, each grouped per KV head as in `capture_queries`.
    """
    if context_ids.dim() != 2 or context_ids.shape[0] != 1 or context_ids.shape[1] == 0:
        raise ValueError(f"context_ids must be [1, T] with T > 0, got shape {tuple(context_ids.shape)}")
    if context_cache is not None and context_cache.get_seq_length() != context_ids.shape[1]:
        raise ValueError(
            f"context_cache holds {context_cache.get_seq_length()} tokens, the context has {context_ids.shape[1]}"
        )
    captures = []
    for conversation in conversations:
        if conversation.answer_ids.numel() == 0:
            continue
        turn = torch.cat([conversation.prompt_ids, conversation.answer_ids]).to(context_ids)[None]
        if context_cache is None:
            sequence, cache, prefix = torch.cat([context_ids, turn], dim=1), None, context_ids.shape[1]
        else:
            sequence, cache, prefix = turn, context_copy(context_cache), 0
        pieces = answer_pieces(sequence.shape[1], prefix + conversation.prompt_ids.numel(), chunk_tokens)
        if len(pieces) > 1 and cache is None:
            cache = DynamicCache(config=model.config)
        parts = [capture_queries(model, sequence[:, p.start : p.end], p.positions, cache, layers) for p in pieces]
        captures.append(join_pieces(parts, pieces))
    if not captures:
        raise ValueError("no conversation has answer tokens, so there are no calibration queries")
    return {layer: torch.cat([capture[layer] for capture in captures], dim=1) for layer in captures[0]}


def repeat_pass_queries(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    context_ids: torch.Tensor,
    cap: int | None = DEFAULT_CAP,
    seed: int = 0,
    instruction: str = DEFAULT_INSTRUCTION,
    instruction_ids: torch.Tensor | None = None,
    context_cache=None,
) -> dict[int, torch.Tensor]:
    """Repeat-pass ("-fast") calibration: queries of the second copy in one forward over ``context + prompt + context``.

    Args:
        context_ids: ``[1, T]``.
        cap: at most this many queries per KV head, drawn with `subsample_queries` (the same draw for every head);
            ``None`` keeps them all.
        instruction_ids: ``[1, P]`` or ``[P]``; replaces ``instruction`` (then ``tokenizer`` may be ``None``).
        context_cache: a cache already holding the first copy of the context (e.g. a `CompactedCache` whose earlier
            layers are compacted, for on-policy calibration); only ``prompt + context`` is then run, on a copy
            (`context_copy`): the given cache is left as it is.

    Returns:
        ``{layer_idx: [H_kv, min(g * T, cap), D]}`` for each global layer.
    """
    conversation = repetition_conversation(tokenizer, context_ids, instruction, instruction_ids)
    return cap_queries(conversation_queries(model, context_ids, [conversation], context_cache), cap, seed)
