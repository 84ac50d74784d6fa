"""KV-Surgeon (Algorithm 1 of the seed, ``design/ALGORITHMS.md`` §1) and its key ablation, w/o compensation.

A LOO-prefiltered pool, compensation-aware greedy block elimination on the quadratic surrogate (`surrogate.py`), then
the shared final refit; heads compacted mildly (``t > τT``) fall back to the top-``t`` LOO entries, evicted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..validation import check_int
from .head_method import CalibratedMethod, evict, top_indices
from .head_statistics import FLOAT, CompactedHead, HeadProblem
from .surrogate import eliminate_greedily, saliency, solve_normal_equations


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
            return evict(problem, torch.sort(top_indices(problem.loo, budget)).values)
        return super().compact(problem, budget, seed)

    def select(self, problem: HeadProblem, budget: int, seed: int) -> torch.Tensor:
        pool = top_indices(problem.loo, min(problem.length, math.ceil(self.pool_factor * budget)))
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
        """The kept pool positions ``[budget]``: greedy block elimination of ``block_size`` rows at a time
        (`eliminate_greedily`)."""
        return eliminate_greedily(coefficients, inverse, budget, self.block_size)


@dataclass(frozen=True)
class KVSurgeonNoCompensation(KVSurgeon):
    """Ablation "KV-Surgeon w/o compensation": rank the pool once by the saliency (11), keep the top ``t``."""

    name: ClassVar[str] = "kv_surgeon_nocomp"

    def eliminate(self, coefficients: torch.Tensor, inverse: torch.Tensor, budget: int) -> torch.Tensor:
        return top_indices(saliency(coefficients, inverse), budget)
