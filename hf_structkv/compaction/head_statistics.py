"""One KV head's compaction problem and the statistics every method shares.

`HeadProblem` holds a head's keys, values and calibration queries in float64 and computes, block by block, the full
softmax attention's row statistics (`RowStatistics`), its columns and column reductions, the leave-one-out scores
(13) and the relative loss (4) of a `CompactedHead`. Equation numbers follow ``design/ALGORITHMS.md`` §1. All linear
algebra runs in float64 on the inputs' device.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from typing import ClassVar

import torch

from .head_storage import OFFSET_BYTES, StorageLayout

FLOAT = torch.float64


@dataclass(frozen=True)
class CompactedHead:
    """One compacted KV head, stored in the cache's dtype (storage ``"bf16"``).

    Attributes:
        indices: ``[t]`` LongTensor, kept positions of the original cache, sorted ascending.
        bias: ``[t]`` float32 logit biases ``log w_j`` added to the scaled logits before the softmax.
        values: ``[t, D_v]`` values served for the kept entries (refit or original), in the input values' dtype.
        train_loss: relative loss ``L / ‖O‖_F²`` (4) on the calibration queries, or None without queries.
        storage_fallback: True when INT4 storage was asked for and this head, fitted at the same bytes, served
            the calibration queries better (`compact_head` with ``storage="int4"``).
    """

    indices: torch.Tensor
    bias: torch.Tensor
    values: torch.Tensor
    train_loss: float | None = None
    storage_fallback: bool = False

    storage: ClassVar[str] = "bf16"

    def served_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """The keys served for the kept entries, ``[t, D]``: rows ``indices`` of the original ``keys [T, D]``."""
        return keys[self.indices.to(keys.device)]

    def nbytes(self, key_dim: int | None = None) -> int:
        """Bytes stored (`StorageLayout` ``"bf16"``): keys of ``key_dim`` channels (default ``D_v``) and values in the
        values' dtype, FP32 biases, one int64 row offset."""
        value_dim = self.values.shape[1]
        layout = StorageLayout("bf16", key_dim or value_dim, value_dim, self.values.element_size())
        return layout.nbytes(self.indices.numel())


@dataclass(frozen=True)
class QuantizedHead(CompactedHead):
    """One compacted KV head stored in INT4 (storage ``"int4"``): what is stored and what it serves.

    Attributes (besides `CompactedHead`'s; ``values`` are the served, dequantised values in float32):
        keys: ``[t, D]`` float32 served keys, ``dequantize_int4_channels(key_codes, key_scales, key_offsets, D,
            key_group)``.
        key_codes: ``[t, ceil(D / 2)]`` uint8 packed key codes.
        key_scales: ``[ceil(t / key_group), D]`` fp16 per-channel key scales (one row when ``key_group`` is None).
        key_offsets: fp16 per-channel key offsets, shaped as ``key_scales``.
        value_codes: ``[t, ceil(D_v / 2)]`` uint8 packed value codes.
        value_scales: ``[t, 1]`` fp16 per-row value scales.
        key_group: kept entries per row of key scales, None for one row per head.
    """

    keys: torch.Tensor | None = None
    key_codes: torch.Tensor | None = None
    key_scales: torch.Tensor | None = None
    key_offsets: torch.Tensor | None = None
    value_codes: torch.Tensor | None = None
    value_scales: torch.Tensor | None = None
    key_group: int | None = None

    storage: ClassVar[str] = "int4"

    def served_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """The dequantised keys ``[t, D]`` (``keys``, the original ones, are not used)."""
        return self.keys.to(keys.device)

    def nbytes(self, key_dim: int | None = None) -> int:
        """Bytes of the stored tensors (codes, scales, FP32 biases) and one int64 row offset (``key_dim`` is
        ignored: the codes say it)."""
        stored = (self.key_codes, self.key_scales, self.key_offsets, self.value_codes, self.value_scales, self.bias)
        return sum(t.numel() * t.element_size() for t in stored) + OFFSET_BYTES


def _as_matrix(name: str, tensor: object) -> torch.Tensor:
    """Validate a non-empty, finite, floating 2-D tensor and return it detached in float64."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {tensor.dtype}")
    if tensor.dim() != 2 or tensor.numel() == 0:
        raise ValueError(f"{name} must be a non-empty 2-D tensor [rows, dim], got shape {tuple(tensor.shape)}")
    matrix = tensor.detach().to(FLOAT)
    if not torch.isfinite(matrix).all():
        raise ValueError(f"{name} has non-finite entries")
    return matrix


@dataclass(frozen=True)
class RowStatistics:
    """Per-query statistics of the full softmax attention of a head.

    Attributes:
        row_max: ``m [N]``, the largest scaled logit of each query.
        row_sums: ``s [N]``, the row sums of ``E = exp(Z − m)`` (so ``P = diag(s)^{-1} E``).
        outputs: ``O = P V`` ``[N, D_v]``.
    """

    row_max: torch.Tensor
    row_sums: torch.Tensor
    outputs: torch.Tensor

    def rows(self, index: torch.Tensor) -> RowStatistics:
        """The statistics of the queries ``index`` (a LongTensor of rows)."""
        return RowStatistics(self.row_max[index], self.row_sums[index], self.outputs[index])


@dataclass(frozen=True)
class HeadProblem:
    """One KV head's compaction problem in float64; attention statistics are computed once, on first use.

    Nothing of size ``[N, T]`` is kept: the row statistics and column scores (`reduce_columns`) are computed over
    blocks of at most `BLOCK_ELEMENTS` logits, and the columns a fit needs are recomputed from the row statistics
    (`attention_columns`).

    Attributes:
        keys: ``K [T, D]`` post-RoPE keys.
        values: ``V [T, D_v]``.
        queries: ``Q [N, D]`` calibration queries (for GQA the stacked queries of the group), or None (query-free).
        scaling: logit scale (``1/sqrt(D)`` by default).
        precomputed: the `RowStatistics` of ``queries`` if already computed (`split` passes its parent's), else None.
    """

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor | None
    scaling: float
    precomputed: RowStatistics | None = None

    BLOCK_ELEMENTS: ClassVar[int] = 1 << 24
    MAX_LOGIT: ClassVar[float] = 1e6
    """Refused bound on ``scaling · max‖q‖ · max‖k‖`` (Cauchy-Schwarz bound of every logit)."""

    @classmethod
    def build(
        cls, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor | None, scaling: float | None = None
    ) -> HeadProblem:
        """Validate the inputs (shapes, dtypes, devices, finiteness) and cast them to float64."""
        keys64, values64 = _as_matrix("keys", keys), _as_matrix("values", values)
        if values64.shape[0] != keys64.shape[0]:
            raise ValueError(f"values has {values64.shape[0]} rows, keys has {keys64.shape[0]}: one row per position")
        queries64 = None if queries is None else _as_matrix("queries", queries)
        if queries64 is not None and queries64.shape[1] != keys64.shape[1]:
            raise ValueError(f"queries have dimension {queries64.shape[1]}, keys have {keys64.shape[1]}")
        devices = {t.device for t in (keys64, values64, queries64) if t is not None}
        if len(devices) > 1:
            raise ValueError(f"keys, values and queries must be on one device, got {sorted(map(str, devices))}")
        if scaling is None:
            scaling = 1.0 / math.sqrt(keys64.shape[1])
        elif not isinstance(scaling, numbers.Real) or not math.isfinite(scaling) or scaling <= 0:
            raise ValueError(f"scaling must be a positive finite number, got {scaling!r}")
        if queries64 is not None and keys64.numel() and queries64.numel():
            bound = scaling * float(queries64.norm(dim=1).max()) * float(keys64.norm(dim=1).max())
            if not bound <= cls.MAX_LOGIT:
                raise ValueError(
                    f"keys, queries and scaling allow attention logits up to {bound:.3g} (scaling x largest query "
                    f"norm x largest key norm), beyond {cls.MAX_LOGIT:g}, where the fit's linear algebra breaks down: "
                    "pass the head's post-RoPE keys and queries and the model's scaling (a model's logits stay far "
                    "below this)"
                )
        return cls(keys64, values64, queries64, float(scaling))

    @property
    def length(self) -> int:
        """``T``, the number of cache entries."""
        return self.keys.shape[0]

    def logits(self, indices: torch.Tensor | None = None, rows: slice = slice(None)) -> torch.Tensor:
        """Scaled logits ``Z[rows, indices]`` ``[|rows|, |indices|]`` (``indices=None``: all ``T`` columns)."""
        return self.logits_of(self.keys if indices is None else self.keys[indices], rows)

    def logits_of(self, keys: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
        """Scaled logits ``[|rows|, t]`` of the queries ``rows`` against any float64 ``keys [t, D]`` (e.g. served
        INT4 keys)."""
        if self.queries is None:
            raise ValueError("this computation needs calibration queries, got queries=None")
        return self.queries[rows] @ keys.T * self.scaling

    def query_blocks(self, columns: int | None = None) -> list[slice]:
        """Consecutive query blocks of at most `BLOCK_ELEMENTS` entries of ``columns`` (default ``T``) each (at
        least one row)."""
        step = max(1, self.BLOCK_ELEMENTS // (columns or self.length))
        return [slice(i, i + step) for i in range(0, self.queries.shape[0], step)]

    @cached_property
    def statistics(self) -> RowStatistics:
        """The `RowStatistics` of the queries (``precomputed``, or computed block by block)."""
        if self.precomputed is not None:
            return self.precomputed
        maxes, sums, outputs = [], [], []
        for rows in self.query_blocks():
            logits = self.logits(rows=rows)
            row_max = logits.amax(dim=1)
            unnormalized = torch.exp(logits.sub_(row_max[:, None]))
            row_sums = unnormalized.sum(dim=1)
            maxes.append(row_max)
            sums.append(row_sums)
            outputs.append(unnormalized.div_(row_sums[:, None]) @ self.values)
        return RowStatistics(torch.cat(maxes), torch.cat(sums), torch.cat(outputs))

    @property
    def row_sums(self) -> torch.Tensor:
        """``s [N]``, row sums of ``E = exp(Z − rowmax Z)`` (so ``P = diag(s)^{-1} E``)."""
        return self.statistics.row_sums

    @property
    def outputs(self) -> torch.Tensor:
        """``O = P V`` ``[N, D_v]``."""
        return self.statistics.outputs

    def unnormalized(self, indices: torch.Tensor | None = None, rows: slice = slice(None)) -> torch.Tensor:
        """``E[rows, indices] = exp(Z − rowmax Z)`` ``[|rows|, |indices|]`` (row max over all ``T`` entries)."""
        return torch.exp(self.logits(indices, rows).sub_(self.statistics.row_max[rows, None]))

    def attention_columns(self, indices: torch.Tensor | None = None, rows: slice = slice(None)) -> torch.Tensor:
        """``P[rows, indices]`` ``[|rows|, |indices|]``: columns of the softmax over all ``T`` entries."""
        return self.unnormalized(indices, rows).div_(self.statistics.row_sums[rows, None])

    def reduce_columns(
        self,
        per_block: Callable[[torch.Tensor, slice], torch.Tensor],
        combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.add,
    ) -> torch.Tensor:
        """A column score over all queries without the whole ``P``: ``per_block(P[rows] [n, T], rows) -> [T]`` on
        each query block, folded with ``combine`` (a sum by default; e.g. ``torch.maximum``)."""
        total = None
        for rows in self.query_blocks():
            part = per_block(self.attention_columns(rows=rows), rows)
            total = part if total is None else combine(total, part)
        return total

    @cached_property
    def loo(self) -> torch.Tensor:
        """Leave-one-out scores (13) with the 1e-3 floor, ``[T]``."""
        terms = self.reduce_columns(lambda block, rows: _loo_terms(block, self.values, self.outputs[rows]))
        return terms.clamp_min(0)

    def compacted_attention(self, indices: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """``P̂ = diag(P_S w)^{-1} P_S diag(w)`` ``[N, t]``, ``w = exp(bias)``: the stable softmax of ``Z_S + bias``."""
        return torch.softmax(self.logits(indices) + bias, dim=1)

    def split(self, fraction: float, seed: int) -> tuple[HeadProblem, HeadProblem]:
        """Seeded disjoint split of the queries: ``(fit, check)`` problems over the same keys and values, ``check``
        holding ``max(1, round(fraction N))`` queries and ``fit`` the rest (``N >= 2``); both take their rows of this
        problem's `RowStatistics` instead of recomputing them."""
        if self.queries is None or self.queries.shape[0] < 2:
            raise ValueError("a split needs at least two calibration queries")
        n = self.queries.shape[0]
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(self.queries.device)
        n_check = min(n - 1, max(1, round(fraction * n)))
        parts = order[n_check:], order[:n_check]
        fit, check = (replace(self, queries=self.queries[i], precomputed=self.statistics.rows(i)) for i in parts)
        return fit, check

    def relative_loss(self, head: CompactedHead) -> float:
        """``L(S, w, V̂) / ‖O‖_F²`` (4) of ``head`` on this problem's queries (0 when both are zero)."""
        logits = self.logits_of(head.served_keys(self.keys).to(FLOAT))
        approx = torch.softmax(logits + head.bias.to(self.keys.device, FLOAT), dim=1)
        error = (approx @ head.values.to(self.keys.device, FLOAT) - self.outputs).square().sum()
        reference = self.outputs.square().sum()
        if reference == 0:
            return 0.0 if error == 0 else math.inf
        return (error / reference).item()


def loo_scores(
    attention: torch.Tensor, values: torch.Tensor, outputs: torch.Tensor, floor: float = 1e-3
) -> torch.Tensor:
    """Leave-one-out scores (13): ``s_j = Σ_i P_ij² / ((1 − P_ij)² + floor) · ‖v_j − o_i‖²``.

    With ``floor=0`` this is the exact loss (4) of deleting ``j`` alone with unit multipliers and unchanged values.

    Args:
        attention: ``P [N, T]``.
        values: ``V [T, D_v]``.
        outputs: ``O [N, D_v]``.

    Returns:
        ``[T]``.
    """
    return _loo_terms(attention, values, outputs, floor).clamp_min(0)


def _loo_terms(
    attention: torch.Tensor, values: torch.Tensor, outputs: torch.Tensor, floor: float = 1e-3
) -> torch.Tensor:
    """The sum (13) over the rows given, before clamping, ``[T]``: sums over blocks of rows add up to the whole."""
    return weighted_distances(attention.square() / ((1 - attention).square() + floor), values, outputs)


def weighted_distances(weight: torch.Tensor, values: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """``Σ_i W_ij ‖v_j − o_i‖²`` ``[T]`` from ``W [N, T]``, ``V [T, D_v]``, ``O [N, D_v]``, expanded into matrix
    products (so rounding may leave an entry slightly negative)."""
    cross = ((weight.T @ outputs) * values).sum(dim=1)
    return values.square().sum(dim=1) * weight.sum(dim=0) + weight.T @ outputs.square().sum(dim=1) - 2 * cross
