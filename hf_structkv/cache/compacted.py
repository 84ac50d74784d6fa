"""`CompactedCache`: a reusable context's KV cache compacted per KV head, served to unmodified transformers models."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from ..attention.compacted_inputs import QuantizedHeads, key_groups
from ..attention.registry import enable
from ..persistence import SavedArtifact
from ..validation import check_int
from .compacted_checks import BIAS_LIMIT, value_limit
from .compacted_files import CACHE_FILES, check_config_is_a_cache, read_cache_folder, write_cache_folder
from .compacted_layers import CompactedLayer, Int4Head, SharedContextSlidingLayer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class CompactedCache(SavedArtifact, Cache):
    """A transformers ``Cache`` whose global-attention layers hold a compacted context with per-entry logit biases.

    Each global layer is a `CompactedLayer` (ragged per-KV-head keys, values and FP32 biases, no padding); each
    sliding-window layer is a `SharedContextSlidingLayer` (standard sliding behaviour). New tokens are appended with
    bias 0 at their original positions: ``get_seq_length()`` counts the original context length.

    Serving needs the model's attention switched to hf_structkv's (``hf_structkv.enable(model)``; ``load(...,
    model=model)`` does it): a forward through a model that was not enabled raises instead of silently ignoring
    the prefix. Generation only appends; ``copy()`` (cheap, shares the context tensors) or ``reset()`` gives a cache
    ready for the next question.

    Args:
        layers: one layer per model layer.
        metadata: JSON-serialisable description (model fingerprint, method, hyper-parameters, quality); saved
            with the cache.
    """

    def __init__(
        self, layers: Sequence[CompactedLayer | SharedContextSlidingLayer], metadata: dict[str, Any] | None = None
    ):
        if not layers:
            raise ValueError("layers must hold one layer per model layer, got none")
        lengths = {layer.original_length for layer in layers}
        if len(lengths) != 1:
            raise ValueError(f"all layers must describe the same context, got original lengths {sorted(lengths)}")
        if metadata is not None and not isinstance(metadata, dict):
            raise TypeError(f"metadata must be a dict (JSON-serialisable) or None, got {type(metadata).__name__}")
        super().__init__(layers=list(layers))
        self.original_length = lengths.pop()
        self.metadata = dict(metadata or {})
        self._last_updated_layer: int | None = None
        fingerprint = self.metadata.get("fingerprint")
        for layer in self.layers:  # checked by the attention function at the first forward (check_served_by)
            layer.expected_model = (fingerprint if isinstance(fingerprint, dict) else None, len(self.layers))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_selection(
        cls,
        cache: Cache,
        indices: Sequence[Sequence[torch.Tensor] | None],
        biases: Sequence[Sequence[torch.Tensor] | None] | None = None,
        values: Sequence[Sequence[torch.Tensor] | None] | None = None,
        metadata: dict[str, Any] | None = None,
        int4: Sequence[Sequence[Int4Head | None] | None] | None = None,
        key_group: int | None = None,
    ) -> CompactedCache:
        """Build a compacted cache from a prefilled cache of the context and the kept positions of each KV head.

        Args:
            cache: a ``DynamicCache`` prefilled with the context, batch 1 (``DynamicCache(config=model.config)``
                keeps sliding layers sliding).
            indices: ``indices[layer][kv_head]`` 1-D LongTensor of kept positions (distinct, in ``[0, T)``);
                ``None`` for a sliding-window layer (kept as it is).
            biases: optional ``biases[layer][kv_head]`` 1-D float tensor (one log multiplier per kept position;
                default 0).
            values: optional ``values[layer][kv_head]`` ``[t, D_v]`` refit values (default: the original values).
            metadata: stored with the cache (see ``CompactedCache``).
            int4: optional ``int4[layer][kv_head]``: an `Int4Head` (packed codes and FP16 scales, as
                ``compact_head(..., storage="int4")`` returns them) to store that head in INT4, None to store it in
                the cache's dtype; its ``values[layer][kv_head]``, if given, are not stored.
            key_group: kept entries per row of INT4 key scales (None: one row per head), for every INT4 head.
        """
        if not isinstance(cache, Cache):
            raise TypeError(
                f"cache must be a transformers Cache prefilled with the context, got {type(cache).__name__}"
            )
        if not isinstance(indices, Sequence):
            raise TypeError(f"indices must list one entry per layer (None for a sliding-window layer), got {indices!r}")
        check_int("key_group", key_group, 1, counts="kept entries per row of key scales", none_ok=True)
        for name, per_layer in (("indices", indices), ("biases", biases), ("values", values), ("int4", int4)):
            if per_layer is not None and len(per_layer) != len(cache.layers):
                raise ValueError(
                    f"{name} has {len(per_layer)} layers, the cache has {len(cache.layers)}: give one entry per layer "
                    "(None for a sliding-window layer)"
                )
        original_length = cache.get_seq_length()
        if original_length == 0:
            raise ValueError("cache is empty: prefill it with the context first (model(ids, cache=cache))")
        layers = []
        for layer_idx, source in enumerate(cache.layers):
            if source.keys is None or source.keys.shape[0] != 1:
                raise ValueError(
                    f"cache layer {layer_idx} must hold one context (batch 1), got "
                    f"{None if source.keys is None else source.keys.shape[0]}"
                )
            layer_biases = None if biases is None else biases[layer_idx]
            layer_values = None if values is None else values[layer_idx]
            layer_int4 = None if int4 is None else int4[layer_idx]
            if isinstance(source, DynamicSlidingWindowLayer):
                if any(x is not None for x in (indices[layer_idx], layer_biases, layer_values, layer_int4)):
                    raise ValueError(
                        f"layer {layer_idx} is a sliding-window layer and is not compacted: pass None for it in "
                        "indices, biases, values and int4"
                    )
                layers.append(
                    SharedContextSlidingLayer(source.sliding_window, source.keys, source.values, original_length)
                )
            elif isinstance(source, DynamicLayer):
                layer = _select_layer(
                    layer_idx, source, indices[layer_idx], layer_biases, layer_values, original_length
                )
                layers.append(_with_int4(layer_idx, layer, layer_int4, key_group, source.values.dtype))
            else:
                raise TypeError(f"cache layer {layer_idx} is a {type(source).__name__}; expected a DynamicCache layer")
        return cls(layers, metadata=metadata)

    # ------------------------------------------------------------------ serving
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self._check_prefix_was_served()
        if layer_idx >= len(self.layers):
            raise ValueError(
                f"this cache was built for another model: num_hidden_layers is {len(self.layers)} in the cache but "
                f"the given model has a layer {layer_idx}"
            )
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if isinstance(self.layers[layer_idx], CompactedLayer):
            self._last_updated_layer = layer_idx
        return keys, values

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        self._check_prefix_was_served()
        return super().get_mask_sizes(query_length, layer_idx)

    def _check_prefix_was_served(self) -> None:
        last = self._last_updated_layer
        if last is not None and self.layers[last].awaiting_attention:
            raise RuntimeError(
                f"the compacted context of layer {last} was never read by the attention function: the model does "
                "not run hf_structkv's attention, and its output would silently ignore the compacted context. "
                "Call hf_structkv.enable(model) once (CompactedCache.load(..., model=model) does it), then use a "
                "fresh cache (cache.copy())."
            )

    def copy(self) -> CompactedCache:
        """A new cache sharing this cache's context tensors (no memory copied), with nothing appended."""
        return type(self)([layer.fresh_copy() for layer in self.layers], metadata=self.metadata)

    def reset(self) -> None:
        """Drop every appended token; the compacted context stays, ready for the next question."""
        super().reset()
        self._last_updated_layer = None

    # ------------------------------------------------------------------ persistence (compacted_files)
    # from_pretrained, load (its 0.1 name), save_pretrained and push_to_hub come from SavedArtifact.
    SAVED_FILES = CACHE_FILES

    @classmethod
    def _from_folder(
        cls, source: Path, *, model: PreTrainedModel | None, tokenizer: PreTrainedTokenizerBase | None
    ) -> CompactedCache:
        """With ``model``, the fingerprint is checked against it, the tensors are moved to its device and the model
        is switched to hf_structkv's attention (``enable``); with ``tokenizer``, its hash is checked too."""
        layers, metadata = read_cache_folder(source, model=model, tokenizer=tokenizer)
        cache = cls(layers, metadata=metadata)
        if model is not None:
            enable(model)
        return cache

    @classmethod
    def check_save_directory(cls, directory: Path) -> None:
        """`SavedArtifact.check_save_directory`, and a ``config.json`` there must be a compacted cache's (not a
        model's)."""
        super().check_save_directory(directory)
        if directory.is_dir():
            check_config_is_a_cache(directory)

    def _write_folder(self, directory: Path, repo_id: str | None) -> None:
        """``cache.safetensors``, ``config.json`` and the card: the context tensors only, never appended tokens."""
        write_cache_folder(list(self.layers), self.metadata, directory, repo_id=repo_id)

    def _commit_message(self) -> str:
        return f"Upload compacted KV cache ({self.original_length}-token context) with hf_structkv"

    # ------------------------------------------------------------------ bytes
    def nbytes(self) -> int:
        """Bytes of every stored tensor: context keys, values, biases and offsets, plus appended tokens."""
        return sum(layer.nbytes() for layer in self.layers)

    def full_nbytes(self) -> int:
        """Bytes of the same tokens (original context + appended) in a plain ``DynamicCache``."""
        return sum(layer.full_nbytes() for layer in self.layers)

    def overhead_nbytes(self) -> int:
        """Bytes stored beyond kept keys and values: per-entry biases and per-head offsets."""
        return sum(layer.overhead_nbytes() for layer in self.layers)

    def head_storage(self) -> list[list[str] | None]:
        """How each KV head of each layer is stored, ``"int4"`` or ``"bf16"`` (the cache's dtype); ``None`` for
        sliding-window layers."""
        return [layer.head_storage() if isinstance(layer, CompactedLayer) else None for layer in self.layers]

    def head_lengths(self) -> list[list[int] | None]:
        """Kept context entries per KV head of each layer (``None`` for sliding-window layers)."""
        return [layer.head_lengths() if isinstance(layer, CompactedLayer) else None for layer in self.layers]


def _select_layer(
    layer_idx: int,
    source: DynamicLayer,
    head_indices: Sequence[torch.Tensor] | None,
    head_biases: Sequence[torch.Tensor] | None,
    head_values: Sequence[torch.Tensor] | None,
    original_length: int,
) -> CompactedLayer:
    """Gather the kept entries of one global layer into the ragged layout."""
    keys, values = source.keys[0], source.values[0]  # [H_kv, T, D]
    n_heads = keys.shape[0]
    if head_indices is None or len(head_indices) != n_heads:
        raise ValueError(
            f"indices[{layer_idx}] must list one LongTensor per KV head ({n_heads}), got "
            f"{None if head_indices is None else len(head_indices)}"
        )
    for name, per_head in (("biases", head_biases), ("values", head_values)):
        if per_head is not None and len(per_head) != n_heads:
            raise ValueError(f"{name}[{layer_idx}] must list one tensor per KV head ({n_heads}), got {len(per_head)}")
    kept_keys, kept_values, kept_bias, lengths = [], [], [], []
    for h in range(n_heads):
        where = f"indices[{layer_idx}][{h}]"
        idx = head_indices[h]
        if not isinstance(idx, torch.Tensor) or idx.dtype != torch.long or idx.dim() != 1:
            raise TypeError(f"{where} must be a 1-D torch.long tensor of kept positions")
        idx = idx.to(keys.device)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= original_length):
            raise ValueError(f"{where} holds positions outside [0, {original_length})")
        if torch.unique(idx).numel() != idx.numel():
            raise ValueError(f"{where} holds a position twice; each kept entry must be distinct")
        t = idx.numel()
        kept_keys.append(keys[h, idx])
        where_v, where_b = f"values[{layer_idx}][{h}]", f"biases[{layer_idx}][{h}]"
        kept_values.append(
            _per_head_tensor(
                head_values, h, (t, values.shape[-1]), where_v, values[h, idx], value_limit(keys.shape[-1])
            )
        )
        bias = _per_head_tensor(head_biases, h, (t,), where_b, torch.zeros(t, device=keys.device), BIAS_LIMIT)
        kept_bias.append(bias.to(torch.float32))
        lengths.append(t)
    offsets = torch.zeros(n_heads + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.long), 0)
    return CompactedLayer(
        torch.cat(kept_keys).contiguous(),
        torch.cat(kept_values).to(values.dtype).contiguous(),
        torch.cat(kept_bias).contiguous(),
        offsets.to(keys.device),
        original_length,
    )


def _per_head_tensor(
    per_head, h: int, shape: tuple[int, ...], where: str, default: torch.Tensor, limit: float
) -> torch.Tensor:
    """``per_head[h]`` (``default`` when ``per_head`` is None), checked: ``shape``, finite, ``|x| <= limit`` (what a
    load checks: `compacted_checks.value_limit`, `BIAS_LIMIT`)."""
    if per_head is None:
        return default
    tensor = per_head[h]
    if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape:
        raise ValueError(f"{where} must be a tensor of shape {shape}, got {getattr(tensor, 'shape', type(tensor))}")
    if not torch.isfinite(tensor).all():
        raise ValueError(f"{where} holds NaN or infinite entries")
    peak = float(tensor.abs().max()) if tensor.numel() else 0.0
    if peak > limit:
        raise ValueError(
            f"{where} holds |x| = {peak:.4g}, above the {limit:.4g} a served cache can hold (float32 attention scores)"
        )
    return tensor.to(default.device)


def _with_int4(
    layer_idx: int,
    layer: CompactedLayer,
    heads: Sequence[Int4Head | None] | None,
    key_group: int | None,
    dtype: torch.dtype,
) -> CompactedLayer:
    """``layer`` with the heads that ``heads`` gives an `Int4Head` stored in INT4 (their rows dropped from the
    layer's keys and values), or ``layer`` itself when none is."""
    if heads is None or all(head is None for head in heads):
        return layer
    lengths = layer.head_lengths()
    if len(heads) != len(lengths):
        raise ValueError(f"int4[{layer_idx}] must list one entry per KV head ({len(lengths)}), got {len(heads)}")
    dim, value_dim = layer.prefix_keys.shape[-1], layer.prefix_values.shape[-1]
    device = layer.prefix_keys.device
    parts = []
    offsets = layer.prefix_offsets.tolist()
    plain_keys, plain_values = [layer.prefix_keys[:0]], [layer.prefix_values[:0]]
    for h, (head, start, end) in enumerate(zip(heads, offsets[:-1], offsets[1:])):
        if head is None:
            plain_keys.append(layer.prefix_keys[start:end])
            plain_values.append(layer.prefix_values[start:end])
        else:
            parts.append(_checked_int4_head(f"int4[{layer_idx}][{h}]", head, end - start, dim, value_dim, key_group))
    tensors = tuple(torch.cat([part[i] for part in parts]).to(device).contiguous() for i in range(5))
    int4_heads = [head is not None for head in heads]
    return CompactedLayer(
        torch.cat(plain_keys).to(dtype).contiguous(),
        torch.cat(plain_values).to(dtype).contiguous(),
        layer.prefix_bias,
        layer.prefix_offsets,
        layer.original_length,
        QuantizedHeads.build(tensors, int4_heads, key_group, lengths),
    )


def _checked_int4_head(
    where: str, head: object, length: int, dim: int, value_dim: int, key_group: int | None
) -> Int4Head:
    """``head`` if it is an `Int4Head` whose tensors fit a head of ``length`` entries (dtypes, shapes, finite
    scales), else TypeError / ValueError naming ``where`` and the field."""
    if not isinstance(head, Int4Head):
        raise TypeError(f"{where} must be an Int4Head (or None for a head in the cache's dtype), got {type(head)}")
    groups = key_groups(length, key_group)
    expected = {
        "key_codes": ((length, (dim + 1) // 2), torch.uint8),
        "key_scales": ((groups, dim), torch.float16),
        "key_offsets": ((groups, dim), torch.float16),
        "value_codes": ((length, (value_dim + 1) // 2), torch.uint8),
        "value_scales": ((length, 1), torch.float16),
    }
    for field, (shape, dtype) in expected.items():
        tensor = getattr(head, field)
        if not isinstance(tensor, torch.Tensor) or tensor.dtype != dtype or tuple(tensor.shape) != shape:
            got = (tuple(tensor.shape), tensor.dtype) if isinstance(tensor, torch.Tensor) else type(tensor)
            raise ValueError(f"{where}.{field} must be {dtype} of shape {shape} (key_group={key_group}), got {got}")
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise ValueError(f"{where}.{field} holds NaN or infinite entries")
    return head
