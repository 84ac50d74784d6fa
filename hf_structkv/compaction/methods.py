"""Per-KV-head compaction: ``compact_head(K, V, Q, t, method=...)`` -> `CompactedHead` (positions, biases, values).

Every method is one small class behind the `HeadMethod` interface, registered by name in `HEAD_METHODS`. A calibrated
method picks a support and then applies the shared final refit (`refit.py`); a query-free method evicts (bias 0,
original values). Formulas and equation numbers follow the KV-Surgeon seed, restated in ``design/ALGORITHMS.md`` §1.
All linear algebra runs in float64 on the inputs' device.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cached_property
from typing import ClassVar

import torch

from ..validation import check_int
from .refit import fit_multipliers, fit_values

FLOAT = torch.float64
SHRINK_AT = 0.75  # KVSurgeon.eliminate drops deleted rows when the live ones are at most this share


@dataclass(frozen=True)
class CompactedHead:
    """One compacted KV head.

    Attributes:
        indices: ``[t]`` LongTensor, kept positions of the original cache, sorted ascending.
        bias: ``[t]`` float32 logit biases ``log w_j`` added to the scaled logits before the softmax.
        values: ``[t, D_v]`` values served for the kept entries (refit or original), in the input values' dtype.
        train_loss: relative loss ``L / ‖O‖_F²`` (4) on the calibration queries, or None without queries.
    """

    indices: torch.Tensor
    bias: torch.Tensor
    values: torch.Tensor
    train_loss: float | None = None


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
        return cls(keys64, values64, queries64, float(scaling))

    @property
    def length(self) -> int:
        """``T``, the number of cache entries."""
        return self.keys.shape[0]

    def logits(self, indices: torch.Tensor | None = None, rows: slice = slice(None)) -> torch.Tensor:
        """Scaled logits ``Z[rows, indices]`` ``[|rows|, |indices|]`` (``indices=None``: all ``T`` columns)."""
        if self.queries is None:
            raise ValueError("this computation needs calibration queries, got queries=None")
        keys = self.keys if indices is None else self.keys[indices]
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
        indices = head.indices.to(self.keys.device)
        approx = self.compacted_attention(indices, head.bias.to(self.keys.device, FLOAT))
        error = (approx @ head.values.to(self.keys.device, FLOAT) - self.outputs).square().sum()
        reference = self.outputs.square().sum()
        if reference == 0:
            return 0.0 if error == 0 else math.inf
        return (error / reference).item()


# ---------------------------------------------------------------------------------------------------------------------
# Scores and the surrogate of KV-Surgeon (public for testing against brute force).


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
    return _weighted_distances(attention.square() / ((1 - attention).square() + floor), values, outputs)


def _weighted_distances(weight: torch.Tensor, values: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """``Σ_i W_ij ‖v_j − o_i‖²`` ``[T]`` from ``W [N, T]``, ``V [T, D_v]``, ``O [N, D_v]``, expanded into matrix
    products (so rounding may leave an entry slightly negative)."""
    cross = ((weight.T @ outputs) * values).sum(dim=1)
    return values.square().sum(dim=1) * weight.sum(dim=0) + weight.T @ outputs.square().sum(dim=1) - 2 * cross


def ridge_solve(
    attention: torch.Tensor, targets: torch.Tensor, ridge: float, retries: int = 3
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Minimiser of (9) on a support and its inverse Gram matrix (10): ``G = (P_SᵀP_S + λI)^{-1}``, ``B = G P_Sᵀ Y``.

    Cholesky of ``P_SᵀP_S + λI``; on failure ``λ`` is multiplied by 10, at most ``retries`` times.

    Args:
        attention: ``P_S [N, m]``.
        targets: ``Y [N, d_v + 1]``.
        ridge: ``λ > 0``.

    Returns:
        ``(B [m, d_v + 1], G [m, m], λ used)``.
    """
    return solve_normal_equations(attention.T @ attention, attention.T @ targets, ridge, retries)


def solve_normal_equations(
    gram: torch.Tensor, moments: torch.Tensor, ridge: float, retries: int = 3
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """`ridge_solve` from ``P_SᵀP_S [m, m]`` and ``P_SᵀY [m, d_v + 1]`` (e.g. accumulated over blocks of queries).

    Returns:
        ``(B [m, d_v + 1], G [m, m], λ used)``.
    """
    identity = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    for _ in range(retries + 1):
        factor, info = torch.linalg.cholesky_ex(gram + ridge * identity)
        if info.item() == 0:
            inverse = torch.cholesky_inverse(factor)
            return inverse @ moments, inverse, ridge
        ridge *= 10
    raise torch.linalg.LinAlgError(f"Cholesky of the ridge Gram matrix failed up to λ = {ridge / 10:g}")


def saliency(coefficients: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Compensated deletion cost (11) of every entry of the support: ``s_j = ‖B_j,:‖² / G_jj``.

    Args:
        coefficients: ``B [m, d_v + 1]``.
        inverse: ``G [m, m]``.

    Returns:
        ``[m]``.
    """
    return _deletion_cost(coefficients, inverse.diagonal())


def _deletion_cost(coefficients: torch.Tensor, diagonal: torch.Tensor) -> torch.Tensor:
    """(11) from the rows ``B [r, d_v + 1]`` and the matching diagonal entries ``G_jj [r]``, ``[r]``."""
    return coefficients.square().sum(dim=1) / diagonal


def _complement(size: int, block: torch.Tensor) -> torch.Tensor:
    """Positions of ``range(size)`` not in ``block``, ascending, ``[size − |block|]``."""
    keep = torch.ones(size, dtype=torch.bool, device=block.device)
    keep[block] = False
    return keep.nonzero().squeeze(1)


def downdate_(coefficients: torch.Tensor, inverse: torch.Tensor, block: torch.Tensor) -> None:
    """In place, the compensating update (14) of deleting the rows ``J = block``, on matrices that keep their size.

    ``B ← B − G_:J G_JJ^{-1} B_J``, ``G ← G − G_:J G_JJ^{-1} G_J:``. Restricted to the remaining rows ``R`` this is
    exactly (14); the rows (and columns) of ``J`` become zero up to rounding, and rows already deleted by earlier
    calls hold values that nothing reads. No copy of ``G``: one rank-``|J|`` update, so a caller can delete many
    blocks and drop the dead rows once in a while instead of copying ``G`` at every block (`KVSurgeon.eliminate`).

    Args:
        coefficients: ``B [m, d_v + 1]``, updated in place.
        inverse: ``G [m, m]``, updated in place.
        block: ``J``, LongTensor of distinct rows in ``[0, m)`` not deleted before.
    """
    cross = inverse[:, block]
    solved = torch.linalg.solve(cross[block], torch.cat([coefficients[block], inverse[block]], 1))
    width = coefficients.shape[1]
    coefficients.addmm_(cross, solved[:, :width], alpha=-1)
    inverse.addmm_(cross, solved[:, width:], alpha=-1)


def eliminate_block(
    coefficients: torch.Tensor, inverse: torch.Tensor, block: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Delete the rows ``J = block`` from the support with the exact compensating update (14).

    ``B ← B_R − G_RJ G_JJ^{-1} B_J``, ``G ← G_RR − G_RJ G_JJ^{-1} G_JR`` with ``R`` the remaining rows (kept in
    their order): the minimiser of (9) on ``R`` and its inverse Gram matrix. The inputs are not modified.

    Args:
        coefficients: ``B [m, d_v + 1]``.
        inverse: ``G [m, m]``.
        block: ``J``, LongTensor of distinct row positions in ``[0, m)``.

    Returns:
        ``(B [m − |J|, d_v + 1], G [m − |J|, m − |J|])``.
    """
    coefficients, inverse = coefficients.clone(), inverse.clone()
    downdate_(coefficients, inverse, block)
    return _restrict(coefficients, inverse, _complement(inverse.shape[0], block))


def _restrict(
    coefficients: torch.Tensor, inverse: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B_rows [r, d_v + 1], G_rows,rows [r, r])``, ``G`` symmetrised (rounding of the updates breaks symmetry)."""
    reduced = inverse[rows][:, rows]
    return coefficients[rows], (reduced + reduced.T) / 2


# ---------------------------------------------------------------------------------------------------------------------
# Completing a selection: plain eviction or the shared final refit.


def evict(problem: HeadProblem, indices: torch.Tensor) -> CompactedHead:
    """Plain eviction on ``indices [t]``: bias 0, original values."""
    bias = torch.zeros(indices.numel(), dtype=FLOAT, device=indices.device)
    return CompactedHead(indices, bias, problem.values[indices])


def refit_head(
    problem: HeadProblem, indices: torch.Tensor, bias_bound: float = 3.0, value_shrinkage: float = 0.0
) -> CompactedHead:
    """Shared final refit on the support ``indices [t]``: multipliers (22) in ``[e^-β, e^β]``, then values (23),
    shrunk toward the original values by ``value_shrinkage`` (`fit_values`).

    The biases are rounded to float32, the dtype they are served in, before the value solve.
    """
    weights = fit_multipliers(problem.unnormalized(indices), problem.row_sums, bias_bound)
    bias = weights.log().float().to(FLOAT)
    attention = problem.compacted_attention(indices, bias)
    values = fit_values(attention, problem.outputs, prior=problem.values[indices], shrinkage=value_shrinkage)
    return CompactedHead(indices, bias, values)


def _top(scores: torch.Tensor, count: int, largest: bool = True) -> torch.Tensor:
    """Indices of the ``count`` largest (or smallest) ``scores``, ``[count]``."""
    return torch.topk(scores, count, largest=largest).indices


# ---------------------------------------------------------------------------------------------------------------------
# Methods: one small class each.


class HeadMethod:
    """Interface of a per-head compaction method.

    Class attributes: ``name`` (registry key) and ``needs_queries``. Instances carry the hyperparameters (dataclass
    fields) and ``refit``: whether the selection is completed by the shared final refit (needs ``bias_bound``) or
    by plain eviction. A method implements `select`; one that does more than select-then-complete overrides `compact`.
    """

    name: ClassVar[str]
    needs_queries: ClassVar[bool]
    refit: bool

    def select(self, problem: HeadProblem, budget: int, seed: int) -> torch.Tensor:
        """Kept positions, ``[budget]`` distinct indices in ``[0, T)`` (any order); ``1 <= budget < T``."""
        raise NotImplementedError

    def compact(self, problem: HeadProblem, budget: int, seed: int) -> CompactedHead:
        """Select, sort, then refit or evict; returns float64 bias and values."""
        indices = torch.sort(self.select(problem, budget, seed)).values
        if not self.refit:
            return evict(problem, indices)
        return self.complete(problem, indices, seed)


HEAD_METHODS: dict[str, type[HeadMethod]] = {}


def register(cls: type[HeadMethod]) -> type[HeadMethod]:
    """Class decorator adding a method to `HEAD_METHODS` under its ``name``."""
    HEAD_METHODS[cls.name] = cls
    return cls


@dataclass(frozen=True)
class CalibratedMethod(HeadMethod):
    """A selection rule scored on calibration queries, completed by the shared final refit (unless ``refit=False``).

    Hyperparameters of the completion: ``bias_bound`` β (multipliers in ``[e^-β, e^β]``), ``value_shrinkage`` (see
    `fit_values`), ``refit_guard`` (share of the queries held out to choose, per head, between the refit and plain
    eviction of the same selection; 0, the paper's setting, always refits).
    """

    needs_queries: ClassVar[bool] = True
    refit: bool = True
    bias_bound: float = 3.0
    value_shrinkage: float = 0.0
    refit_guard: float = 0.0

    def __post_init__(self) -> None:
        if not self.bias_bound > 0:
            raise ValueError(f"bias_bound must be > 0, got {self.bias_bound!r}")
        if not 0 <= self.refit_guard < 1:
            raise ValueError(f"refit_guard must be in [0, 1) (0: always refit), got {self.refit_guard!r}")
        if not self.value_shrinkage >= 0:
            raise ValueError(f"value_shrinkage must be >= 0 (0: plain least squares), got {self.value_shrinkage!r}")

    def complete(self, problem: HeadProblem, indices: torch.Tensor, seed: int) -> CompactedHead:
        """The shared final refit on ``indices``; with ``refit_guard = f > 0``, plain eviction instead when the refit,
        fitted on a seeded ``1 - f`` share of the queries, loses more than eviction on the other ``f``."""
        refit = refit_head(problem, indices, self.bias_bound, self.value_shrinkage)
        if not self.refit_guard or problem.queries.shape[0] < 2:
            return refit
        fit, check = problem.split(self.refit_guard, seed)
        trial = refit_head(fit, indices, self.bias_bound, self.value_shrinkage)
        if check.relative_loss(trial) <= check.relative_loss(evict(check, indices)):
            return refit
        return evict(problem, indices)


@register
@dataclass(frozen=True)
class LeaveOneOut(CalibratedMethod):
    """LOO baseline: the ``t`` largest leave-one-out scores (13)."""

    name: ClassVar[str] = "loo"

    def select(self, problem: HeadProblem, budget: int, seed: int) -> torch.Tensor:
        return _top(problem.loo, budget)


@register
@dataclass(frozen=True)
class KVSurgeon(CalibratedMethod):
    """KV-Surgeon, Algorithm 1: compensation-aware greedy block elimination on the quadratic surrogate (9).

    Hyperparameters: ``pool_factor`` c, ``block_size`` n_b, ``relative_ridge`` λ0, ``mass_weight`` γ0,
    ``fallback_threshold`` τ (heads with ``t > τT`` keep the top-``t`` LOO entries, bias 0, original values).
    """

    name: ClassVar[str] = "kv_surgeon"
    pool_factor: float = 4.0
    block_size: int = 32
    relative_ridge: float = 0.01
    mass_weight: float = 1.0
    fallback_threshold: float = 0.3

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.pool_factor >= 1:
            raise ValueError(f"pool_factor must be >= 1, got {self.pool_factor!r}")
        check_int("block_size", self.block_size, 1)
        if not self.relative_ridge > 0:
            raise ValueError(f"relative_ridge must be > 0, got {self.relative_ridge!r}")
        if not self.mass_weight >= 0:
            raise ValueError(f"mass_weight must be >= 0, got {self.mass_weight!r}")
        if not self.fallback_threshold >= 0:
            raise ValueError(f"fallback_threshold must be >= 0, got {self.fallback_threshold!r}")

    def compact(self, problem: HeadProblem, budget: int, seed: int) -> CompactedHead:
        if budget > self.fallback_threshold * problem.length:
            return evict(problem, torch.sort(_top(problem.loo, budget)).values)
        return super().compact(problem, budget, seed)

    def select(self, problem: HeadProblem, budget: int, seed: int) -> torch.Tensor:
        pool = _top(problem.loo, min(problem.length, math.ceil(self.pool_factor * budget)))
        coefficients, inverse = self.surrogate(problem, pool)
        return pool[self.eliminate(coefficients, inverse, budget)]

    def surrogate(self, problem: HeadProblem, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(B [m, d_v + 1], G [m, m])`` of (10) on the pool, ``Y = [O γ1]``, ``λ = λ0 tr(P_SᵀP_S) / m``; the
        normal equations are accumulated over blocks of queries (no ``[N, m]`` matrix)."""
        outputs = problem.outputs
        gamma = self.mass_weight * outputs.square().sum(dim=1).mean().sqrt()
        targets = torch.cat([outputs, gamma * outputs.new_ones(outputs.shape[0], 1)], dim=1)
        gram = outputs.new_zeros(pool.numel(), pool.numel())
        moments = outputs.new_zeros(pool.numel(), targets.shape[1])
        for rows in problem.query_blocks(pool.numel()):
            columns = problem.attention_columns(pool, rows)
            gram.addmm_(columns.T, columns)
            moments.addmm_(columns.T, targets[rows])
        ridge = max(self.relative_ridge * gram.trace().item() / pool.numel(), torch.finfo(FLOAT).eps)
        coefficients, inverse, _ = solve_normal_equations(gram, moments, ridge)
        return coefficients, inverse

    def eliminate(self, coefficients: torch.Tensor, inverse: torch.Tensor, budget: int) -> torch.Tensor:
        """Greedy block elimination (11), (14) until ``budget`` rows remain; returns the kept pool positions.

        Blocks are deleted in place (`downdate_`); the matrices are cut down to the live rows whenever those are at
        most ``SHRINK_AT`` of the stored ones, so the cost is a rank-``n_b`` update per block, not a copy of ``G``.
        """
        kept = torch.arange(inverse.shape[0], device=inverse.device)
        live = kept.clone()
        coefficients, inverse = coefficients.clone(), inverse.clone()
        while kept.numel() > budget:
            if live.numel() <= SHRINK_AT * inverse.shape[0]:
                coefficients, inverse = _restrict(coefficients, inverse, live)
                live = torch.arange(live.numel(), device=live.device)
            scores = _deletion_cost(coefficients[live], inverse.diagonal()[live])
            block = _top(scores, min(self.block_size, kept.numel() - budget), largest=False)
            downdate_(coefficients, inverse, live[block])
            rest = _complement(kept.numel(), block)
            kept, live = kept[rest], live[rest]
        return kept


@register
@dataclass(frozen=True)
class KVSurgeonNoCompensation(KVSurgeon):
    """Ablation "KV-Surgeon w/o compensation": rank the pool once by the saliency (11), keep the top ``t``."""

    name: ClassVar[str] = "kv_surgeon_nocomp"

    def eliminate(self, coefficients: torch.Tensor, inverse: torch.Tensor, budget: int) -> torch.Tensor:
        return _top(saliency(coefficients, inverse), budget)


@dataclass(frozen=True)
class QueryFreeMethod(HeadMethod):
    """A selection rule that needs no calibration queries and evicts (bias 0, original values)."""

    needs_queries: ClassVar[bool] = False
    refit: ClassVar[bool] = False


@register
@dataclass(frozen=True)
class RandomSelection(QueryFreeMethod):
    """``t`` positions drawn uniformly without replacement (seeded)."""

    name: ClassVar[str] = "random"

    def select(self, problem: HeadProblem, budget: int, seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return torch.randperm(problem.length, generator=generator)[:budget].to(problem.keys.device)


@register
@dataclass(frozen=True)
class StreamingLLM(QueryFreeMethod):
    """StreamingLLM: the first ``sink_tokens`` attention sinks and the most recent entries."""

    name: ClassVar[str] = "streaming_llm"
    sink_tokens: int = 4

    def __post_init__(self) -> None:
        check_int("sink_tokens", self.sink_tokens, 0)

    def select(self, problem: HeadProblem, budget: int, seed: int) -> torch.Tensor:
        sinks = min(self.sink_tokens, budget)
        device = problem.keys.device
        recent = torch.arange(problem.length - (budget - sinks), problem.length, device=device)
        return torch.cat([torch.arange(sinks, device=device), recent])


@register
@dataclass(frozen=True)
class KeyNorm(QueryFreeMethod):
    """L2 key-norm heuristic: keep the ``t`` keys of smallest norm."""

    name: ClassVar[str] = "key_norm"

    def select(self, problem: HeadProblem, budget: int, seed: int) -> torch.Tensor:
        return _top(problem.keys.norm(dim=1), budget, largest=False)


# ---------------------------------------------------------------------------------------------------------------------
# Ported baselines (seed §4.1, appendix "Ported baselines"): each keeps its published selection score, computed on the
# shared calibration queries, and (calibrated ones) serves its support with the shared final refit.


def obcache_scores(attention: torch.Tensor, values: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """OBCache saliency, the Optimal-Brain-Damage diagonal ``H_jj = Σ_i P_ij² ‖v_j − o_i‖²`` (seed appendix §7.1).

    The second-order truncation of the exact single-deletion score (13): the factor ``(1 − P_ij)^{-2}`` is dropped.

    Args:
        attention: ``P [N, T]``.
        values: ``V [T, D_v]``.
        outputs: ``O [N, D_v]``.

    Returns:
        ``[T]``.
    """
    return _obcache_terms(attention, values, outputs).clamp_min(0)


def _obcache_terms(attention: torch.Tensor, values: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """The OBCache sum over the rows given, before clamping, ``[T]``: sums over blocks of rows add up to the whole."""
    return _weighted_distances(attention.square(), values, outputs)


def omp_select(columns: torch.Tensor, target: torch.Tensor, count: int, per_step: int = 1) -> torch.Tensor:
    """Orthogonal matching pursuit: ``count`` columns of ``columns`` that greedily reconstruct ``target``.

    Each step scores every unselected column by its correlation with the residual, ``⟨a_j, r⟩ / ‖a_j‖`` (signed:
    the columns are nonnegative and the coefficients are to be positive multipliers), in one matrix-vector product,
    takes the ``per_step`` best, then refits the target by unconstrained least squares on all selected columns
    (``r = target − A_S A_S⁺ target``, kept as a projection on an incrementally grown orthonormal basis, classical
    Gram–Schmidt applied twice; a column already in the span of the selected ones adds no direction). With
    ``per_step = 1`` this is textbook OMP; ``per_step > 1`` is the cheap-solver setting (several keys per step, fewer
    correlation passes).

    Args:
        columns: ``A [N, T]``.
        target: ``[N]``.
        count: ``1 <= count <= T``.
        per_step: columns selected per correlation pass.

    Returns:
        ``[count]`` distinct column indices in the order they were selected.
    """
    rows, length = columns.shape
    norms = columns.norm(dim=0)
    inverse_norms = torch.where(norms > 0, 1 / norms.clamp_min(torch.finfo(columns.dtype).tiny), 0)
    basis = columns.new_zeros(rows, min(rows, count))
    rank = 0
    residual = target.clone()
    available = torch.ones(length, dtype=torch.bool, device=columns.device)
    selected: list[torch.Tensor] = []
    remaining = count
    while remaining > 0:
        correlation = (columns.T @ residual * inverse_norms).masked_fill(~available, -math.inf)
        block = _top(correlation, min(per_step, remaining))
        available[block] = False
        selected.append(block)
        remaining -= block.numel()
        for j in block.tolist():  # Gram–Schmidt of the new columns: part of the greedy step
            if rank == basis.shape[1] or norms[j] == 0:
                continue
            span = basis[:, :rank]
            direction = columns[:, j] - span @ (span.T @ columns[:, j])
            direction = direction - span @ (span.T @ direction)
            length_j = direction.norm()
            if length_j > 1e-8 * norms[j]:
                direction = direction / length_j
                basis[:, rank] = direction
                rank += 1
                residual = residual - direction * (direction @ residual)
    return torch.cat(selected)


@register
@dataclass(frozen=True)
class AttentionMatchingHAK(CalibratedMethod):
    """AM-HAK (Zweiger et al., "highest attention keys"): the ``t`` largest RMS attentions ``sqrt(mean_i P_ij²)``."""

    name: ClassVar[str] = "am_hak"

    def select(self, problem: HeadProblem, budget: int, seed: int) -> torch.Tensor:
        squares = problem.reduce_columns(lambda block, rows: block.square().sum(dim=0))
        return _top((squares / problem.queries.shape[0]).sqrt(), budget)


@register
@dataclass(frozen=True)
class AttentionMatchingOMP(CalibratedMethod):
    """AM-OMP (Zweiger et al.): OMP (`omp_select`) on the attention mass.

    Columns ``E = exp(Z − rowmax Z)`` and target the row sums ``s``, the mass regression of the shared multiplier
    fit (22): the selected keys' reweighted unnormalised attention reproduces the mass of the full cache. The
    per-step refit is unconstrained least squares (no NNLS); the positive multipliers come from the final refit.
    ``keys_per_step > 1`` selects several keys per correlation pass (the AM-OMP-CS / "fast" setting).
    """

    name: ClassVar[str] = "am_omp"
    keys_per_step: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("keys_per_step", self.keys_per_step, 1)

    def select(self, problem: HeadProblem, budget: int, seed: int) -> torch.Tensor:
        columns = problem.unnormalized()
        return omp_select(columns, problem.row_sums, budget, self.keys_per_step)


@register
@dataclass(frozen=True)
class HeavyHitters(CalibratedMethod):
    """H2O ported: the ``t`` largest accumulated attentions ``Σ_i P_ij`` over the calibration queries.

    ``recent_tokens`` (default 0: the seed's port keeps only the selection score) reserves
    ``min(recent_tokens, t)`` of the budget for the most recent positions, H2O's recent window.
    """

    name: ClassVar[str] = "h2o"
    recent_tokens: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("recent_tokens", self.recent_tokens, 0)

    def select(self, problem: HeadProblem, budget: int, seed: int) -> torch.Tensor:
        recent = min(self.recent_tokens, budget)
        older = problem.length - recent
        heavy = _top(problem.reduce_columns(lambda block, rows: block[:, :older].sum(dim=0)), budget - recent)
        return torch.cat([heavy, torch.arange(older, problem.length, device=problem.keys.device)])


@register
@dataclass(frozen=True)
class OBCache(CalibratedMethod):
    """OBCache ported: the ``t`` largest second-order saliencies `obcache_scores`, aggregated over the calibration
    queries (which replace the published observation window of the last 64 prompt tokens)."""

    name: ClassVar[str] = "obcache"

    def select(self, problem: HeadProblem, budget: int, seed: int) -> torch.Tensor:
        scores = problem.reduce_columns(
            lambda block, rows: _obcache_terms(block, problem.values, problem.outputs[rows])
        )
        return _top(scores.clamp_min(0), budget)


@register
@dataclass(frozen=True)
class KVzip(CalibratedMethod):
    """KVzip ported: the ``t`` largest maximum attentions ``max_i P_ij`` received during the repeat pass (the
    calibration queries); the shared per-head budgets replace KVzip's global threshold."""

    name: ClassVar[str] = "kvzip"

    def select(self, problem: HeadProblem, budget: int, seed: int) -> torch.Tensor:
        return _top(problem.reduce_columns(lambda block, rows: block.amax(dim=0), torch.maximum), budget)


@register
@dataclass(frozen=True)
class KVMerger(CalibratedMethod):
    """KVMerger ported: merge runs of similar adjacent keys into ``t`` groups, keep one pivot per group.

    Groups: cut the sequence at the ``t − 1`` adjacent pairs of lowest key cosine similarity, so ``t`` contiguous
    groups remain. This equals greedily merging the most similar adjacent pair until ``t`` groups remain, with the
    similarity of two neighbouring groups that of the two keys at their boundary (KVMerger's thresholded run rule,
    with the threshold set by the budget). Pivot: the group's entry of largest accumulated attention ``Σ_i P_ij``
    (lowest position on ties). Merged value: the group's values averaged with weights ``Σ_i P_ij`` (uniform where
    the group's attention underflows to zero). With the refit (default) the value solve (23) replaces the merged
    values, so the merge only decides the support; ``refit=False`` serves the pivots with the merged values and
    bias 0.
    """

    name: ClassVar[str] = "kvmerger"

    def groups(self, problem: HeadProblem, budget: int) -> torch.Tensor:
        """Group of every position, ``[T]`` LongTensor, nondecreasing from 0 to ``budget − 1``."""
        keys = problem.keys
        similarity = torch.nn.functional.cosine_similarity(keys[:-1], keys[1:], dim=1)
        starts = torch.zeros(problem.length, dtype=torch.long, device=keys.device)
        starts[_top(similarity, budget - 1, largest=False) + 1] = 1
        return starts.cumsum(dim=0)

    def merge(self, problem: HeadProblem, budget: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pivots [t] ascending, merged values [t, D_v])``."""
        group = self.groups(problem, budget)
        scores = problem.reduce_columns(lambda block, rows: block.sum(dim=0))
        best = scores.new_full((budget,), -math.inf).scatter_reduce(0, group, scores, "amax")
        positions = torch.arange(problem.length, device=scores.device)
        is_best = scores == best[group]
        pivots = positions.new_full((budget,), problem.length)
        pivots = pivots.scatter_reduce(0, group[is_best], positions[is_best], "amin")
        totals = scores.new_zeros(budget).index_add(0, group, scores)
        weights = torch.where(totals[group] > 0, scores, torch.ones_like(scores))
        totals = scores.new_zeros(budget).index_add(0, group, weights)
        merged = problem.values.new_zeros(budget, problem.values.shape[1]).index_add(
            0, group, weights[:, None] * problem.values
        )
        return pivots, merged / totals[:, None]

    def select(self, problem: HeadProblem, budget: int, seed: int) -> torch.Tensor:
        return self.merge(problem, budget)[0]

    def compact(self, problem: HeadProblem, budget: int, seed: int) -> CompactedHead:
        pivots, merged = self.merge(problem, budget)
        if self.refit:
            return refit_head(problem, pivots, self.bias_bound, self.value_shrinkage)
        return CompactedHead(pivots, torch.zeros(budget, dtype=FLOAT, device=pivots.device), merged)


@register
@dataclass(frozen=True)
class QFilters(HeadMethod):
    """Q-Filters (Godey et al.): keep the ``t`` keys of largest projection ``⟨k_j, u⟩`` on the principal query
    direction ``u``, evicting (bias 0, original values, no refit).

    ``u`` is the top right singular vector of ``Q`` (top eigenvector of ``QᵀQ``, not centred), signed so that
    ``Σ_i ⟨q_i, u⟩ >= 0``; then ``E_q⟨q, k⟩ ∝ ⟨k, u⟩`` along that direction, so the kept keys are those the
    queries are expected to attend to most. Published Q-Filters estimate ``u`` once per model on generic text;
    lacking a per-model filter file, this port estimates it per head from the calibration queries, hence
    ``needs_queries``. Selection never reads the attention.
    """

    name: ClassVar[str] = "q_filters"
    needs_queries: ClassVar[bool] = True
    refit: ClassVar[bool] = False

    def direction(self, problem: HeadProblem) -> torch.Tensor:
        """``u [D]``, unit norm."""
        queries = problem.queries
        if queries is None:
            raise ValueError("q_filters needs calibration queries to estimate its filter, got queries=None")
        direction = torch.linalg.eigh(queries.T @ queries).eigenvectors[:, -1]
        return -direction if (queries @ direction).sum() < 0 else direction

    def select(self, problem: HeadProblem, budget: int, seed: int) -> torch.Tensor:
        return _top(problem.keys @ self.direction(problem), budget)


# ---------------------------------------------------------------------------------------------------------------------
# Public entry points.


def compact_head(
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor | None,
    budget: int,
    method: str = "kv_surgeon",
    scaling: float | None = None,
    seed: int = 0,
    **hparams: object,
) -> CompactedHead:
    """Compact one KV head to ``min(budget, T)`` entries.

    Args:
        keys: ``[T, D]`` post-RoPE keys of the head.
        values: ``[T, D_v]``.
        queries: ``[N, D]`` post-RoPE calibration queries (for GQA the stacked queries of the group); may be None
            for query-free methods (then ``train_loss`` is None).
        budget: kept entries ``t >= 1``; ``t >= T`` keeps everything (bias 0, values unchanged).
        method: a key of `HEAD_METHODS`.
        scaling: logit scale, default ``1/sqrt(D)``.
        seed: for randomised methods.
        **hparams: the method's hyperparameters (fields of its class, e.g. ``pool_factor=4`` or ``refit=False``).

    Returns:
        `CompactedHead` with float32 bias and values in ``values.dtype``, on the inputs' device.
    """
    if method not in HEAD_METHODS:
        raise ValueError(f"method must be one of {sorted(HEAD_METHODS)}, got {method!r}")
    rule = HEAD_METHODS[method](**hparams)
    budget = check_int("budget", budget, 1, counts="kept entries")
    if queries is None and rule.needs_queries:
        raise ValueError(f"method {method!r} needs calibration queries, got queries=None")
    problem = HeadProblem.build(keys, values, queries, scaling)
    if budget >= problem.length:
        head = evict(problem, torch.arange(problem.length, device=problem.keys.device))
    else:
        head = rule.compact(problem, budget, seed)
    head = CompactedHead(head.indices, head.bias.float(), head.values.to(values.dtype))
    return replace(head, train_loss=None if problem.queries is None else problem.relative_loss(head))


def relative_loss(
    head: CompactedHead,
    keys: torch.Tensor,
    queries: torch.Tensor,
    values: torch.Tensor,
    scaling: float | None = None,
) -> float:
    """``L(S, w, V̂) / ‖O‖_F²`` (4) of ``head`` on ``queries [N, D]`` (e.g. held out), against the full ``keys [T, D]``
    and ``values [T, D_v]`` the head was compacted from."""
    if not isinstance(head, CompactedHead):
        raise TypeError(f"head must be a CompactedHead, got {type(head).__name__}")
    return HeadProblem.build(keys, values, queries, scaling).relative_loss(head)
