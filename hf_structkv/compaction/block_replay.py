"""On-policy calibration queries without a forward per layer: the model's decoder blocks replayed one at a time.

On-policy calibration fits layer ``l`` to the queries it receives when the layers before it are already compacted.
Re-running the model for every layer costs about ``L / 2`` forwards per conversation even when each forward stops
after layer ``l``. But the input of block ``l`` depends only on the blocks before it, and they do not change once
compacted: `BlockReplay` keeps a conversation's hidden states between blocks. One recorded forward (or one per
piece of a long conversation) gives every block's call arguments (forward pre-hooks); `BlockReplay.queries(l, cache)`
then runs the blocks not yet run on the kept hidden states (each with the cache as it is now, so with its compacted
layers) and block ``l`` up to its attention, where the queries are recorded. Every block runs about twice in all:
roughly two and a half forwards per conversation instead of ``L / 2``.

The replay calls the model's own blocks with the arguments the model's own forward gave them, with only the cache
swapped (a fresh copy of the context cache for each block, continued by its pieces in order). It relies on the
forward handing each block's output to the next block unchanged; `BlockReplay.build` checks that link on the
recorded forward (block 0's replayed output must equal block 1's recorded input, bit for bit, piece by piece) and
returns ``None`` where it does not hold, so the caller can fall back to a forward per layer.
"""

from __future__ import annotations

import torch
from transformers import Cache, PreTrainedModel

from ..attention.modules import attention_modules
from ..attention.recording import recording
from ..generation import context_copy
from .queries import Conversation, Piece, answer_pieces, join_pieces

__all__ = ["BlockReplay", "decoder_blocks"]


def decoder_blocks(model: PreTrainedModel) -> torch.nn.ModuleList | None:
    """The model's decoder blocks in order: the module list whose ``i``-th block holds attention layer ``i`` (an
    attention module with ``layer_idx == i``); ``None`` if there is no such list."""
    n_layers = model.config.get_text_config().num_hidden_layers
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n_layers:
            if all(next(iter(attention_modules(block)), None) == i for i, block in enumerate(module)):
                return module
    return None


def _output(result) -> torch.Tensor:
    """A block's hidden-state output (blocks return a tensor, older ones a tuple starting with it)."""
    return result[0] if isinstance(result, tuple) else result


class _Call:
    """One block's recorded call: positional and keyword arguments with the hidden states and the cache taken out."""

    def __init__(self, args: tuple, kwargs: dict, cache: Cache):
        self.hidden_in_args = bool(args)
        self.args = args[1:] if args else ()
        self.kwargs = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        self.cache_keys = [k for k, v in self.kwargs.items() if v is cache]
        if not self.cache_keys:
            raise ValueError("the block call did not receive the forward's cache as a keyword argument")

    def __call__(self, block: torch.nn.Module, hidden: torch.Tensor, cache: Cache) -> torch.Tensor:
        kwargs = {**self.kwargs, **dict.fromkeys(self.cache_keys, cache)}
        if self.hidden_in_args:
            return _output(block(hidden, *self.args, **kwargs))
        return _output(block(*self.args, hidden_states=hidden, **kwargs))


class BlockReplay:
    """One conversation after a context, replayed block by block for on-policy query capture.

    The conversation runs in pieces (`answer_pieces`; one piece unless ``chunk_tokens`` is given), each block call
    recorded per piece. State: per piece, the hidden states entering block `next_block` (``[1, n_i, d]``). Only
    `queries` changes it (it runs the blocks before the requested layer); layers must be asked in increasing order.
    """

    def __init__(self, model, blocks, calls: list[list[_Call]], hidden: list[torch.Tensor], pieces: list[Piece]):
        self._model, self._blocks, self._calls = model, blocks, calls
        self._hidden, self._pieces = hidden, pieces
        self.next_block = 0

    @classmethod
    def build(
        cls, model: PreTrainedModel, conversation: Conversation, context_cache, chunk_tokens: int | None = None
    ) -> BlockReplay | None:
        """Record one forward of ``conversation`` after ``context_cache`` (a cache holding exactly the context; a
        copy is continued, the given cache is left as it is), or one forward per piece of at most ``chunk_tokens``
        tokens (bounded attention memory for long conversations).

        Returns:
            the replay, positioned before block 0; ``None`` when the model has no recognisable decoder-block list, a
            block is not called with the forward's cache as a keyword argument, or block 0's replayed output is not
            block 1's recorded input.
        """
        blocks = decoder_blocks(model)
        if blocks is None or len(blocks) < 2:
            return None
        turn = torch.cat([conversation.prompt_ids, conversation.answer_ids])[None].to(model.device)
        pieces = answer_pieces(turn.shape[1], conversation.prompt_ids.numel(), chunk_tokens)
        cache = context_copy(context_cache)
        seen: list[tuple[tuple, dict]] = []
        hooks = [
            block.register_forward_pre_hook(lambda _m, args, kwargs: seen.append((args, kwargs)), with_kwargs=True)
            for block in blocks
        ]
        try:
            with torch.no_grad():
                for piece in pieces:
                    model(turn[:, piece.start : piece.end], cache=cache, use_cache=True, logits_to_keep=1)
        finally:
            for hook in hooks:
                hook.remove()
        if len(seen) != len(blocks) * len(pieces):
            return None
        n = len(blocks)
        per_piece = [seen[i * n : (i + 1) * n] for i in range(len(pieces))]
        try:
            calls = [[_Call(args, kwargs, cache) for args, kwargs in recorded] for recorded in per_piece]
        except ValueError:
            return None
        # hidden states entering blocks 0 and 1, per piece
        inputs = [
            [args[0] if args else kwargs["hidden_states"] for args, kwargs in recorded[:2]] for recorded in per_piece
        ]
        branch = context_copy(context_cache)
        with torch.no_grad():
            for piece_calls, (first, second) in zip(calls, inputs, strict=True):
                replayed = piece_calls[0](blocks[0], first, branch)
                if replayed.shape != second.shape or not torch.equal(replayed, second):
                    return None
        return cls(model, blocks, calls, [first.detach() for first, _ in inputs], pieces)

    def queries(self, layer_idx: int, context_cache) -> torch.Tensor:
        """Queries of the answer tokens at global layer ``layer_idx`` with the context served by ``context_cache``.

        First runs blocks ``next_block .. layer_idx - 1`` on the kept hidden states (each block with a fresh copy of
        ``context_cache``, so with the layers it has compacted, continued piece after piece), then block
        ``layer_idx`` up to its attention.

        Returns:
            ``[H_kv, g * A, D]`` as `capture_queries` records them (``A`` answer tokens).

        Raises:
            ValueError: ``layer_idx`` is behind the replay (blocks already run) or not a global attention layer.
        """
        if not self.next_block <= layer_idx < len(self._blocks):
            raise ValueError(
                f"layer_idx must be in [{self.next_block}, {len(self._blocks)}): the replay has run blocks "
                f"0 .. {self.next_block - 1} and layers are asked in increasing order"
            )
        with torch.no_grad():
            for index in range(self.next_block, layer_idx):
                branch = context_copy(context_cache)
                for i, piece_calls in enumerate(self._calls):
                    self._hidden[i] = piece_calls[index](self._blocks[index], self._hidden[i], branch)
        self.next_block = layer_idx
        branch, parts = context_copy(context_cache), []
        for i, piece in enumerate(self._pieces):
            with recording(self._model, piece.positions, layers=[layer_idx]) as recorder:
                self._calls[i][layer_idx](self._blocks[layer_idx], self._hidden[i], branch)
            parts.append(recorder.queries)
        return join_pieces(parts, self._pieces)[layer_idx]
