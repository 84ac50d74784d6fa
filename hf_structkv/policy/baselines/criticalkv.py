"""CriticalKV (Feng et al., 2025, "Identify Critical KV Cache in LLM Inference from an Output Perturbation
Perspective") as a retention policy of the mixed-precision cache: SnapKV's prompt selection, re-ranked by how much
removing an entry would perturb the attention output.

Removing entry ``j`` perturbs head ``h``'s contribution to the residual stream by about ``a_hj · v_j W_o^h``, so
CriticalKV scores an entry by ``Σ_h a_hj · ||v_j W_o^h||_1`` (attention weight times the L1 norm of the value as the
output projection writes it) instead of the attention weight alone, and selects in two stages: the first
``⌊ε·k⌋`` of the ``k`` kept prompt tokens by attention (SnapKV's pooled score), the other ``k - ⌊ε·k⌋`` by the
pooled output-perturbation score among the rest. Adaptation to this cache, as for SnapKV: one decision per token
and layer group (scores summed over the group's layers and heads, from the observation window of the prompt
forward); generated tokens stay ``H``. The kept count, hence the measured ``B``, is SnapKV's with the same knobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...attention.attention_mass import AttentionMass
from .base import check_ratio
from .heavy_hitters import heavy_count
from .snapkv import SnapKV, top_first

__all__ = ["CriticalKV"]


@dataclass(frozen=True)
class CriticalKV(SnapKV):
    """CriticalKV on the mixed-precision cache (module docstring).

    Args:
        costs, observation_window, pooling, kernel, prompt_ratio (the budget knob), window, sink_tokens: as `SnapKV`.
        first_stage_ratio: ``ε``, the share of the kept prompt tokens chosen by attention alone (the rest by the
            output-perturbation score); 1 is SnapKV, 0 the perturbation score alone.
    """

    first_stage_ratio: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "first_stage_ratio", check_ratio("first_stage_ratio", self.first_stage_ratio))

    def attention_statistics(self) -> AttentionMass:
        """Mass and value-weighted mass from the last ``observation_window`` prompt queries only."""
        return AttentionMass(len(self.costs.groups), observation_window=self.observation_window, value_weighted=True)

    def select(self, pooled: torch.Tensor, weighted: torch.Tensor | None, keep: int) -> torch.Tensor:
        """The two stages (module docstring) over pooled scores ``[m]``: ``⌊ε·keep⌋`` by ``pooled``, then the
        largest ``weighted`` among the others."""
        if weighted is None:
            raise ValueError("CriticalKV selects from value-weighted attention statistics: use it in a cache")
        first = top_first(pooled, heavy_count(self.first_stage_ratio, keep))
        rest = torch.ones_like(pooled, dtype=torch.bool)
        rest[first] = False
        others = rest.nonzero().flatten()
        return torch.cat([first, others[top_first(weighted[others], keep - len(first))]])
