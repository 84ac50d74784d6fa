"""xgrammar SQL grammar adapter (family ``"sql"``): exact masks from xgrammar's ``GrammarMatcher``, tags from our
Earley parse of the same grammar (:mod:`~hf_structkv.structure.sql_tags`).

One :class:`SqlGrammarAdapter` per tokenizer and database schema. The grammar (:func:`sql_grammar`) is compiled
once per tokenizer and schema (xgrammar's compiler caches by grammar text); each sequence owns a matcher (mask,
accept, rollback) and an Earley chart (tags). Token characters are the UTF-8 decoding of xgrammar's own byte
strings of the vocabulary (``TokenizerInfo.decoded_vocab``), so both engines read the same characters; bytes of
an unfinished multi-byte character wait for the token that completes it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from functools import lru_cache
from typing import NamedTuple

import torch
from transformers import PreTrainedTokenizerBase

from ..validation import check_int
from .adapter import GrammarAdapter, GrammarSequence, stop_token_ids
from .sql_grammar import DatabaseSchema, SqlGrammar, sql_grammar
from .sql_tags import EarleySet, SqlTagger
from .tags import StructuralTag

try:
    import xgrammar
except ModuleNotFoundError as err:  # pragma: no cover - depends on the installation
    raise ImportError('the SQL grammar adapter needs xgrammar: pip install "xgrammar==0.2.9" (setup.sh)') from err

__all__ = ["SqlGrammarAdapter", "SqlGrammarSequence"]

_COMPILERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiler(tokenizer: PreTrainedTokenizerBase) -> tuple[xgrammar.GrammarCompiler, list[bytes]]:
    """One xgrammar compiler (with its tokenizer tables, ~0.5 s for Qwen's vocabulary) per tokenizer object, and the
    byte string of every token id as xgrammar reads it."""
    if tokenizer not in _COMPILERS:
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer)
        _COMPILERS[tokenizer] = (xgrammar.GrammarCompiler(info, max_threads=1), list(info.decoded_vocab))
    return _COMPILERS[tokenizer]


@lru_cache(maxsize=64)
def _grammar_and_tagger(schema: DatabaseSchema) -> tuple[SqlGrammar, SqlTagger]:
    grammar = sql_grammar(schema)
    return grammar, SqlTagger(grammar)


class SqlGrammarAdapter(GrammarAdapter):
    """SQL over one database's schema (:mod:`~hf_structkv.structure.sql_grammar`), enforced by xgrammar.

    Args:
        tokenizer: the model's tokenizer.
        schema: the database (``DatabaseSchema.from_spider(tables_json_entry)``).
        eos_token_id: stop token id(s); default ``tokenizer.eos_token_id``.

    Raises:
        TypeError: ``tokenizer`` is not a transformers tokenizer, or ``schema`` not a `DatabaseSchema`.
        ValueError: bad ``eos_token_id``.
    """

    family = "sql"

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        schema: DatabaseSchema,
        eos_token_id: int | Iterable[int] | None = None,
    ):
        if not isinstance(tokenizer, PreTrainedTokenizerBase):
            raise TypeError(f"tokenizer must be a transformers tokenizer, got {type(tokenizer).__name__}")
        if not isinstance(schema, DatabaseSchema):
            raise TypeError(f"schema must be a DatabaseSchema (from_spider), got {type(schema).__name__}")
        self.schema = schema
        self._stops = stop_token_ids(tokenizer, eos_token_id)
        self.grammar, self._tagger = _grammar_and_tagger(schema)
        compiler, self._token_bytes = _compiler(tokenizer)
        self._compiled = compiler.compile_grammar(self.grammar.ebnf)

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self._stops

    def reset(self) -> None:
        """Nothing to drop: sequences share only the compiled grammar and the tagger's productions."""

    def new_sequence(self) -> SqlGrammarSequence:
        matcher = xgrammar.GrammarMatcher(self._compiled, override_stop_tokens=sorted(self._stops))
        return SqlGrammarSequence(matcher, self._tagger, self._token_bytes)


class _Step(NamedTuple):
    """What one advanced token left: the chart length and the pending bytes after it, whether the matcher accepted
    it, and whether the tags of it and of every token before it were resolved."""

    chart_length: int
    pending: bytes
    accepted: bool
    resolved: bool


class SqlGrammarSequence(GrammarSequence):
    """Matcher, Earley chart and pending bytes of one sequence under a :class:`SqlGrammarAdapter`.

    A token the matcher rejects (only possible when something bypassed the mask) is recorded but not given to the
    matcher; from then on only stop tokens are allowed. From a token the tagger cannot resolve on (it would mean
    the two engines disagree), every tag is empty (unresolved: full protection).
    """

    def __init__(self, matcher: xgrammar.GrammarMatcher, tagger: SqlTagger, token_bytes: list[bytes]):
        self._matcher = matcher
        self._tagger = tagger
        self._token_bytes = token_bytes
        self._chart: list[EarleySet] = tagger.start()
        self._steps: list[_Step] = []

    @property
    def num_tokens(self) -> int:
        return len(self._steps)

    def _last(self) -> _Step:
        return self._steps[-1] if self._steps else _Step(len(self._chart), b"", True, True)

    def allowed_token_mask(self, vocab_size: int) -> torch.Tensor:
        """xgrammar's allowed tokens after the tokens so far, as a bool tensor ``[vocab_size]``."""
        if not self._last().accepted:
            mask = torch.zeros(vocab_size, dtype=torch.bool)
            mask[[i for i in self._matcher.stop_token_ids if i < vocab_size]] = True
            return mask
        bitmask = xgrammar.allocate_token_bitmask(1, len(self._token_bytes))  # int32 [1, ceil(V_xgr / 32)]
        self._matcher.fill_next_token_bitmask(bitmask)
        shifts = torch.arange(32, dtype=torch.int32)
        mask = ((bitmask[0].unsqueeze(-1) >> shifts) & 1).bool().flatten()  # bit j of word w = token 32 w + j
        if mask.numel() >= vocab_size:
            return mask[:vocab_size]
        return torch.cat([mask, mask.new_zeros(vocab_size - mask.numel())])

    def advance(self, token_id: int) -> tuple[StructuralTag, ...]:
        last = self._last()
        accepted = last.accepted and self._matcher.accept_token(token_id)
        if not accepted:
            self._steps.append(_Step(len(self._chart), b"", False, False))
            return ()
        text, pending = _decode(last.pending + self._token_bytes[token_id])
        tags = self._tagger.advance(self._chart, text) if last.resolved else ()
        self._steps.append(_Step(len(self._chart), pending, True, bool(tags)))
        return tags

    def rollback(self, num_tokens: int) -> None:
        check_int("num_tokens", num_tokens, 0, len(self._steps), counts="tokens accepted")
        if num_tokens == 0:
            return
        keep = len(self._steps) - num_tokens
        accepted = sum(step.accepted for step in self._steps[keep:])
        if accepted:
            self._matcher.rollback(accepted)
        del self._steps[keep:]
        del self._chart[self._steps[-1].chart_length if self._steps else 1 :]

    def is_complete(self) -> bool:
        return self._last().accepted and self._matcher.is_completed()


def _decode(data: bytes) -> tuple[str, bytes]:
    """The complete UTF-8 characters of ``data`` and the bytes of an unfinished last character."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8"), data[cut:]
        except UnicodeDecodeError:
            continue
    return data.decode("utf-8", errors="replace"), b""
