"""xgrammar SQL grammar adapter (family ``"sql"``): exact masks from xgrammar's ``GrammarMatcher``, tags from our
Earley parse of the same grammar (:mod:`~hf_structkv.structure.sql_tags`).

One :class:`SqlGrammarAdapter` per tokenizer and database schema. The grammar (:func:`sql_grammar`) is compiled
once per tokenizer and schema (xgrammar's compiler caches by grammar text); each sequence owns a matcher (mask,
accept, rollback: :class:`~hf_structkv.structure.xgrammar_matching.MatcherSequence`) and an Earley chart (tags).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from typing import TYPE_CHECKING

from transformers import PreTrainedTokenizerBase

from .adapter import GrammarAdapter, stop_token_ids
from .sql_grammar import DatabaseSchema, SqlGrammar, sql_grammar
from .sql_tags import EarleySet, SqlTagger
from .tags import StructuralTag
from .xgrammar_matching import MatcherSequence, new_matcher, xgrammar_compiler

if TYPE_CHECKING:
    import xgrammar

__all__ = ["SqlGrammarAdapter", "SqlGrammarSequence"]


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
        if not isinstance(schema, DatabaseSchema):
            raise TypeError(f"schema must be a DatabaseSchema (from_spider), got {type(schema).__name__}")
        compiler, self._token_bytes = xgrammar_compiler(tokenizer)
        self.schema = schema
        self._stops = stop_token_ids(tokenizer, eos_token_id)
        self.grammar, self._tagger = _grammar_and_tagger(schema)
        self._compiled = compiler.compile_grammar(self.grammar.ebnf)

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self._stops

    def reset(self) -> None:
        """Nothing to drop: sequences share only the compiled grammar and the tagger's productions."""

    def new_sequence(self) -> SqlGrammarSequence:
        return SqlGrammarSequence(new_matcher(self._compiled, self._stops), self._tagger, self._token_bytes)


class SqlGrammarSequence(MatcherSequence):
    """Matcher and Earley chart of one sequence under a :class:`SqlGrammarAdapter`. From a token the tagger cannot
    resolve on (it would mean the two engines disagree), every tag is empty (unresolved: full protection)."""

    def __init__(self, matcher: xgrammar.GrammarMatcher, tagger: SqlTagger, token_bytes: list[bytes]):
        super().__init__(matcher, token_bytes)
        self._tagger = tagger
        self._chart: list[EarleySet] = tagger.start()
        self._chart_lengths: list[int] = []  # per advanced token: the chart length after it
        self._resolved: list[bool] = []  # per advanced token: were its tags and those of every token before resolved

    def _tag(self, text: str | None) -> tuple[StructuralTag, ...]:
        resolved = not self._resolved or self._resolved[-1]
        tags = self._tagger.advance(self._chart, text) if text is not None and resolved else ()
        self._chart_lengths.append(len(self._chart))
        self._resolved.append(bool(tags))
        return tags

    def _forget(self, num_tokens: int) -> None:
        keep = len(self._chart_lengths) - num_tokens
        del self._chart_lengths[keep:]
        del self._resolved[keep:]
        del self._chart[self._chart_lengths[-1] if self._chart_lengths else 1 :]
