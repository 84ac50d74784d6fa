"""Score-based selection: keep the ``t`` entries of largest score over the calibration queries, then the shared
final refit (``design/ALGORITHMS.md`` §1, "Baselines sharing the same pool of code").

LOO (13), H2O (accumulated attention), OBCache (second-order saliency) and KVzip (maximum attention during the repeat
pass), each keeping its published selection score, computed on the shared calibration queries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..validation import check_int
from .head_method import CalibratedMethod, top_indices
from .head_statistics import HeadProblem, weighted_distances


def obcache_scores(attention: torch.Tensor, values: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """OBCache saliency, the Optimal-Brain-Damage diagonal ``H_jj = Σ_i P_ij² ‖v_j − o_i‖²`` (seed appendix §7.1).

    The second-order truncation of the exact single-deletion score (13): the factor ``(1 − P_ij)^{-2}`` is dropped.
    From ``attention`` ``P [N, T]``, ``values`` ``V [T, D_v]`` and ``outputs`` ``O [N, D_v]``; returns ``[T]``.
    """
    return _obcache_terms(attention, values, outputs).clamp_min(0)


def _obcache_terms(attention: torch.Tensor, values: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """The OBCache sum over the rows given, before clamping, ``[T]``: sums over blocks of rows add up to the whole."""
    return weighted_distances(attention.square(), values, outputs)


@dataclass(frozen=True)
class LeaveOneOut(CalibratedMethod):
    """LOO baseline: the ``t`` largest leave-one-out scores (13)."""

    name: ClassVar[str] = "loo"

    def select(self, problem: HeadProblem, budget: int, seed: int) -> torch.Tensor:
        return top_indices(problem.loo, budget)


@dataclass(frozen=True)
class H2OCompaction(CalibratedMethod):
    """H2O ported: the ``t`` largest accumulated attentions ``Σ_i P_ij`` over the calibration queries (the offline
    counterpart of the decode-time `hf_structkv.policy.baselines.H2O`).

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
        heavy = top_indices(problem.reduce_columns(lambda block, rows: block[:, :older].sum(dim=0)), budget - recent)
        return torch.cat([heavy, torch.arange(older, problem.length, device=problem.keys.device)])


@dataclass(frozen=True)
class OBCache(CalibratedMethod):
    """OBCache ported: the ``t`` largest second-order saliencies `obcache_scores`, aggregated over the calibration
    queries (which replace the published observation window of the last 64 prompt tokens)."""

    name: ClassVar[str] = "obcache"

    def select(self, problem: HeadProblem, budget: int, seed: int) -> torch.Tensor:
        scores = problem.reduce_columns(
            lambda block, rows: _obcache_terms(block, problem.values, problem.outputs[rows])
        )
        return top_indices(scores.clamp_min(0), budget)


@dataclass(frozen=True)
class KVzip(CalibratedMethod):
    """KVzip ported: the ``t`` largest maximum attentions ``max_i P_ij`` received during the repeat pass (the
    calibration queries); the shared per-head budgets replace KVzip's global threshold."""

    name: ClassVar[str] = "kvzip"

    def select(self, problem: HeadProblem, budget: int, seed: int) -> torch.Tensor:
        return top_indices(problem.reduce_columns(lambda block, rows: block.amax(dim=0), torch.maximum), budget)
