"""Where ``compact(...)`` gets each layer's calibration queries: the conversations of a tier, and one query source per
way of running them.

The tier (``queries=``) decides what is run after the context: `calibration_conversations` gives, per chunk, the
teacher-forced repetition and, for ``"self_study"``, the conversations the model generates about the chunk. A query
source decides how those conversations are run, with one method, ``layer_queries(layer_idx)``: the fitting and held-out
queries of that global layer, per chunk. Layers are asked in increasing order.

- `CapturedOnce` (``on_policy=False``): every layer's queries from one capture through the full cache.
- `PerLayerForward` (on-policy): for each layer, a forward per conversation through the cache as compacted so far,
  stopped after that layer.
- `BlockReplayQueries` (on-policy, where the model's decoder blocks can be replayed one at a time): the same queries
  from `BlockReplay`, about two and a half forwards per conversation in all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Protocol

import torch
from tqdm.auto import tqdm
from transformers import Cache, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from .block_replay import BlockReplay
from .queries import Conversation, conversation_queries, repetition_conversation
from .self_study import self_study_conversations
from .settings import CompactionSettings

__all__ = [
    "BlockReplayQueries",
    "CapturedOnce",
    "ConversationRuns",
    "PerLayerForward",
    "QuerySource",
    "calibration_conversations",
    "query_source",
]

ServedCache = Callable[[], Cache]
"""Returns a cache holding the context as compacted so far (earlier layers compacted, later ones whole)."""


def calibration_conversations(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    context_ids: torch.Tensor,
    spans: list[tuple[int, int]],
    settings: CompactionSettings,
    full_cache: Cache,
) -> list[list[Conversation]]:
    """Per chunk ``spans`` of ``context_ids [1, T]``: its teacher-forced repetition and, for the ``"self_study"``
    tier, its generated conversations (`settings.self_study`; generated once, on the ``full_cache``, with seed
    ``settings.seed + chunk index``; with several chunks each prompt quotes its chunk)."""
    conversations = []
    self_study = settings.queries == "self_study"
    bar = tqdm(spans, desc="calibration conversations", disable=not settings.progress or not self_study)
    for index, (start, end) in enumerate(bar):
        chunk_ids = context_ids[:, start:end]
        chunk = [repetition_conversation(tokenizer, chunk_ids)]
        if self_study:
            excerpt = chunk_ids if len(spans) > 1 else None
            seed = settings.seed + index
            chunk += self_study_conversations(model, tokenizer, full_cache, settings.self_study, seed, excerpt)
        conversations.append(chunk)
    return conversations


class QuerySource(Protocol):
    """A layer's calibration queries, per chunk."""

    capture: ClassVar[str | None]
    """How on-policy queries are captured (``"forward per layer"``, ``"block replay"``), None off-policy."""

    def layer_queries(self, layer_idx: int) -> list[torch.Tensor]:
        """The queries of global layer ``layer_idx``, one ``[H_kv, N_c, D]`` tensor per chunk ``c``."""


class ConversationRuns:
    """Each chunk's conversations, teacher-forced after a cache holding the context, in pieces of ``piece_tokens``."""

    def __init__(
        self,
        model: PreTrainedModel,
        context_ids: torch.Tensor,
        conversations: list[list[Conversation]],
        piece_tokens: int | None,
    ):
        self.model, self.context_ids, self.conversations = model, context_ids, conversations
        self.piece_tokens = piece_tokens

    def queries(self, context_cache: Cache, layers: list[int] | None) -> list[dict[int, torch.Tensor]]:
        """Per chunk, ``{layer_idx: [H_kv, N_c, D]}`` for ``layers`` (None: every global layer), each conversation
        continuing a copy of ``context_cache`` (`conversation_queries`)."""
        return [
            conversation_queries(self.model, self.context_ids, chunk, context_cache, layers, self.piece_tokens)
            for chunk in self.conversations
        ]


class CapturedOnce:
    """Off-policy: every layer's queries from one capture of the conversations through the full cache, taken when
    the first layer is asked.

    The plain prefilled cache serves the context through stock SDPA (nothing is compacted yet; an all-kept
    `CompactedCache` would copy every kept key beside the appended ones at each call).
    """

    capture: ClassVar[str | None] = None

    def __init__(self, runs: ConversationRuns, cache: DynamicCache):
        self._runs, self._cache = runs, cache
        self._captured: list[dict[int, torch.Tensor]] | None = None

    def layer_queries(self, layer_idx: int) -> list[torch.Tensor]:
        if self._captured is None:
            self._captured = self._runs.queries(self._cache, None)
        return [captured[layer_idx] for captured in self._captured]


class PerLayerForward:
    """On-policy, one forward per layer, conversation and chunk: each conversation run after the cache as compacted
    so far (``served()``), stopped after the layer asked."""

    capture: ClassVar[str | None] = "forward per layer"

    def __init__(self, runs: ConversationRuns, served: ServedCache):
        self._runs, self._served = runs, served

    def layer_queries(self, layer_idx: int) -> list[torch.Tensor]:
        return [captured[layer_idx] for captured in self._runs.queries(self._served(), [layer_idx])]


class BlockReplayQueries:
    """On-policy by replaying the decoder blocks (`BlockReplay`): one replay per conversation with an answer, each
    advanced to the layer asked through the cache as compacted so far (``served()``)."""

    capture: ClassVar[str | None] = "block replay"

    def __init__(self, replays: list[list[BlockReplay]], served: ServedCache):
        self._replays, self._served = replays, served

    @classmethod
    def build(
        cls,
        model: PreTrainedModel,
        conversations: list[list[Conversation]],
        served: ServedCache,
        piece_tokens: int | None,
    ) -> BlockReplayQueries | None:
        """Record each chunk's conversations with an answer (each run in pieces of ``piece_tokens``) after
        ``served()``; ``None`` as soon as a chunk has a conversation whose blocks cannot be replayed."""
        context_cache, replays = served(), []
        for chunk in conversations:
            chunk_replays = [
                BlockReplay.build(model, c, context_cache, piece_tokens) for c in chunk if c.answer_ids.numel() > 0
            ]
            if not chunk_replays or any(replay is None for replay in chunk_replays):
                return None
            replays.append(chunk_replays)
        return cls(replays, served)

    def layer_queries(self, layer_idx: int) -> list[torch.Tensor]:
        context_cache = self._served()
        return [
            torch.cat([replay.queries(layer_idx, context_cache) for replay in chunk], dim=1) for chunk in self._replays
        ]


def query_source(
    runs: ConversationRuns, cache: DynamicCache, served: ServedCache, settings: CompactionSettings
) -> QuerySource:
    """The source ``compact`` uses: `CapturedOnce` off-policy (from the prefilled ``cache``); on-policy
    `BlockReplayQueries` where ``settings.block_replay`` asks for it and the model's blocks can be replayed, else
    `PerLayerForward`."""
    if not settings.on_policy:
        return CapturedOnce(runs, cache)
    if settings.block_replay:
        replayed = BlockReplayQueries.build(runs.model, runs.conversations, served, runs.piece_tokens)
        if replayed is not None:
            return replayed
    return PerLayerForward(runs, served)
