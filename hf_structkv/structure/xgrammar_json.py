"""xgrammar JSON-schema grammar adapter (family ``"function_calling"``): masks from xgrammar's ``GrammarMatcher`` over
the compiled JSON schema, tags from our parser walk (:func:`~hf_structkv.structure.json_tags.token_tags` over
lm-format-enforcer's ``JsonSchemaParser``), so a token gets the tags the lm-format-enforcer engine
(:class:`~hf_structkv.structure.lmfe.JsonSchemaAdapter`) gives it, by construction.

Why: lm-format-enforcer's ``TokenEnforcer`` keys a parser state by the whole token prefix, so its masking costs
grow with the history (4 ms per token at 128 tokens, 10 ms at 8K) and its memory quadratically. xgrammar's matcher
keeps one pushdown state with a rollback history; the tagging walk keeps one parser per token (for rollback), as
the lm-format-enforcer engine does.

The tagging parser reads the characters of each token from xgrammar's own bytes (UTF-8, unfinished characters
wait for the token that completes them). It gets lm-format-enforcer's default configuration except:

* its alphabet (the characters a free string may hold) is the vocabulary's single-character tokens, the rule
  lm-format-enforcer's ``TokenEnforcer`` applies (computed here from xgrammar's bytes: for Qwen2 it lacks one
  character of lm-format-enforcer's, '\\u17d2', which lm-format-enforcer reads off a token ending in a cut
  character). A character outside it (e.g. one Qwen spells only with byte pieces) is masked by xgrammar like any
  other, but our walk cannot follow it: that token and every later one are tagged unresolved (full protection),
  the lm-format-enforcer engine's limitation too;
* no cap on array lengths and on consecutive whitespace: xgrammar enforces them.

The two engines' languages differ (``tests/test_xgrammar_engine.py`` tests each difference). xgrammar is compiled
with lm-format-enforcer's whitespace freedom between elements (any of space, tab, newline, carriage return, at most
12 in a row) and otherwise enforces strict JSON; lm-format-enforcer 0.11.3 allows more: whitespace before and after
the output, object properties in any order (xgrammar: the schema's order), a comma before ``}``, control
characters inside strings, exponents on integers and ``1.e5``, byte tokens that cannot continue UTF-8, and arrays
without ``maxItems`` are capped at 20 items by lm-format-enforcer only; lm-format-enforcer's free-string table
omits tokens that hold string characters, the closing quote and more (``' ",'``, ``'."\\n'``) and longer tokens with
a backslash (``'\\u'``), which xgrammar allows.
"""

from __future__ import annotations

import json
import sys
import weakref
from collections import deque
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from lmformatenforcer import JsonSchemaParser
from lmformatenforcer.characterlevelparser import CharacterLevelParser, CharacterLevelParserConfig, ForceStopParser
from lmformatenforcer.consts import DEFAULT_MAX_CONSECUTIVE_WHITESPACES
from transformers import PreTrainedTokenizerBase

from ..validation import check_int
from .adapter import GrammarAdapter, stop_token_ids
from .json_tags import token_tags
from .tags import StructuralTag
from .xgrammar_matching import MatcherSequence, new_matcher, xgrammar_compiler

if TYPE_CHECKING:
    import xgrammar

__all__ = ["XGRAMMAR_JSON_OPTIONS", "XgrammarJsonAdapter", "XgrammarJsonSequence", "tagging_alphabet"]

XGRAMMAR_JSON_OPTIONS = {"any_whitespace": True, "max_whitespace_cnt": DEFAULT_MAX_CONSECUTIVE_WHITESPACES}
"""``compile_json_schema`` options: lm-format-enforcer's whitespace freedom between elements."""

_ALPHABETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tagging_alphabet(tokenizer: PreTrainedTokenizerBase) -> str:
    """The characters a free string may hold in the tagging walk: every token that is exactly one UTF-8 character,
    in token-id order (lm-format-enforcer's rule), cached per tokenizer object."""
    if tokenizer not in _ALPHABETS:
        characters: dict[str, None] = {}
        for data in xgrammar_compiler(tokenizer)[1]:
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if len(text) == 1:
                characters[text] = None
        _ALPHABETS[tokenizer] = "".join(characters)
    return _ALPHABETS[tokenizer]


class XgrammarJsonAdapter(GrammarAdapter):
    """Function-calling JSON under a JSON schema, masked by xgrammar and tagged by our parser walk (family
    ``"function_calling"``).

    The schema is compiled once (xgrammar's compiler caches by schema text, one compiler per tokenizer); each
    sequence owns a matcher (mask, accept, rollback) and its tagging parsers. The tokenizer's special tokens other
    than the stop tokens are never allowed (lm-format-enforcer's rule; xgrammar would allow ``<|endoftext|>`` inside
    a string as its literal text).

    Args:
        tokenizer: the model's tokenizer.
        schema: a JSON schema (e.g. :func:`~hf_structkv.structure.function_calls.function_call_schema`).
        eos_token_id: stop token id(s); default ``tokenizer.eos_token_id``.
        max_rollback_tokens: how many tokens a sequence can roll back (``crop()``, speculative decoding); it keeps
            its tagging parsers and flags of that many tokens only, so its memory stays flat at any history (the
            matcher keeps its own rollback history: xgrammar 0.2.9 has no bound for it). ``None`` (default): no
            limit, every token's states are kept.

    Raises:
        TypeError: ``tokenizer`` is not a transformers tokenizer, or ``schema`` not a dict.
        ValueError: bad ``eos_token_id`` or ``max_rollback_tokens``; a schema that is not JSON or that xgrammar or
            the tagging parser cannot handle.
    """

    family = "function_calling"

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        schema: Mapping[str, Any],
        eos_token_id: int | Iterable[int] | None = None,
        max_rollback_tokens: int | None = None,
    ):
        self.max_rollback_tokens = check_int("max_rollback_tokens", max_rollback_tokens, 0, none_ok=True)
        if not isinstance(schema, Mapping):
            raise TypeError(f"schema must be a dict (a JSON schema), got {type(schema).__name__}")
        compiler, self._token_bytes = xgrammar_compiler(tokenizer)
        self._stops = stop_token_ids(tokenizer, eos_token_id)
        self._special = torch.tensor(sorted(set(tokenizer.all_special_ids) - self._stops), dtype=torch.long)
        try:
            text = json.dumps(schema)
        except (TypeError, ValueError) as err:
            raise ValueError(f"schema must be JSON (plain dicts, lists, strings, numbers): {err}") from err
        config = CharacterLevelParserConfig(
            alphabet=tagging_alphabet(tokenizer), max_consecutive_whitespaces=sys.maxsize, max_json_array_length=0
        )
        try:
            self._root = JsonSchemaParser(json.loads(text), config=config)
        except Exception as err:
            raise ValueError(f"the tagging parser (lm-format-enforcer's) cannot parse schema: {err}") from err
        try:
            self._compiled = compiler.compile_json_schema(text, **XGRAMMAR_JSON_OPTIONS)
        except (RuntimeError, ValueError) as err:
            raise ValueError(f"xgrammar cannot compile schema: {err}") from err

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self._stops

    def reset(self) -> None:
        """Nothing to drop: sequences share only the compiled grammar and the tagging parser's start state."""

    def new_sequence(self) -> XgrammarJsonSequence:
        matcher = new_matcher(self._compiled, self._stops)
        return XgrammarJsonSequence(matcher, self._root, self._token_bytes, self._special, self.max_rollback_tokens)


class XgrammarJsonSequence(MatcherSequence):
    """Matcher and tagging parsers of one sequence under an :class:`XgrammarJsonAdapter`: the parser after each of
    the last ``max_rollback_tokens`` tokens is kept (they are immutable; ``None``: after every token), so a rollback
    truncates them."""

    def __init__(
        self,
        matcher: xgrammar.GrammarMatcher,
        root: CharacterLevelParser,
        token_bytes: list[bytes],
        forbidden: torch.Tensor | None = None,
        max_rollback_tokens: int | None = None,
    ):
        super().__init__(matcher, token_bytes, forbidden, max_rollback_tokens)
        kept = None if max_rollback_tokens is None else max_rollback_tokens + 1
        self._parsers: deque[CharacterLevelParser] = deque([root], maxlen=kept)  # the start's, then per token

    def _tag(self, text: str | None) -> tuple[StructuralTag, ...]:
        if text is None:
            self._parsers.append(ForceStopParser())
            return ()
        parser, tags = token_tags(self._parsers[-1], text)
        self._parsers.append(parser)
        return tags

    def _forget(self, num_tokens: int) -> None:
        for _ in range(num_tokens):
            self._parsers.pop()
