"""Compacted heads stored in bitsandbytes' blockwise 4-bit NormalFloat (NF4), measured beside our INT4 by
``compaction_loss.py --storage nf4`` (issue 31). A measurement, not a cache format.

NF4 (``bitsandbytes.functional.quantize_4bit(..., quant_type="nf4")``) flattens a tensor row-major into blocks of
``blocksize`` elements; each block stores one FP32 absmax and one 4-bit code per element, the index of the nearest of
16 fixed levels in ``[-1, 1]`` (quantiles of a normal distribution) to ``x / absmax``. Stored bytes of ``n`` elements:
``ceil(n / 2)`` codes + ``4 ceil(n / blocksize)`` absmax. A head's kept keys ``[t, D_k]`` are laid out either
``"tokens"`` (row-major: with ``blocksize = D_k`` one absmax per key row) or ``"channels"`` (transposed: blocks run
along the kept tokens of one channel, as our INT4 keys' scales do, but symmetric); values ``[t, D_v]`` row-major.

The fit is our INT4 head's (`quantize_head`), with NF4 in place of INT4: KV-Surgeon's selection, the shared final
refit with the served (dequantised) keys against the full cache's exact statistics (`refit_with_served_keys`), then
the refit values rounded to NF4. Our INT4 head (`compact_head(storage="int4")`) is also guarded: it falls back per head
to BF16 at the same bytes when that serves the calibration queries better. NF4 is not guarded, so the like-for-like
comparison is against our INT4 head before that guard (`compact_quantized` with ``store=quantize_head``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from hf_structkv.compaction import HEAD_METHODS
from hf_structkv.compaction.head_method import CalibratedMethod, HeadMethod
from hf_structkv.compaction.head_statistics import FLOAT, CompactedHead, HeadProblem
from hf_structkv.compaction.head_storage import BIAS_BYTES, OFFSET_BYTES
from hf_structkv.compaction.quantized_refit import dtype_head, refit_with_served_keys

KEY_LAYOUTS = ("tokens", "channels")
"""How a head's kept keys ``[t, D_k]`` are flattened into NF4 blocks: row-major, or transposed."""

BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
"""The block sizes bitsandbytes quantises with."""

ABSMAX_BYTES = 4
"""One FP32 absmax per block (bitsandbytes' default, without nested quantisation of the absmax)."""


def quantize_nf4(x: torch.Tensor, blocksize: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """NF4 codes of ``x`` (any shape, flattened row-major) in blocks of ``blocksize`` elements.

    Returns:
        ``(codes, absmax)``: uint8 ``[ceil(n / 2)]`` (two codes a byte) and FP32 ``[ceil(n / blocksize)]``.
    """
    from bitsandbytes.functional import quantize_4bit

    codes, state = quantize_4bit(x.float().contiguous(), blocksize=blocksize, quant_type="nf4")
    return codes.flatten(), state.absmax


def dequantize_nf4(codes: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, ...], blocksize: int = 64):
    """FP32 ``x̂`` of ``shape`` from `quantize_nf4`'s ``codes`` and ``absmax``: ``level[code] · absmax[block]``.

    Dequantised flat, then reshaped: bitsandbytes 0.50.2's CPU kernel misreads the absmax of 2-D shapes whose rows are
    not whole blocks (e.g. ``[16, 32]`` in blocks of 64: a third of the elements wrong).
    """
    from bitsandbytes.functional import QuantState, dequantize_4bit, get_4bit_type

    state = QuantState(
        absmax=absmax,
        shape=torch.Size([math.prod(shape)]),
        code=get_4bit_type("nf4", device=codes.device),
        blocksize=blocksize,
        quant_type="nf4",
        dtype=torch.float32,
    )
    return dequantize_4bit(codes.unsqueeze(1), state).view(shape)


def nf4_nbytes(elements: int, blocksize: int) -> int:
    """Stored bytes of ``elements`` NF4 elements: packed codes and one absmax per block."""
    return -(-elements // 2) + ABSMAX_BYTES * -(-elements // blocksize)


@dataclass(frozen=True)
class NF4Layout:
    """The bytes of one NF4 compacted KV head: keys and values as `nf4_nbytes`, an FP32 bias per kept entry and one
    int64 row offset (as `StorageLayout` counts them)."""

    key_dim: int
    value_dim: int
    blocksize: int = 64

    def nbytes(self, entries: int) -> int:
        """Bytes of a head with ``entries`` kept entries."""
        keys, values = (nf4_nbytes(entries * dim, self.blocksize) for dim in (self.key_dim, self.value_dim))
        return keys + values + entries * BIAS_BYTES + OFFSET_BYTES

    def entries_for(self, nbytes: int) -> int:
        """The most kept entries whose `nbytes` is at most ``nbytes`` (0 when not even one fits)."""
        per_entry = (self.key_dim + self.value_dim) * (0.5 + ABSMAX_BYTES / self.blocksize) + BIAS_BYTES
        entries = max(0, math.floor((nbytes - OFFSET_BYTES) / per_entry))  # an upper bound: rounding only adds bytes
        while entries > 0 and self.nbytes(entries) > nbytes:
            entries -= 1
        return entries


@dataclass(frozen=True)
class NF4Head(CompactedHead):
    """A compacted head stored in NF4 (`CompactedHead` with float32 served ``values``).

    Attributes:
        keys: ``[t, D_k]`` float32 served keys, ``dequantize_nf4`` of the key codes (transposed back for
            ``"channels"``).
        key_codes, key_absmax: `quantize_nf4` of the kept keys in ``key_layout``.
        value_codes, value_absmax: `quantize_nf4` of the served values ``[t, D_v]``.
        key_layout: one of `KEY_LAYOUTS`.
        blocksize: elements per absmax.
    """

    keys: torch.Tensor | None = None
    key_codes: torch.Tensor | None = None
    key_absmax: torch.Tensor | None = None
    value_codes: torch.Tensor | None = None
    value_absmax: torch.Tensor | None = None
    key_layout: str = "tokens"
    blocksize: int = 64

    storage: ClassVar[str] = "nf4"

    def served_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """The dequantised keys ``[t, D]`` (``keys``, the original ones, are not used)."""
        return self.keys.to(keys.device)

    def nbytes(self, key_dim: int | None = None) -> int:
        """Bytes of the stored tensors (codes, absmax, FP32 biases) and one int64 row offset."""
        stored = (self.key_codes, self.key_absmax, self.value_codes, self.value_absmax, self.bias.float())
        return sum(t.numel() * t.element_size() for t in stored) + OFFSET_BYTES


def _stored_keys(keys: torch.Tensor, layout: str) -> torch.Tensor:
    return keys.T if layout == "channels" else keys


@dataclass(frozen=True)
class NF4Storage:
    """Stores a selected head in NF4 (a ``store`` of `compact_quantized`): its kept keys flattened per ``key_layout``
    (one of `KEY_LAYOUTS`) in blocks of ``blocksize`` elements, a calibrated method refit with the served keys, the
    values then rounded to NF4 in blocks of ``blocksize``.

    Raises:
        ValueError: ``key_layout`` or ``blocksize`` is not one of the allowed values.
    """

    key_layout: str = "tokens"
    blocksize: int = 64

    def __post_init__(self) -> None:
        if self.key_layout not in KEY_LAYOUTS:
            raise ValueError(f"key_layout must be one of {list(KEY_LAYOUTS)}, got {self.key_layout!r}")
        if self.blocksize not in BLOCKSIZES:
            raise ValueError(f"blocksize must be one of bitsandbytes' sizes {list(BLOCKSIZES)}, got {self.blocksize}")

    def __call__(self, problem: HeadProblem, selected: CompactedHead, rule: HeadMethod) -> NF4Head:
        layout, blocksize = self.key_layout, self.blocksize
        stored = _stored_keys(problem.keys[selected.indices], layout)
        key_codes, key_absmax = quantize_nf4(stored, blocksize)
        served = _stored_keys(dequantize_nf4(key_codes, key_absmax, tuple(stored.shape), blocksize), layout)
        bias, refit = selected.bias.float(), selected.values.to(FLOAT)
        if isinstance(rule, CalibratedMethod) and rule.refit and problem.queries is not None:
            bias, refit, _ = refit_with_served_keys(
                problem, selected.indices, served.to(FLOAT), rule.bias_bound, rule.value_shrinkage
            )
        value_codes, value_absmax = quantize_nf4(refit, blocksize)
        return NF4Head(
            selected.indices,
            bias.float(),
            dequantize_nf4(value_codes, value_absmax, tuple(refit.shape), blocksize),
            keys=served.contiguous(),
            key_codes=key_codes,
            key_absmax=key_absmax,
            value_codes=value_codes,
            value_absmax=value_absmax,
            key_layout=layout,
            blocksize=blocksize,
        )


def compact_quantized(
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor | None,
    budget: int,
    store: Callable[[HeadProblem, CompactedHead, HeadMethod], CompactedHead],
    method: str = "kv_surgeon",
    scaling: float | None = None,
    seed: int = 0,
) -> CompactedHead:
    """``method``'s selection of ``min(budget, T)`` entries of ``keys [T, D_k]`` / ``values [T, D_v]`` (fitted to
    ``queries [N, D_k]``), stored by ``store(problem, selected, rule)``: an `NF4Storage`, or ``quantize_head`` (our
    INT4 head as `compact_head(..., storage="int4")` builds it, without its per-head fallback to BF16).

    Raises:
        ValueError: ``method`` is not one of `HEAD_METHODS`.
    """
    if method not in HEAD_METHODS:
        raise ValueError(f"method must be one of {sorted(HEAD_METHODS)}, got {method!r}")
    rule, problem = HEAD_METHODS[method](), HeadProblem.build(keys, values, queries, scaling)
    head = store(problem, dtype_head(problem, rule, budget, seed, values.dtype), rule)
    return head if problem.queries is None else replace(head, train_loss=problem.relative_loss(head))
