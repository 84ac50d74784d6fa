"""A context as token ids with its document boundaries, and its split into compaction chunks.

A context is one text, a list of texts (documents), token ids ``[1, T]`` or a list of such tensors. Chunks are
compacted one at a time (`hf_structkv.compaction.compact`, ``chunk_tokens=``): `chunk_spans` packs consecutive whole
documents into chunks of at most ``chunk_tokens`` tokens, so a chunk boundary always falls on a document boundary
(the KV-Surgeon seed's packing of files into chunks of at most 10,000 tokens); only a document longer than
``chunk_tokens`` is cut, into the fewest near-equal pieces that fit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from transformers import PreTrainedTokenizerBase

from ..validation import check_int, is_int

Context = str | torch.Tensor | Sequence[str] | Sequence[torch.Tensor]


def _document_ids(tokenizer: PreTrainedTokenizerBase | None, document: str | torch.Tensor, where: str) -> torch.Tensor:
    """One document as ids ``[1, T_i]``: a text tokenized as is (no special tokens), or a ``[1, T_i]`` tensor."""
    if isinstance(document, str):
        if tokenizer is None:
            raise ValueError("a text context needs its tokenizer; pass tokenizer= or token ids [1, T]")
        document = tokenizer(document, return_tensors="pt", add_special_tokens=False).input_ids
    if not isinstance(document, torch.Tensor) or document.dim() != 2 or document.shape[0] != 1:
        raise ValueError(f"{where} must be a non-empty text or a [1, T] tensor of token ids")
    if document.shape[1] == 0:
        raise ValueError(f"{where} must be a non-empty text or a [1, T] tensor of token ids (it is empty)")
    if document.dtype not in (torch.int64, torch.int32) or int(document.min()) < 0:
        raise ValueError(
            f"{where} must hold token ids: integers >= 0 (int64 or int32), got dtype {document.dtype} with smallest "
            f"entry {document.min().item()}"
        )
    return document


def context_documents(
    tokenizer: PreTrainedTokenizerBase | None, context: Context, name: str = "context"
) -> tuple[torch.Tensor, list[int]]:
    """The context's ids ``[1, T]`` and its document lengths (summing to ``T``).

    A text or a ``[1, T]`` tensor is one document; a list holds several, each tokenized on its own (as is, no
    special tokens) and concatenated in order. ``name`` is the argument's name in error messages.
    """
    if isinstance(context, (str, torch.Tensor)):
        ids = _document_ids(tokenizer, context, name)
        return ids, [ids.shape[1]]
    if not isinstance(context, Sequence) or len(context) == 0:
        raise ValueError(
            f"{name} must be a non-empty text, a [1, T] tensor of token ids, or a non-empty list of documents "
            f"(texts or [1, T] tensors), got {type(context).__name__}"
        )
    documents = [_document_ids(tokenizer, doc, f"{name}[{i}]") for i, doc in enumerate(context)]
    return torch.cat(documents, dim=1), [doc.shape[1] for doc in documents]


def chunk_spans(document_lengths: Sequence[int], chunk_tokens: int | None) -> list[tuple[int, int]]:
    """``[start, end)`` token spans of the chunks, in order, covering ``[0, sum(document_lengths))``.

    ``chunk_tokens=None`` gives one chunk. Otherwise consecutive documents are packed greedily while the chunk holds
    at most ``chunk_tokens`` tokens; a document longer than ``chunk_tokens`` is a run of
    ``ceil(length / chunk_tokens)`` chunks of near-equal length (the first ones one token longer) of its own.
    """
    if any(not is_int(n) or n < 1 for n in document_lengths) or not document_lengths:
        raise ValueError(f"document_lengths must be positive ints, got {list(document_lengths)!r}")
    total = sum(document_lengths)
    if chunk_tokens is None:
        return [(0, total)]
    check_int("chunk_tokens", chunk_tokens, 1, counts="tokens per chunk", none_ok=True)
    spans: list[tuple[int, int]] = []
    chunk_start = position = 0
    for length in document_lengths:
        if position + length - chunk_start > chunk_tokens and position > chunk_start:
            spans.append((chunk_start, position))
            chunk_start = position
        if length > chunk_tokens:
            pieces = math.ceil(length / chunk_tokens)
            sizes = [length // pieces + (i < length % pieces) for i in range(pieces)]
            for size in sizes:
                spans.append((position, position + size))
                position += size
            chunk_start = position
        else:
            position += length
    if position > chunk_start:
        spans.append((chunk_start, position))
    return spans
