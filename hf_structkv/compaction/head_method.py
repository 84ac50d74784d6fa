"""The interface of a per-head compaction method and the two ways a selection is completed.

A method (`HeadMethod`) selects the kept positions of one KV head; `CalibratedMethod` completes its selection with
the shared final refit (`refit_head`, ``design/ALGORITHMS.md`` §1 Algorithm 1 step 5), `QueryFreeMethod` with plain
eviction (`evict`: bias 0, original values). The methods themselves live in one module per family (`kv_surgeon`,
`score_eviction`, `attention_matching`, `kv_merger`, `query_free`); `head_compaction` registers them by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .head_statistics import FLOAT, CompactedHead, HeadProblem
from .refit import fit_multipliers, fit_values


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


def top_indices(scores: torch.Tensor, count: int, largest: bool = True) -> torch.Tensor:
    """Indices of the ``count`` largest (or smallest) ``scores``, ``[count]``."""
    return torch.topk(scores, count, largest=largest).indices


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


@dataclass(frozen=True)
class QueryFreeMethod(HeadMethod):
    """A selection rule that needs no calibration queries and evicts (bias 0, original values)."""

    needs_queries: ClassVar[bool] = False
    refit: ClassVar[bool] = False
