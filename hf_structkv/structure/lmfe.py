"""lm-format-enforcer JSON-schema grammar adapter: exact masks from its TokenEnforcer, tags from its parser states.

Also the one place that imports lm-format-enforcer's transformers integration: version 0.11.3 imports
``PreTrainedTokenizerBase`` from ``transformers.tokenization_utils``, which transformers 5 moved to
``transformers.tokenization_utils_base``; :func:`_transformers_integration` aliases the module for the duration of
that import only.

Known engine limitation (lm-format-enforcer 0.11.3): inside strings it accepts only characters that some token
spells alone (the tokenizer alphabet). A character that exists only as byte pieces (e.g. '渋' for Qwen) is still
allowed through its free-text token tables, but the engine's parse then ends (only whitespace and stop stay
allowed); this adapter tags such a token and every later one as unresolved (empty tuple: full protection).
"""

from __future__ import annotations

import copy
import importlib
import sys
import weakref
from collections.abc import Iterable, Mapping
from types import ModuleType
from typing import Any

import torch
from lmformatenforcer import JsonSchemaParser, TokenEnforcer, TokenEnforcerTokenizerData
from lmformatenforcer.characterlevelparser import CharacterLevelParser
from transformers import PreTrainedTokenizerBase

from ..validation import check_int
from .adapter import GrammarAdapter, GrammarSequence, stop_token_ids, unpack_token_bitmask
from .json_tags import token_tags
from .tags import StructuralTag

__all__ = ["JsonSchemaAdapter", "JsonSchemaSequence", "tokenizer_data"]

_INTEGRATION = "lmformatenforcer.integrations.transformers"
_LEGACY_MODULE = "transformers.tokenization_utils"
# Characters of a token are decoded from at most this many trailing tokens of the current word: a UTF-8 character
# spans at most 4 byte-level tokens, so the decoded difference equals lm-format-enforcer's full-word decoding.
_DECODE_WINDOW = 8

_TOKENIZER_DATA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _transformers_integration() -> ModuleType:
    """Import lm-format-enforcer's transformers integration under transformers 5 (see the module docstring)."""
    if _INTEGRATION in sys.modules:
        return sys.modules[_INTEGRATION]
    base = importlib.import_module("transformers.tokenization_utils_base")
    saved = sys.modules.get(_LEGACY_MODULE)
    sys.modules[_LEGACY_MODULE] = base
    try:
        return importlib.import_module(_INTEGRATION)
    finally:
        if saved is None:
            del sys.modules[_LEGACY_MODULE]
        else:
            sys.modules[_LEGACY_MODULE] = saved


def tokenizer_data(tokenizer: PreTrainedTokenizerBase, stop_token_ids: Iterable[int]) -> TokenEnforcerTokenizerData:
    """lm-format-enforcer's per-tokenizer tables (a decoded string and prefix tree of every regular token; ~3 s
    for Qwen's 152k vocabulary), built once per tokenizer object and cached, with ``stop_token_ids`` as its
    end-of-output tokens.

    The tables use lm-format-enforcer's bitmask token lists (one int32 word per 32 tokens).
    """
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise TypeError(f"tokenizer must be a transformers tokenizer, got {type(tokenizer).__name__}")
    stops = sorted(set(stop_token_ids))
    if tokenizer not in _TOKENIZER_DATA:
        _TOKENIZER_DATA[tokenizer] = _transformers_integration().build_token_enforcer_tokenizer_data(
            tokenizer, use_bitmask=True
        )
    data = copy.copy(_TOKENIZER_DATA[tokenizer])  # shares the tables; only the stop tokens differ
    data.eos_token_id = stops
    return data


class JsonSchemaAdapter(GrammarAdapter):
    """Function-calling JSON under a JSON schema, enforced by lm-format-enforcer (family ``"function_calling"``).

    One ``TokenEnforcer`` serves all sequences: it caches a parser state per distinct generated-token prefix, so
    identical prefixes (batch rows, rewinds) share work. :meth:`reset` forgets that cache.

    Args:
        tokenizer: the model's tokenizer.
        schema: a JSON schema (e.g. :func:`~hf_structkv.structure.function_calls.function_call_schema`).
        eos_token_id: stop token id(s); default ``tokenizer.eos_token_id``.
    """

    family = "function_calling"

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        schema: Mapping[str, Any],
        eos_token_id: int | Iterable[int] | None = None,
    ):
        if not isinstance(schema, Mapping):
            raise TypeError(f"schema must be a dict (a JSON schema), got {type(schema).__name__}")
        self._stops = stop_token_ids(tokenizer, eos_token_id)
        self._data = tokenizer_data(tokenizer, self._stops)
        self._schema = dict(schema)
        try:
            JsonSchemaParser(self._schema)
        except Exception as err:
            raise ValueError(f"lm-format-enforcer cannot parse schema: {err}") from err
        self.reset()

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self._stops

    def reset(self) -> None:
        """Start a fresh enforcer (drops the per-prefix states of earlier generate calls)."""
        self._enforcer = TokenEnforcer(self._data, JsonSchemaParser(self._schema))

    def new_sequence(self) -> JsonSchemaSequence:
        return JsonSchemaSequence(self._enforcer, self._data)


class JsonSchemaSequence(GrammarSequence):
    """Parser state of one sequence under a :class:`JsonSchemaAdapter`.

    Keeps the lm-format-enforcer parser after every token (they are immutable), so :meth:`rollback` is a
    truncation. The parser is advanced here character by character, exactly as the enforcer advances its own copy,
    to split a token into its character transitions.
    """

    def __init__(self, enforcer: TokenEnforcer, data: TokenEnforcerTokenizerData):
        self._enforcer = enforcer
        self._data = data
        self._tokens: list[int] = []
        self._parsers: list[CharacterLevelParser] = [enforcer.root_parser]
        self._word_starts: list[int] = [0]  # index in _tokens where the current word began, per state

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def allowed_token_mask(self, vocab_size: int) -> torch.Tensor:
        """The enforcer's allowed tokens after the tokens so far, as a bool tensor ``[vocab_size]``."""
        return unpack_token_bitmask(self._enforcer_allowed().allowed_tokens, vocab_size)  # int32 [ceil(V_lmfe / 32)]

    def _enforcer_allowed(self):
        """``TokenEnforcer.get_allowed_tokens`` for the tokens so far. The enforcer derives a prefix's state from
        the prefix one token shorter, or treats it as a prompt if that one is unknown, so missing prefixes are
        requested in order first."""
        known = len(self._tokens)
        while known > 0 and tuple(self._tokens[:known]) not in self._enforcer.prefix_states:
            known -= 1
        for length in range(known, len(self._tokens)):
            self._enforcer.get_allowed_tokens(self._tokens[:length])
        return self._enforcer.get_allowed_tokens(self._tokens)

    def advance(self, token_id: int) -> tuple[StructuralTag, ...]:
        characters, word_start = self._characters(token_id)
        parser, tags = token_tags(self._parsers[-1], characters)
        self._tokens.append(token_id)
        self._parsers.append(parser)
        self._word_starts.append(word_start)
        return tags

    def _characters(self, token_id: int) -> tuple[str, int]:
        """The characters ``token_id`` adds and where its word starts, as the enforcer computes them: a new-word
        token adds its own string; another token adds what decoding the word with it adds to decoding the word
        without it (so byte-level pieces of one character add nothing until the character is complete)."""
        tree = self._data.tokenizer_tree
        if token_id in tree.new_word_tokens:
            return tree.tokens_to_strs[token_id], len(self._tokens)
        word_start = self._word_starts[-1]
        window = self._tokens[max(word_start, len(self._tokens) - _DECODE_WINDOW + 1) :]
        before = self._data.decoder(window)
        after = self._data.decoder([*window, token_id])
        return after[len(before) :], word_start

    def rollback(self, num_tokens: int) -> None:
        check_int("num_tokens", num_tokens, 0, len(self._tokens), counts="tokens accepted")
        keep = len(self._tokens) - num_tokens
        del self._tokens[keep:]
        del self._parsers[keep + 1 :]
        del self._word_starts[keep + 1 :]

    def is_complete(self) -> bool:
        return self._parsers[-1].can_end()
