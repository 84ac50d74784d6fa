"""What the two xgrammar adapters share (SQL, `xgrammar_sql`; JSON function calls, `xgrammar_json`): one grammar
compiler per tokenizer, and :class:`MatcherSequence`, a sequence whose masks come from an xgrammar
``GrammarMatcher`` while a subclass tags the characters each token adds.

Token characters are the UTF-8 decoding of xgrammar's own byte strings of the vocabulary
(``TokenizerInfo.decoded_vocab``), so the tagger reads exactly the characters the matcher accepted; the bytes of an
unfinished multi-byte character wait for the token that completes it.
"""

from __future__ import annotations

import weakref
from abc import abstractmethod
from collections import deque

import torch
from transformers import PreTrainedTokenizerBase

from ..validation import check_int
from .adapter import GrammarSequence, unpack_token_bitmask
from .tags import StructuralTag

try:
    import xgrammar
except ModuleNotFoundError as err:  # pragma: no cover - depends on the installation
    raise ImportError('the xgrammar grammar adapters need xgrammar: pip install "xgrammar==0.2.9" (setup.sh)') from err

__all__ = ["MatcherSequence", "new_matcher", "split_utf8", "xgrammar_compiler"]

_COMPILERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def xgrammar_compiler(tokenizer: PreTrainedTokenizerBase) -> tuple[xgrammar.GrammarCompiler, list[bytes]]:
    """One xgrammar compiler (with its tokenizer tables, ~0.5 s for Qwen's vocabulary) per tokenizer object, and the
    byte string of every token id as xgrammar reads it.

    Raises:
        TypeError: ``tokenizer`` is not a transformers tokenizer.
    """
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise TypeError(f"tokenizer must be a transformers tokenizer, got {type(tokenizer).__name__}")
    if tokenizer not in _COMPILERS:
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer)
        _COMPILERS[tokenizer] = (xgrammar.GrammarCompiler(info, max_threads=1), list(info.decoded_vocab))
    return _COMPILERS[tokenizer]


def new_matcher(compiled: xgrammar.CompiledGrammar, stop_token_ids: frozenset[int]) -> xgrammar.GrammarMatcher:
    """A matcher of ``compiled`` that ends on ``stop_token_ids`` and can roll back to its start (``crop()``; xgrammar
    0.2.9 keeps its rollback history itself: its ``max_rollback_tokens`` is deprecated and always unlimited)."""
    return xgrammar.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_token_ids), max_rollback_tokens=-1)


def split_utf8(data: bytes) -> tuple[str, bytes]:
    """The complete UTF-8 characters of ``data`` and the bytes of an unfinished last character."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8"), data[cut:]
        except UnicodeDecodeError:
            continue
    return data.decode("utf-8", errors="replace"), b""


class MatcherSequence(GrammarSequence):
    """One sequence under an xgrammar matcher: masks, acceptance and rollback from the matcher, tags from the
    subclass (:meth:`_tag` gets the characters each accepted token completes, :meth:`_forget` drops the tagger states
    of rolled-back tokens).

    A token the matcher rejects (only possible when something bypassed the mask) is recorded but not given to the
    matcher; from then on only stop tokens are allowed and every tag is empty (unresolved: full protection).
    ``forbidden`` (int64 ``[n]``) are ids the mask never allows, whatever the grammar says (xgrammar reads special
    tokens such as ``<|endoftext|>`` as their literal text). ``max_rollback_tokens`` bounds how far :meth:`rollback`
    reaches, and so what this sequence keeps: its states of the last ``max_rollback_tokens`` tokens only, whatever
    the history (``None``: every token's); the matcher keeps its own history (xgrammar 0.2.9 has no bound).
    """

    def __init__(
        self,
        matcher: xgrammar.GrammarMatcher,
        token_bytes: list[bytes],
        forbidden: torch.Tensor | None = None,
        max_rollback_tokens: int | None = None,
    ):
        self._matcher = matcher
        self._token_bytes = token_bytes
        self._forbidden = forbidden
        self.max_rollback_tokens = max_rollback_tokens
        kept = None if max_rollback_tokens is None else max_rollback_tokens + 1
        self._advanced = 0
        self._accepted: deque[bool] = deque(maxlen=kept)  # per recent token: did the matcher accept it
        self._pending: deque[bytes] = deque(maxlen=kept)  # per recent token: bytes of an unfinished character after it

    @property
    def num_tokens(self) -> int:
        return self._advanced

    def _all_accepted(self) -> bool:
        return not self._accepted or self._accepted[-1]

    def allowed_token_mask(self, vocab_size: int) -> torch.Tensor:
        """xgrammar's allowed tokens after the tokens so far, as a bool tensor ``[vocab_size]``."""
        if not self._all_accepted():
            mask = torch.zeros(vocab_size, dtype=torch.bool)
            mask[[i for i in self._matcher.stop_token_ids if i < vocab_size]] = True
            return mask
        bitmask = xgrammar.allocate_token_bitmask(1, len(self._token_bytes))  # int32 [1, ceil(V_xgr / 32)]
        self._matcher.fill_next_token_bitmask(bitmask)
        mask = unpack_token_bitmask(bitmask[0], vocab_size)
        if self._forbidden is not None:
            mask[self._forbidden[self._forbidden < vocab_size]] = False
        return mask

    def advance(self, token_id: int) -> tuple[StructuralTag, ...]:
        self._advanced += 1
        if not (self._all_accepted() and self._matcher.accept_token(token_id)):
            self._accepted.append(False)
            self._pending.append(b"")
            return self._tag(None)
        text, pending = split_utf8((self._pending[-1] if self._pending else b"") + self._token_bytes[token_id])
        self._accepted.append(True)
        self._pending.append(pending)
        return self._tag(text)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` advances (see `GrammarSequence.rollback`).

        Raises:
            ValueError: ``num_tokens`` is negative, larger than :attr:`num_tokens`, or larger than
                ``max_rollback_tokens`` (name it larger, or ``None``, to crop further back).
        """
        check_int("num_tokens", num_tokens, 0, self._advanced, counts="tokens advanced")
        if self.max_rollback_tokens is not None and num_tokens > self.max_rollback_tokens:
            raise ValueError(
                f"cannot roll back {num_tokens} tokens: this sequence keeps the states of the last "
                f"max_rollback_tokens={self.max_rollback_tokens} only; build the processor with a larger "
                "max_rollback_tokens (None: no limit) to crop further back"
            )
        if num_tokens == 0:
            return
        accepted = 0
        for _ in range(num_tokens):
            accepted += self._accepted.pop()
            self._pending.pop()
        if accepted:
            self._matcher.rollback(accepted)
        self._advanced -= num_tokens
        self._forget(num_tokens)

    def is_complete(self) -> bool:
        return self._all_accepted() and self._matcher.is_completed()

    @abstractmethod
    def _tag(self, text: str | None) -> tuple[StructuralTag, ...]:
        """Record the tagger state after the token just advanced and return its candidate tags; ``text`` is the
        characters it completes, ``None`` for a token the matcher rejected (record an unresolved state, return
        ``()``)."""

    @abstractmethod
    def _forget(self, num_tokens: int) -> None:
        """Drop the tagger states of the last ``num_tokens`` advanced tokens."""
