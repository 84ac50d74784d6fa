"""``StructuralLogitsProcessor``: constrained decoding that also records each generated token's structural tags.

Used as ``model.generate(..., logits_processor=LogitsProcessorList([proc]))`` (greedy or sampling, batch > 1,
left padding). Each call masks the tokens the grammar forbids with ``-inf`` and, for every token generated since
the previous call, advances that sequence's parser and stores the token's candidate tags, which the
mixed-precision cache reads through :meth:`StructuralLogitsProcessor.tags`.

Timing in ``generate``: the call that produces the logits of token ``i + 1`` is the first to see token ``i``, i.e.
after the forward pass that stored token ``i``'s K/V. Everything is derived from ``input_ids``: the generated
tokens are ``input_ids[b, prompt_len:]`` (``prompt_len`` = the length at the first call); when they no longer extend
what was processed (a crop, a speculative rollback, a beam reorder), the sequence is rewound to the common prefix
and re-advanced.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from transformers import LogitsProcessor, PreTrainedTokenizerBase

from .adapter import GrammarAdapter, GrammarSequence
from .function_calls import function_call_schema
from .lmfe import JsonSchemaAdapter
from .tag_source import TokenTags
from .tags import StructuralTag, check_tag_view, position_tag, view_tags

__all__ = ["ENGINES", "StructuralLogitsProcessor", "resolve_engine"]

ENGINES = ("auto", "xgrammar", "lmfe")
"""Masking engines for ``tools=`` / ``schema=``: ``"xgrammar"`` (`XgrammarJsonAdapter`), ``"lmfe"``
(lm-format-enforcer, `JsonSchemaAdapter`), ``"auto"``: xgrammar when it is installed, else lm-format-enforcer."""


def resolve_engine(engine: str) -> str:
    """The engine ``engine`` names: ``"xgrammar"`` or ``"lmfe"`` (``"auto"``: xgrammar when it is installed).

    Raises:
        ValueError: ``engine`` is not one of :data:`ENGINES`.
        ImportError: ``engine="xgrammar"`` without xgrammar installed.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    installed = importlib.util.find_spec("xgrammar") is not None
    if engine == "xgrammar" and not installed:
        raise ImportError('engine="xgrammar" needs xgrammar: pip install "xgrammar==0.2.9", or pass engine="lmfe"')
    if engine == "auto":
        return "xgrammar" if installed else "lmfe"
    return engine


def _schema_adapter(
    tokenizer: PreTrainedTokenizerBase,
    schema: Mapping[str, Any],
    eos_token_id,
    engine: str,
    max_rollback_tokens: int | None = None,
) -> GrammarAdapter:
    """The grammar adapter of ``engine`` (resolved: ``"xgrammar"`` or ``"lmfe"``) for a JSON schema."""
    if engine == "lmfe":
        return JsonSchemaAdapter(tokenizer, schema, eos_token_id=eos_token_id)
    from .xgrammar_json import XgrammarJsonAdapter  # xgrammar is optional: imported only when chosen

    return XgrammarJsonAdapter(tokenizer, schema, eos_token_id=eos_token_id, max_rollback_tokens=max_rollback_tokens)


class _SequenceRecord:
    """Per batch row: the generated tokens processed, their tags, and the parser state."""

    def __init__(self, grammar: GrammarSequence):
        self.grammar = grammar
        self.tokens: list[int] = []
        self.tags: list[TokenTags] = []
        self.stop_index: int | None = None  # index of the first stop token; later tokens are not advanced


class StructuralLogitsProcessor(LogitsProcessor):
    """Masks what the grammar forbids and tags every generated token from its parser transition: the `TagSource` a
    `StructuredMixedPrecisionCache` reads.

    Give exactly one of ``tools`` (BFCL / OpenAI tool definitions -> :func:`function_call_schema`), ``schema`` (a
    JSON schema) or ``adapter`` (any :class:`GrammarAdapter`, e.g. the xgrammar SQL grammar
    :class:`~hf_structkv.structure.xgrammar_sql.SqlGrammarAdapter`).

    Args:
        tokenizer: the model's tokenizer (needed for ``tools`` / ``schema``).
        tools: tool definitions; the output is a JSON list of ``{"name", "arguments"}`` calls.
        schema: a JSON schema for the output.
        adapter: a ready grammar adapter (its own stop tokens apply).
        eos_token_id: stop token id(s) for ``tools`` / ``schema``; default ``tokenizer.eos_token_id``.
        tag_view: which fields of the tags the cache gets (`TAG_VIEWS`; ``"full"`` unless running a structural
            ablation): recorded tags are the parser's tags as `view_tags` sees them. A `PolicyTable` records the view
            it was calibrated on; ``generate_calls`` builds its processor with that view. With
            ``"position_bins"`` each generated token's one tag is its position bin (`position_tag`): the grammar
            still masks, but its transitions no longer reach the cache.
        position_bins: the bin starts of the ``"position_bins"`` view (the table's ``position_bins``); ``()``
            otherwise.
        engine: what masks ``tools`` / ``schema`` (:data:`ENGINES`): ``"xgrammar"`` (flat cost per token at any
            history), ``"lmfe"`` (lm-format-enforcer) or ``"auto"`` (xgrammar when installed). The tags are the same
            either way (our parser walk); the two grammars differ in a few places, listed in
            :mod:`~hf_structkv.structure.xgrammar_json`. The resolved name is :attr:`engine` (``None`` with
            ``adapter``).
        max_rollback_tokens: xgrammar only: how many generated tokens a sequence can be rewound by (``crop()``,
            speculative decoding); the tagging walk then keeps its parser states of that many tokens only, so the
            engine's memory stays flat however long the history (xgrammar's matcher keeps its own compact rollback
            history). ``None`` (default): rewind anywhere, every token's states kept.

    Raises:
        ValueError: not exactly one of ``tools``, ``schema``, ``adapter``; ``eos_token_id``, ``max_rollback_tokens``
            or an ``engine`` other than ``"auto"`` with ``adapter``; ``max_rollback_tokens`` with the ``"lmfe"``
            engine; an unknown ``engine``; malformed tools or schema; an unknown
            ``tag_view`` or bins that do not fit it.
        TypeError: ``adapter`` is not a :class:`GrammarAdapter`, or ``tokenizer`` is missing / not a tokenizer.
        ImportError: ``engine="xgrammar"`` without xgrammar installed.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        schema: Mapping[str, Any] | None = None,
        adapter: GrammarAdapter | None = None,
        eos_token_id: int | Iterable[int] | None = None,
        tag_view: str = "full",
        position_bins: Sequence[int] = (),
        engine: str = "auto",
        max_rollback_tokens: int | None = None,
    ):
        resolved = resolve_engine(engine)
        given = [
            name for name, value in (("tools", tools), ("schema", schema), ("adapter", adapter)) if value is not None
        ]
        if len(given) != 1:
            raise ValueError(f"give exactly one of tools=, schema=, adapter=; got {given or 'none'}")
        if adapter is not None:
            if not isinstance(adapter, GrammarAdapter):
                raise TypeError(f"adapter must be a GrammarAdapter, got {type(adapter).__name__}")
            if eos_token_id is not None:
                raise ValueError("eos_token_id applies to tools= / schema=; an adapter brings its own stop tokens")
            if engine != "auto":
                raise ValueError(f"engine applies to tools= / schema=; an adapter is its own engine, got {engine!r}")
            if max_rollback_tokens is not None:
                raise ValueError("max_rollback_tokens applies to tools= / schema= with xgrammar, not to an adapter")
            adapter.check_family()
            resolved = None
        else:
            if not isinstance(tokenizer, PreTrainedTokenizerBase):
                raise TypeError(f"tokenizer must be a transformers tokenizer, got {type(tokenizer).__name__}")
            schema = function_call_schema(tools) if tools is not None else schema
            if max_rollback_tokens is not None and resolved != "xgrammar":
                raise ValueError(
                    "max_rollback_tokens bounds xgrammar's states; lm-format-enforcer keeps every token's parser: "
                    'use engine="xgrammar" (or "auto" with xgrammar installed), or max_rollback_tokens=None'
                )
            adapter = _schema_adapter(tokenizer, schema, eos_token_id, resolved, max_rollback_tokens)
        self.engine = resolved
        self.position_bins = check_tag_view(tag_view, adapter.family, position_bins)
        self.adapter = adapter
        self.tag_view = tag_view
        self._records: list[_SequenceRecord] = []
        self._prompt: torch.Tensor | None = None  # [batch, prompt_len] ids of the first call

    @property
    def family(self) -> str:
        """Tag vocabulary family: ``"function_calling"`` or ``"sql"``."""
        return self.adapter.family

    @property
    def prompt_length(self) -> int | None:
        """Length of the (left-padded) prompt seen at the first call; ``None`` before the first call. Generated
        token ``i`` of a sequence sits at position ``prompt_length + i``."""
        return None if self._prompt is None else self._prompt.shape[1]

    def reset(self) -> None:
        """Forget all sequences (call before a new ``generate`` with this processor)."""
        self._records = []
        self._prompt = None
        self.adapter.reset()

    def tags(self, seq: int) -> list[TokenTags]:
        """Tags of sequence ``seq``'s generated tokens so far, in order: the candidate tags of each token (empty
        tuple = unresolved, protect fully), or ``None`` for a stop token and every token after it (no charge)."""
        return list(self._record(seq).tags)

    def tag_at(self, seq: int, index: int) -> TokenTags:
        """The tags of generated token ``index`` of sequence ``seq`` (same meaning as :meth:`tags`), O(1)."""
        tags = self._record(seq).tags
        if not isinstance(index, int) or not 0 <= index < len(tags):
            raise IndexError(f"sequence {seq} has {len(tags)} tagged tokens; index {index!r} is out of range")
        return tags[index]

    def num_tagged(self, seq: int) -> int:
        """Number of generated tokens of sequence ``seq`` tagged so far."""
        return len(self._record(seq).tags)

    def _record(self, seq: int) -> _SequenceRecord:
        if not isinstance(seq, int) or not 0 <= seq < len(self._records):
            raise IndexError(f"seq must be a batch index in [0, {len(self._records)}), got {seq!r}")
        return self._records[seq]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """``input_ids`` ``[batch, prompt_len + generated]``, ``scores`` ``[batch, vocab]`` -> masked scores."""
        if input_ids.dim() != 2 or scores.dim() != 2 or input_ids.shape[0] != scores.shape[0]:
            raise ValueError(
                f"expected input_ids [batch, length] and scores [batch, vocab] with the same batch, got "
                f"{tuple(input_ids.shape)} and {tuple(scores.shape)}"
            )
        self._start_or_check(input_ids)
        prompt_len = self._prompt.shape[1]
        generated = input_ids[:, prompt_len:].tolist()
        allowed = torch.ones(scores.shape, dtype=torch.bool)
        for row, (record, tokens) in enumerate(zip(self._records, generated)):
            self._sync(record, tokens)
            if record.stop_index is None:  # finished rows are left to generate's padding
                allowed[row] = record.grammar.allowed_token_mask(scores.shape[1])
        return scores.masked_fill(~allowed.to(scores.device), float("-inf"))

    def _start_or_check(self, input_ids: torch.Tensor) -> None:
        """Remember the prompt at the first call; later calls must continue the same prompts."""
        if self._prompt is None:
            self._prompt = input_ids.detach().to("cpu", copy=True)
            self._records = [_SequenceRecord(self.adapter.new_sequence()) for _ in range(input_ids.shape[0])]
            return
        batch, prompt_len = self._prompt.shape
        if (
            input_ids.shape[0] != batch
            or input_ids.shape[1] < prompt_len
            or not torch.equal(input_ids[:, :prompt_len].cpu(), self._prompt)
        ):
            raise ValueError(
                "input_ids do not continue the prompts this processor started with; call processor.reset() "
                "before each new generate call"
            )

    def _sync(self, record: _SequenceRecord, tokens: list[int]) -> None:
        """Rewind ``record`` to the common prefix with ``tokens``, then advance through the rest."""
        common = 0
        limit = min(len(record.tokens), len(tokens))
        if record.tokens[:limit] == tokens[:limit]:
            common = limit
        else:
            while record.tokens[common] == tokens[common]:
                common += 1
        if common < len(record.tokens):
            advanced = len(record.tokens) if record.stop_index is None else record.stop_index
            record.grammar.rollback(advanced - min(advanced, common))
            del record.tokens[common:]
            del record.tags[common:]
            if record.stop_index is not None and record.stop_index >= common:
                record.stop_index = None
        stops = self.adapter.stop_token_ids
        for token in tokens[common:]:
            if record.stop_index is None and token in stops:
                record.stop_index = len(record.tokens)
            if record.stop_index is not None:
                record.tags.append(None)
            else:
                record.tags.append(self._tags(record.grammar.advance(token), len(record.tags)))
            record.tokens.append(token)

    def _tags(self, candidates: tuple[StructuralTag, ...], index: int) -> tuple[StructuralTag, ...]:
        """What the cache gets for generated token ``index`` whose parser candidates are ``candidates``."""
        if self.tag_view == "position_bins":
            return (position_tag(index, self.position_bins, self.family),)
        return view_tags(candidates, self.tag_view, self.family)
