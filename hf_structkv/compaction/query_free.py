"""Selection without the attention, completed by plain eviction (bias 0, original values, no refit):
StreamingLLM (sinks + recent), L2 key norm, random, and Q-Filters (``design/ALGORITHMS.md`` §1, "Baselines sharing
the same pool of code").

Q-Filters reads the calibration queries only to estimate its filter direction (published Q-Filters estimate it once
per model), so unlike the other three it needs queries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..validation import check_int
from .head_method import HeadMethod, QueryFreeMethod, top_indices
from .head_statistics import HeadProblem


@dataclass(frozen=True)
class RandomSelection(QueryFreeMethod):
    """``t`` positions drawn uniformly without replacement (seeded)."""

    name: ClassVar[str] = "random"

    def select(self, problem: HeadProblem, budget: int, seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        return torch.randperm(problem.length, generator=generator)[:budget].to(problem.keys.device)


@dataclass(frozen=True)
class StreamingLLMCompaction(QueryFreeMethod):
    """StreamingLLM: the first ``sink_tokens`` attention sinks and the most recent entries (the offline counterpart
    of the decode-time `hf_structkv.policy.baselines.StreamingLLM`)."""

    name: ClassVar[str] = "streaming_llm"
    sink_tokens: int = 4

    def __post_init__(self) -> None:
        check_int("sink_tokens", self.sink_tokens, 0)

    def select(self, problem: HeadProblem, budget: int, seed: int) -> torch.Tensor:
        sinks = min(self.sink_tokens, budget)
        device = problem.keys.device
        recent = torch.arange(problem.length - (budget - sinks), problem.length, device=device)
        return torch.cat([torch.arange(sinks, device=device), recent])


@dataclass(frozen=True)
class KeyNorm(QueryFreeMethod):
    """L2 key-norm heuristic: keep the ``t`` keys of smallest norm."""

    name: ClassVar[str] = "key_norm"

    def select(self, problem: HeadProblem, budget: int, seed: int) -> torch.Tensor:
        return top_indices(problem.keys.norm(dim=1), budget, largest=False)


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
        return top_indices(problem.keys @ self.direction(problem), budget)
