"""What attention over a compacted layer reads: the compacted prefix and the tokens appended after it.

The torch reference (`compacted_attention`), the fused SDPA path and the Triton kernel all take these two tuples. A
prefix may hold some KV heads in INT4 (`QuantizedHeads`); `CompactedPrefix.head` serves them dequantised, per call,
so no dequantised copy outlives the forward that reads it (the Triton kernel, and the fused SDPA path at a decode step
through `int4_head_stats`, read their codes and scales instead).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..quant import dequantize_int4, dequantize_int4_channels


def key_groups(length: int, key_group: int | None) -> int:
    """Rows of key scales (and key offsets) of an INT4 head of ``length`` kept entries: ``ceil(length / key_group)``,
    one for a non-empty head when ``key_group`` is None, none for an empty head."""
    return 0 if length == 0 else -(-length // (key_group or length))


class QuantizedHeads(NamedTuple):
    """The KV heads of a compacted prefix stored in INT4 (``design/ALGORITHMS.md`` §3): keys per channel with FP16
    scales and offsets per group of ``key_group`` kept entries (`quantize_int4_channels`), values per row with an
    FP16 scale (`quantize_int4`). Ragged like the prefix: INT4 head ``h`` of ``L_h`` entries in code rows
    ``row_starts[h] : row_starts[h] + L_h`` and key-scale rows ``group_starts[h] : group_starts[h] +
    key_groups(L_h, key_group)``; a head stored in the cache's dtype has its rows at ``row_starts[h]`` of the
    prefix's ``keys`` / ``values`` instead.

    Attributes:
        key_codes: ``[M, ceil(D / 2)]`` uint8 packed key codes (``M``: entries of the INT4 heads).
        key_scales: ``[G, D]`` fp16 per-channel key scales.
        key_offsets: ``[G, D]`` fp16 per-channel key offsets (the value of code 0).
        value_codes: ``[M, ceil(D_v / 2)]`` uint8 packed value codes.
        value_scales: ``[M, 1]`` fp16 per-row value scales.
        int4_heads: per KV head, whether it is stored in INT4.
        key_group: kept entries per row of key scales (None: one row per head).
        row_starts: per KV head, its first row in its storage's tensors.
        group_starts: per KV head, its first row of key scales (INT4 heads).
    """

    key_codes: torch.Tensor
    key_scales: torch.Tensor
    key_offsets: torch.Tensor
    value_codes: torch.Tensor
    value_scales: torch.Tensor
    int4_heads: tuple[bool, ...]
    key_group: int | None
    row_starts: tuple[int, ...]
    group_starts: tuple[int, ...]

    @classmethod
    def build(
        cls, tensors: tuple[torch.Tensor, ...], int4_heads: list[bool], key_group: int | None, lengths: list[int]
    ) -> QuantizedHeads:
        """From the five stored ``tensors`` (``key_codes, key_scales, key_offsets, value_codes, value_scales``), which
        heads are INT4 and every head's kept entries ``lengths``: the row starts computed once."""
        row_starts, group_starts, rows, groups = [], [], {False: 0, True: 0}, 0
        for is_int4, length in zip(int4_heads, lengths, strict=True):
            row_starts.append(rows[is_int4])
            group_starts.append(groups)
            rows[is_int4] += length
            groups += key_groups(length, key_group) if is_int4 else 0
        return cls(*tensors, tuple(int4_heads), key_group, tuple(row_starts), tuple(group_starts))

    def tensors(self) -> list[torch.Tensor]:
        """The five stored tensors, in field order."""
        return [self.key_codes, self.key_scales, self.key_offsets, self.value_codes, self.value_scales]

    def served(
        self, h: int, length: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys [L_h, D], values [L_h, D_v])`` served for KV head ``h`` of ``length`` entries: rows of the prefix's
        ``keys`` / ``values`` for a head in the cache's dtype, else dequantised (float32) from its codes."""
        rows = slice(self.row_starts[h], self.row_starts[h] + length)
        if not self.int4_heads[h]:
            return keys[rows], values[rows]
        groups = slice(self.group_starts[h], self.group_starts[h] + key_groups(length, self.key_group))
        if length == 0:
            return keys.new_zeros(0, keys.shape[-1], dtype=torch.float32), values.new_zeros(
                0, values.shape[-1], dtype=torch.float32
            )
        served_keys = dequantize_int4_channels(
            self.key_codes[rows], self.key_scales[groups], self.key_offsets[groups], keys.shape[-1], self.key_group
        )
        return served_keys, dequantize_int4(self.value_codes[rows], self.value_scales[rows], values.shape[-1])


class CompactedPrefix(NamedTuple):
    """The kept entries of every KV head of one layer, stacked head after head (ragged: ``L_h`` entries for head ``h``,
    ``N = Σ_h L_h``), shared by every row of the batch and visible to every query.

    Attributes:
        keys: ``[N, D]`` kept post-RoPE keys, KV head ``h`` in rows ``offsets[h]:offsets[h+1]``; with ``quantized``,
            only the heads stored in the cache's dtype, at their ``quantized.row_starts``.
        values: ``[N, D_v]`` kept (refit) values, same layout.
        bias: ``[N]`` FP32 logit biases (log multipliers), added to the entries' scores (every head, at ``offsets``).
        offsets: ``H_kv + 1`` non-decreasing row offsets (Python ints).
        quantized: not a field (the tuple stays four long): the heads stored in INT4 (`QuantizedHeads`) of a
            `QuantizedPrefix`, None here, where every head is in ``keys`` / ``values``.
    """

    keys: torch.Tensor
    values: torch.Tensor
    bias: torch.Tensor
    offsets: list[int]

    quantized = None

    @property
    def num_kv_heads(self) -> int:
        return len(self.offsets) - 1

    def head(self, h: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys [L_h, D], values [L_h, D_v], bias [L_h])`` of KV head ``h`` as served (INT4 heads dequantised to
        float32)."""
        rows = slice(self.offsets[h], self.offsets[h + 1])
        if self.quantized is None:
            return self.keys[rows], self.values[rows], self.bias[rows]
        length = self.offsets[h + 1] - self.offsets[h]
        return (*self.quantized.served(h, length, self.keys, self.values), self.bias[rows])

    def dense(self, dtype: torch.dtype | None = None) -> CompactedPrefix:
        """This prefix with every head's served keys and values in ``keys`` / ``values`` (``dtype``, default the
        stored keys' dtype) and no ``quantized`` part: itself when nothing is quantised and ``dtype`` is kept. A copy
        made per call, for paths that read plain rows."""
        dtype = dtype or self.keys.dtype
        if self.quantized is None and dtype == self.keys.dtype:
            return self
        heads = [self.head(h) for h in range(self.num_kv_heads)]
        keys = torch.cat([k.to(dtype) for k, _, _ in heads]) if heads else self.keys.to(dtype)
        values = torch.cat([v.to(dtype) for _, v, _ in heads]) if heads else self.values.to(dtype)
        return CompactedPrefix(keys, values, self.bias, self.offsets)


class QuantizedPrefix(CompactedPrefix):
    """A `CompactedPrefix` whose ``quantized`` heads (`QuantizedHeads`) are stored in INT4: ``keys`` / ``values``
    hold only the other heads' rows; ``head`` serves every head, ``dense`` makes a plain prefix."""

    def __new__(cls, keys, values, bias, offsets, quantized: QuantizedHeads):
        prefix = super().__new__(cls, keys, values, bias, offsets)
        prefix.quantized = quantized
        return prefix

    def _replace(self, **fields) -> QuantizedPrefix:
        """This prefix with ``fields`` replaced, ``quantized`` kept (the tuple's own ``_replace`` would drop it)."""
        return QuantizedPrefix(*CompactedPrefix._replace(self, **fields), self.quantized)


class AppendedTokens(NamedTuple):
    """The tokens each batch row appended after the prefix (question, generated text, the current step), as the cache
    layer's ``update`` returns them, with the model's attention mask over them.

    Attributes:
        keys: ``[B, H_kv, n, D]``.
        values: ``[B, H_kv, n, D_v]``.
        mask: ``None`` (causal, bottom-right aligned: query ``i`` of ``q`` sees keys ``0 .. n - q + i``), a boolean
            mask (True = visible) or an additive float mask, broadcastable to ``[B, 1, q, n]``.
    """

    keys: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor | None = None


def check_inputs(prefix: object, appended: object) -> None:
    """TypeError naming the argument unless ``prefix`` is a `CompactedPrefix` and ``appended`` `AppendedTokens`."""
    for name, value, kind in (("prefix", prefix, CompactedPrefix), ("appended", appended, AppendedTokens)):
        if not isinstance(value, kind):
            fields = ", ".join(kind._fields)
            raise TypeError(f"{name} must be given as {kind.__name__}({fields}), got {type(value).__name__}")
