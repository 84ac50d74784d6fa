"""Cache layers of a `CompactedCache`.

Both layers hold an immutable *context* part (shared by every batch row and every copy of the cache) and a mutable
*appended* part (question and generated tokens, ``[B, H_kv, n, D]`` like ``DynamicLayer``). ``reset()`` drops the
appended part and leaves the context as it was loaded.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, NamedTuple

import torch
from transformers.cache_utils import CacheLayerMixin

from ..attention.compacted_inputs import CompactedPrefix, QuantizedHeads, QuantizedPrefix
from ..attention.kwargs import PREFIX_KWARG
from ..persistence import check_same_model, config_fingerprint


class Int4Head(NamedTuple):
    """One KV head's kept entries in INT4, as ``compact_head(..., storage="int4")`` stores them (``L`` entries).

    Attributes:
        key_codes: ``[L, ceil(D / 2)]`` uint8 packed key codes.
        key_scales: ``[ceil(L / key_group), D]`` fp16 per-channel key scales (one row when ``key_group`` is None).
        key_offsets: fp16 per-channel key offsets, shaped as ``key_scales``.
        value_codes: ``[L, ceil(D_v / 2)]`` uint8 packed value codes.
        value_scales: ``[L, 1]`` fp16 per-row value scales.
    """

    key_codes: torch.Tensor
    key_scales: torch.Tensor
    key_offsets: torch.Tensor
    value_codes: torch.Tensor
    value_scales: torch.Tensor


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class ContextLayer(CacheLayerMixin):
    """Shared mechanics of a layer holding an immutable context and appended tokens.

    Appended storage: ``keys`` / ``values`` ``[B, H_kv, n, D]`` (question and generated tokens, batch rows of their
    own). ``get_seq_length()`` is logical: ``original_length + n``. Subclasses say how the context is served.
    """

    is_croppable = True
    supports_early_init = False

    def __init__(self, original_length: int, num_kv_heads: int, device: torch.device):
        super().__init__()
        self.original_length = int(original_length)
        self.num_kv_heads = int(num_kv_heads)
        self.device = device
        self.expected_model: tuple[dict[str, Any] | None, int] = (None, 0)
        self._checked_config: Any = None

    def head_dim(self) -> int:
        """The key width ``D`` of the stored context."""
        return self.context_tensors()[0].shape[-1]

    def appended_length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        for field, got, held in (
            ("num_key_value_heads", key_states.shape[1], self.num_kv_heads),
            ("head_dim", key_states.shape[-1], self.head_dim()),
        ):
            if got != held:
                raise ValueError(
                    f"this cache was built for another model: {field} is {held} in the cache but {got} in the "
                    "given model"
                )
        self.keys = key_states[..., :0, :]
        self.values = value_states[..., :0, :]
        self.is_initialized = True

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Append ``[B, H_kv, q, D]`` states after the tokens already appended."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)

    def get_seq_length(self) -> int:
        return self.original_length + self.appended_length()

    def check_served_by(self, module: torch.nn.Module) -> None:
        """Raise ``ValueError`` unless the model of the attention ``module`` (its ``config``) is the one this layer's
        cache was built for: its fingerprint's structure (``expected_model[0]``, when recorded: the message of
        ``CompactedCache.from_pretrained(..., model=)``), its layer count (``expected_model[1]``), this layer's KV
        heads and head dim. Checked once per model config."""
        config = getattr(module, "config", None)
        if config is None or config is self._checked_config:
            return
        current = config_fingerprint(config)
        fingerprint, num_layers = self.expected_model
        if fingerprint is not None:
            check_same_model(fingerprint, current)
        for field, held in (
            ("num_hidden_layers", num_layers),
            ("num_key_value_heads", self.num_kv_heads),
            ("head_dim", self.head_dim()),
        ):
            if current[field] != held:
                raise ValueError(
                    f"this cache was built for another model: {field} is {held} in the cache but {current[field]} "
                    f"in the given model ({current['model_type']})"
                )
        self._checked_config = config

    def get_max_length(self) -> int:
        return -1

    def appended_nbytes(self) -> int:
        return 0 if self.keys is None else _nbytes([self.keys, self.values])

    @abstractmethod
    def context_tensors(self) -> list[torch.Tensor]:
        """Everything stored for the context (what ``save_pretrained`` writes)."""

    @abstractmethod
    def full_nbytes(self) -> int:
        """Bytes of the same tokens in a plain ``DynamicCache``."""

    @abstractmethod
    def fresh_copy(self) -> ContextLayer:
        """A layer sharing this layer's context tensors, with nothing appended."""

    def nbytes(self) -> int:
        """Bytes of the stored context tensors and of the appended tokens."""
        return _nbytes(self.context_tensors()) + self.appended_nbytes()

    def overhead_nbytes(self) -> int:
        """Bytes stored beyond keys and values (none unless a subclass stores more)."""
        return 0

    def reset(self) -> None:
        """Drop the appended tokens; the context stays."""
        self.keys = self.values = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` appended tokens (negative int, as ``DynamicLayer``) or crop to a
        logical length (non-negative int) that is not shorter than the context."""
        target = self.get_seq_length() + tokens_to_remove if tokens_to_remove < 0 else tokens_to_remove
        if target < self.original_length:
            raise ValueError(
                f"cannot crop to {target} tokens: the compacted context of {self.original_length} tokens cannot be cut"
            )
        if self.keys is not None:
            keep = target - self.original_length
            self.keys = self.keys[..., :keep, :]
            self.values = self.values[..., :keep, :]

    def _apply_to_appended(self, fn) -> None:
        if self.appended_length() > 0:
            self.keys, self.values = fn(self.keys), fn(self.values)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply_to_appended(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply_to_appended(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply_to_appended(lambda t: t[indices, ...])


class CompactedLayer(ContextLayer):
    """A global-attention layer whose context is compacted per KV head, stored ragged (no padding).

    Context storage (never modified by generation):
        prefix_keys: ``[N, D]`` kept post-RoPE keys, KV head ``h`` in rows ``prefix_offsets[h]:prefix_offsets[h+1]``.
        prefix_values: ``[N, D_v]`` kept (possibly refit) values, same layout.
        prefix_bias: ``[N]`` FP32 per-entry logit bias (log multiplier).
        prefix_offsets: ``[H_kv + 1]`` int64 row offsets.
        quantized: the KV heads stored in INT4 (`QuantizedHeads`: packed codes, FP16 key scales and offsets, FP16
            value scales, ragged, no padding), or None. With it, ``prefix_keys`` / ``prefix_values`` hold only the
            other heads' rows (at ``quantized.row_starts``), ``prefix_bias`` and ``prefix_offsets`` every head's;
            the torch attention paths dequantise the INT4 heads head by head on every forward (`served_prefix`), the
            Triton kernel reads their codes and scales in registers; nothing dequantised is kept.

    The attention mask spans only the appended tokens (``kv_offset`` = original length); the prefix reaches the
    attention function through the attention kwargs and is fully visible to every query.
    """

    is_sliding = False

    def __init__(
        self,
        prefix_keys: torch.Tensor,
        prefix_values: torch.Tensor,
        prefix_bias: torch.Tensor,
        prefix_offsets: torch.Tensor,
        original_length: int,
        quantized: QuantizedHeads | None = None,
    ):
        super().__init__(original_length, prefix_offsets.numel() - 1, prefix_keys.device)
        self.prefix_keys = prefix_keys
        self.prefix_values = prefix_values
        self.prefix_bias = prefix_bias
        self.prefix_offsets = prefix_offsets
        self.quantized = quantized
        self._offsets_list = [int(x) for x in prefix_offsets.tolist()]
        self.awaiting_attention = False

    def head_lengths(self) -> list[int]:
        """Number of kept context entries of each KV head."""
        return [b - a for a, b in zip(self._offsets_list[:-1], self._offsets_list[1:])]

    def head_storage(self) -> list[str]:
        """How each KV head is stored: ``"int4"`` or ``"bf16"`` (the cache's dtype, whatever it is)."""
        int4_heads = self.quantized.int4_heads if self.quantized is not None else (False,) * self.num_kv_heads
        return ["int4" if is_int4 else "bf16" for is_int4 in int4_heads]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, kwargs: dict | None = None, **_):
        """Append ``key_states`` / ``value_states`` ``[B, H_kv, q, D]`` (bias 0) and hand the prefix to attention.

        Puts this layer into ``kwargs[PREFIX_KWARG]`` (the dict that the model later splats into its attention
        function) and marks it as awaiting attention until the registered attention function reads the prefix.

        Returns:
            The appended keys and values ``[B, H_kv, n, D]`` (the prefix is served through the kwargs).
        """
        if kwargs is None:
            raise RuntimeError(
                "this model's attention calls cache.update(...) without its attention kwargs, so a compacted prefix "
                "cannot reach the attention function; CompactedCache supports models whose attention passes "
                "`kwargs=kwargs` to the cache (Llama, Qwen2/3, Mistral, Gemma3, ...)"
            )
        self.append(key_states, value_states)
        kwargs[PREFIX_KWARG] = self
        self.awaiting_attention = True
        return self.keys, self.values

    def served_prefix(self, module: torch.nn.Module) -> CompactedPrefix:
        """Called by the attention function of ``module`` (the one place attention reads the prefix): the stored
        prefix as a `CompactedPrefix` (INT4 heads as codes and scales, dequantised by its ``head``), after checking
        that ``module``'s model is the one the cache was built for (`check_served_by`)."""
        self.awaiting_attention = False
        self.check_served_by(module)
        stored = (self.prefix_keys, self.prefix_values, self.prefix_bias, self._offsets_list)
        return CompactedPrefix(*stored) if self.quantized is None else QuantizedPrefix(*stored, self.quantized)

    def read_prefix(self, module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """`served_prefix` as plain ``(keys [N, D], values [N, D_v], bias [N], offsets)``: the stored tensors; for a
        layer with INT4 heads, keys and values dequantised (float32) for this call only."""
        prefix = self.served_prefix(module)
        if prefix.quantized is not None:
            prefix = prefix.dense(torch.float32)
        return prefix.keys, prefix.values, prefix.bias, prefix.offsets

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The mask covers the appended tokens only; their logical positions start at the original length.
        return self.appended_length() + query_length, self.original_length

    def context_tensors(self) -> list[torch.Tensor]:
        """Keys, values, biases and offsets of the compacted context, then (with INT4 heads) key codes, key scales,
        key offsets, value codes and value scales."""
        quantized = [] if self.quantized is None else self.quantized.tensors()
        return [self.prefix_keys, self.prefix_values, self.prefix_bias, self.prefix_offsets, *quantized]

    def full_nbytes(self) -> int:
        """Bytes of the same tokens in a plain ``DynamicLayer`` (original context at batch 1, plus appended)."""
        per_token = self.num_kv_heads * (self.prefix_keys.shape[-1] + self.prefix_values.shape[-1])
        return self.original_length * per_token * self.prefix_keys.element_size() + self.appended_nbytes()

    def overhead_nbytes(self) -> int:
        """Bytes stored beyond the kept keys and values (or their codes): biases, offsets and INT4 scales / key
        offsets."""
        scales = [] if self.quantized is None else self.quantized.tensors()[1:3] + self.quantized.tensors()[4:]
        return _nbytes([self.prefix_bias, self.prefix_offsets, *scales])

    def fresh_copy(self) -> CompactedLayer:
        """A layer sharing this layer's context tensors, with nothing appended."""
        return CompactedLayer(
            self.prefix_keys,
            self.prefix_values,
            self.prefix_bias,
            self.prefix_offsets,
            self.original_length,
            self.quantized,
        )

    def reset(self) -> None:
        super().reset()
        self.awaiting_attention = False

    def offload(self):
        super().offload()
        self._move_context("cpu")

    def prefetch(self):
        super().prefetch()
        if self.prefix_keys.device != self.device:
            self._move_context(self.device)

    def _move_context(self, device: torch.device | str) -> None:
        self.prefix_keys, self.prefix_values, self.prefix_bias = (
            t.to(device, non_blocking=True) for t in (self.prefix_keys, self.prefix_values, self.prefix_bias)
        )
        if self.quantized is not None:
            moved = [t.to(device, non_blocking=True) for t in self.quantized.tensors()]
            self.quantized = self.quantized._replace(**dict(zip(self.quantized._fields, moved)))


class SharedContextSlidingLayer(ContextLayer):
    """A sliding-window layer (e.g. Gemma3's local layers): not compacted, sliding attention as usual.

    Context storage: the last ``min(T, sliding_window - 1)`` context tokens, ``window_keys`` / ``window_values``
    ``[1, H_kv, w, D]``, shared by every batch row. Appended tokens are kept whole (like the global layers' appended
    tokens) rather than trimmed to the window, so that a left-padded batch sees, per row, exactly the tokens it would
    see alone; the window itself is applied by the mask (position-aware, see ``attention.masks``).
    """

    is_sliding = True

    def __init__(
        self, sliding_window: int, window_keys: torch.Tensor, window_values: torch.Tensor, original_length: int
    ):
        super().__init__(original_length, window_keys.shape[1], window_keys.device)
        self.sliding_window = int(sliding_window)
        self.window_keys = window_keys
        self.window_values = window_values

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append ``[B, H_kv, q, D]`` states; returns the window followed by every appended token, batch ``B``."""
        self.append(key_states, value_states)
        batch = self.keys.shape[0]
        window_keys = self.window_keys.expand(batch, -1, -1, -1)
        window_values = self.window_values.expand(batch, -1, -1, -1)
        return torch.cat([window_keys, self.keys], dim=-2), torch.cat([window_values, self.values], dim=-2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        window = self.window_keys.shape[-2]
        return window + self.appended_length() + query_length, self.original_length - window

    def context_tensors(self) -> list[torch.Tensor]:
        """The context window."""
        return [self.window_keys, self.window_values]

    def full_nbytes(self) -> int:
        """A plain ``DynamicCache`` holds the same window for this layer."""
        return self.nbytes()

    def fresh_copy(self) -> SharedContextSlidingLayer:
        return SharedContextSlidingLayer(
            self.sliding_window, self.window_keys, self.window_values, self.original_length
        )
