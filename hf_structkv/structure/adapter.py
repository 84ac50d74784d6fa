"""Grammar-adapter interface: what the tagging logits processor needs from a constrained-decoding engine.

PASK Appendix A: an adapter maps each accepted parser transition ``(s_{t-1}, y_t, s_t)`` to a structural tag with
four fields (class, role, state, next). The processor, the cache and the controller only see this interface, so a
new grammar family (e.g. an xgrammar SQL adapter, family ``"sql"``) is one new pair of classes.

Nothing here assumes JSON: an adapter is a factory of per-sequence parser states; a state masks the next token,
accepts tokens one at a time (returning their candidate tags), rewinds, and says whether the output is complete.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from .tags import ROLES, StructuralTag

__all__ = ["GrammarAdapter", "GrammarSequence", "stop_token_ids", "unpack_token_bitmask"]


class GrammarSequence(ABC):
    """The parser state of one generated sequence (the tokens after the prompt), advanced one token at a time."""

    @property
    @abstractmethod
    def num_tokens(self) -> int:
        """Number of tokens advanced so far (after rollbacks)."""

    @abstractmethod
    def allowed_token_mask(self, vocab_size: int) -> torch.Tensor:
        """Which next tokens the grammar allows: bool tensor ``[vocab_size]`` on the CPU (stop tokens included
        exactly when the output may end here). Ids the engine does not know are forbidden."""

    @abstractmethod
    def advance(self, token_id: int) -> tuple[StructuralTag, ...]:
        """Accept a non-stop token; return the candidate tags of the transition before-state -> token ->
        after-state (several when the token spans several parser transitions, deduplicated; an empty tuple when the
        transition cannot be resolved, e.g. a token the grammar forbids, after which every tag is empty)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` advances, restoring the exact earlier parser state.

        Raises:
            ValueError: ``num_tokens`` is negative or larger than :attr:`num_tokens`.
        """

    @abstractmethod
    def is_complete(self) -> bool:
        """True when the tokens so far form a complete output (the grammar may stop here)."""


class GrammarAdapter(ABC):
    """A grammar for one request shape and one tokenizer; creates one :class:`GrammarSequence` per sequence."""

    family: str
    """Tag vocabulary family of the tags it returns: a key of :data:`hf_structkv.structure.tags.ROLES`."""

    @property
    @abstractmethod
    def stop_token_ids(self) -> frozenset[int]:
        """Token ids that end a sequence: never advanced, tagged ``None`` by the processor (no charge)."""

    @abstractmethod
    def new_sequence(self) -> GrammarSequence:
        """A fresh parser state at the start of the output."""

    @abstractmethod
    def reset(self) -> None:
        """Drop whatever the sequences of earlier generate calls left in shared caches (called between calls)."""

    def check_family(self) -> None:
        """Raise ``ValueError`` if :attr:`family` is not a known tag vocabulary."""
        family = getattr(self, "family", None)
        if family not in ROLES:
            raise ValueError(f"{type(self).__name__}.family must be one of {tuple(ROLES)}, got {family!r}")


def stop_token_ids(
    tokenizer: PreTrainedTokenizerBase, eos_token_id: int | Iterable[int] | None = None
) -> frozenset[int]:
    """The stop token ids an adapter ends sequences on: ``eos_token_id`` (an int or ints), default the tokenizer's.

    Raises:
        ValueError: no ``eos_token_id`` given and the tokenizer has none, or ids that are not non-negative ints.
    """
    if eos_token_id is None:
        eos_token_id = tokenizer.eos_token_id
        if eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id; pass eos_token_id=... (an int or a list of ints)")
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"eos_token_id must be a non-negative int or a non-empty list of them, got {eos_token_id!r}")
    return frozenset(ids)


def unpack_token_bitmask(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bool mask ``[vocab_size]`` of an engine's token bitmask ``bits`` (int32 ``[ceil(V / 32)]``, bit ``j`` of
    word ``w`` = token ``32 w + j``: the layout of xgrammar and lm-format-enforcer); ids beyond it are forbidden."""
    words = np.ascontiguousarray(bits.numpy(), dtype="<i4")  # little-endian words: byte k holds tokens 8k .. 8k+7
    mask = torch.from_numpy(np.unpackbits(words.view(np.uint8), bitorder="little")).to(torch.bool)
    if mask.numel() >= vocab_size:
        return mask[:vocab_size]
    return torch.cat([mask, mask.new_zeros(vocab_size - mask.numel())])
