"""Calibration queries: the post-RoPE query vectors each global attention layer receives, grouped per KV head.

`capture_queries` runs one forward with a recording attention function, registered with transformers'
``AttentionInterface`` under ``RECORD_NAME`` at call time (never at import). It records ``query`` and delegates to
the attention the model ran before (so an hf_structkv-enabled model keeps serving its `CompactedCache`); the model's
attention implementation is restored afterwards, also when the forward raises.

A calibration `Conversation` is a prompt and an answer that follow the context; its queries are those of the answer
tokens, teacher-forced (`conversation_queries`). `repeat_pass_queries` is the "-fast" tier: the one conversation
"repeat the text verbatim" whose answer is the context itself (the second copy in ``context + instruction +
context``), capped per KV head. The self-study tier adds generated conversations (`self_study.py`). A long
conversation can run in pieces that continue one cache (`answer_pieces`, `join_pieces`): the attention scores of a
piece take ``piece x keys`` per head instead of ``sequence x keys``, with the queries of one forward.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..generation import context_copy
from ..validation import check_int, is_int

__all__ = [
    "RECORD_NAME",
    "Conversation",
    "cap_queries",
    "capture_queries",
    "conversation_queries",
    "Piece",
    "answer_pieces",
    "join_pieces",
    "piece_spans",
    "repeat_pass_queries",
    "repetition_conversation",
    "recording",
    "subsample_queries",
]

RECORD_NAME = "hf_structkv_record"
DEFAULT_CAP = 50_000
DEFAULT_INSTRUCTION = "Repeat the text above verbatim."

Positions = slice | torch.Tensor | None


@dataclass
class _Recorder:
    """Where the recording attention puts the queries of the forward in progress; with ``layers`` set, only those
    layers are recorded and the forward stops once the last of them is."""

    delegate: Callable
    positions: slice | torch.Tensor
    layers: frozenset[int] | None = None
    queries: dict[int, torch.Tensor] = field(default_factory=dict)


class _CaptureComplete(Exception):
    """Raised by the recording attention when every requested layer is recorded: the rest of the forward is not
    needed (caught by `capture_queries`)."""


_ACTIVE: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar("hf_structkv_query_recorder", default=None)


def _group_by_kv_head(query: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """``[H_q, n, D]`` -> ``[H_kv, g * n, D]``: KV head ``h`` stacks query heads ``h*g .. (h+1)*g - 1``, head-major."""
    n_q_heads, n, dim = query.shape
    return query.reshape(n_kv_heads, (n_q_heads // n_kv_heads) * n, dim)


def recording_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention registered as ``RECORD_NAME``: records the query of a global layer, then runs the delegate; once
    the recorder's ``layers`` are all recorded it raises `_CaptureComplete` after the delegate (the cache layer just
    updated has then been served, so a compacted cache can be continued by a next forward).

    Args:
        query: ``[1, H_q, q, D]``, post-RoPE (and post q-norm where the model has one); key / value:
            ``[1, H_kv, n, D]``. Layers with a ``sliding_window`` are not recorded.

    Returns:
        Whatever the delegate (the model's previous attention function) returns.
    """
    recorder = _ACTIVE.get()
    if recorder is None:
        raise RuntimeError(f"{RECORD_NAME!r} attention runs only inside hf_structkv's capture_queries")
    wanted = recorder.layers is None or module.layer_idx in recorder.layers
    if kwargs.get("sliding_window") is None and wanted:
        if query.shape[0] != 1:
            raise ValueError(f"capture_queries records a single sequence, got a batch of {query.shape[0]}")
        selected = query[0][:, recorder.positions].detach()
        recorder.queries[module.layer_idx] = _group_by_kv_head(selected, key.shape[1])
    output = recorder.delegate(module, query, key, value, attention_mask, **kwargs)
    if recorder.layers is not None and recorder.layers.issubset(recorder.queries):
        raise _CaptureComplete  # after the delegate, so the cache layer it updated was also served
    return output


def _register_recording(previous: str) -> Callable:
    """Register ``RECORD_NAME`` with ``previous``'s mask function; returns ``previous``'s attention function."""
    if previous not in ALL_ATTENTION_FUNCTIONS or previous not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"cannot record queries under attention implementation {previous!r}: it needs both an attention and a "
            "mask function registered with transformers (e.g. 'sdpa' or hf_structkv's); switch the model first"
        )
    AttentionInterface.register(RECORD_NAME, recording_attention)
    AttentionMaskInterface.register(RECORD_NAME, ALL_MASK_ATTENTION_FUNCTIONS[previous])
    return ALL_ATTENTION_FUNCTIONS[previous]


def _check_positions(positions: Positions) -> slice | torch.Tensor:
    """``None`` -> every position; a tensor must be 1-D integer indices into the new tokens."""
    if positions is None:
        return slice(None)
    if isinstance(positions, torch.Tensor) and (positions.dim() != 1 or positions.is_floating_point()):
        raise ValueError(f"positions must be a 1-D integer tensor, got shape {tuple(positions.shape)}")
    if not isinstance(positions, (slice, torch.Tensor)):
        raise TypeError(f"positions must be a slice, a 1-D integer tensor or None, got {type(positions).__name__}")
    return positions


def _check_layers(layers) -> frozenset[int] | None:
    """``None`` (every global layer) or a non-empty collection of layer indices -> a frozenset."""
    if layers is None:
        return None
    try:
        chosen = frozenset(layers)
    except TypeError:
        raise TypeError(f"layers must be a collection of layer indices or None, got {type(layers).__name__}") from None
    if not chosen or any(not is_int(i) or i < 0 for i in chosen):
        raise ValueError(f"layers must be non-empty layer indices >= 0, got {sorted(chosen, key=str)!r}")
    return chosen


def capture_queries(
    model: PreTrainedModel, input_ids: torch.Tensor, positions: Positions = None, cache=None, layers=None
) -> dict[int, torch.Tensor]:
    """Run ``model`` once on ``input_ids [1, L]`` and return the queries of every global attention layer.

    Args:
        positions: which of the ``L`` new tokens to keep (a slice or 1-D indices); ``None`` keeps all.
        cache: a prefilled cache to continue (updated in place), e.g. from `prefill_context` or a `CompactedCache`.
        layers: record only these global layers (indices) and stop the forward as soon as the last of them is
            recorded (on-policy calibration needs one layer per pass). The layers after it then never run: a given
            ``cache`` holds the new tokens only up to that layer, so pass a copy (`context_copy`). ``None``: every
            global layer, the whole forward.

    Returns:
        ``{layer_idx: [H_kv, g * P, D]}`` for each non-sliding layer (of ``layers``), ``g = H_q / H_kv`` and ``P``
        selected positions: the queries exactly as the attention function receives them (post-RoPE, post
        q/k-norm), the ``g`` query heads of a KV head stacked head-major (rows ``j*P .. (j+1)*P - 1`` are query
        head ``h*g + j``).
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, L], got shape {tuple(input_ids.shape)}")
    with recording(model, positions, layers) as recorder:
        model(input_ids.to(model.device), cache=cache, use_cache=cache is not None, logits_to_keep=1)
    return recorder.queries


@contextlib.contextmanager
def recording(model: PreTrainedModel, positions: Positions = None, layers=None) -> Iterator[_Recorder]:
    """Run the body with ``model``'s attention recording queries (`capture_queries` runs one forward in it).

    Yields the recorder, whose ``queries`` (``{layer_idx: [H_kv, g * P, D]}``) fill as attention runs; with
    ``layers``, the forward in the body ends quietly once the last of them is recorded. On exit the attention
    implementation is restored (also when the body raises), grad mode too.

    Raises:
        ValueError: some of ``layers`` were not recorded (not global attention layers, or never run).
    """
    chosen = _check_layers(layers)
    previous = model.config._attn_implementation
    recorder = _Recorder(delegate=_register_recording(previous), positions=_check_positions(positions), layers=chosen)
    token = _ACTIVE.set(recorder)
    try:
        model.set_attn_implementation(RECORD_NAME)
        with torch.no_grad():
            yield recorder
    except _CaptureComplete:
        pass
    finally:
        model.set_attn_implementation(previous)
        _ACTIVE.reset(token)
    if chosen is not None and not chosen.issubset(recorder.queries):
        missing = sorted(chosen - recorder.queries.keys())
        raise ValueError(f"layers {missing} are not global attention layers of this model; nothing was recorded there")


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
