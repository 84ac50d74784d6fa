"""KVMerger ported (``design/ALGORITHMS.md`` §1, "Baselines sharing the same pool of code"): merge runs of similar
adjacent keys into pivots."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from .head_method import CalibratedMethod, refit_head, top_indices
from .head_statistics import FLOAT, CompactedHead, HeadProblem


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
        starts[top_indices(similarity, budget - 1, largest=False) + 1] = 1
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
