"""The attention-matching family (Zweiger et al.): AM-HAK (highest attention keys) and AM-OMP (orthogonal matching
pursuit on the attention mass), each completed by the shared final refit (``design/ALGORITHMS.md`` §1, "Baselines
sharing the same pool of code").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..validation import check_int
from .head_method import CalibratedMethod, top_indices
from .head_statistics import HeadProblem


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
        block = top_indices(correlation, min(per_step, remaining))
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


@dataclass(frozen=True)
class AttentionMatchingHAK(CalibratedMethod):
    """AM-HAK (Zweiger et al., "highest attention keys"): the ``t`` largest RMS attentions ``sqrt(mean_i P_ij²)``."""

    name: ClassVar[str] = "am_hak"

    def select(self, problem: HeadProblem, budget: int, seed: int) -> torch.Tensor:
        squares = problem.reduce_columns(lambda block, rows: block.square().sum(dim=0))
        return top_indices((squares / problem.queries.shape[0]).sqrt(), budget)


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
