"""`AttentionMass`: optional per-slot attention statistics of a `StructuredMixedPrecisionCache`, for attention-based
retention baselines (H2O, SnapKV, MiKV, CriticalKV; `hf_structkv.policy.baselines`).

Per layer group, the probability mass each cached slot has received, summed over the group's layers, all query heads
and the counted query rows (`attention_mass` in the torch reference, a second pass over the same partitions after
attention: the attention output is untouched). Off by default: a cache records it only when its policy asks
(``policy.attention_statistics()``). Recording runs in the torch reference only; with the Triton backend it raises.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..validation import check_bool, check_int


class TokenStatistics(NamedTuple):
    """What an attention-based controller sees when it decides a generated token.

    Attributes:
        position: the token's absolute slot.
        mass: FP32 ``[groups, n]`` accumulated attention mass of slots ``0 .. n - 1`` of the token's sequence, per
            layer group (released slots keep the mass they received before release).
    """

    position: int
    mass: torch.Tensor


class AttentionMass:
    """Accumulated attention mass per layer group and slot, for a batch of sequences.

    Args:
        num_groups: layer groups (3).
        observation_window: ``None`` counts every query row of every forward (H2O, MiKV); ``k >= 1`` counts only the
            last ``k`` query rows of the first forward, the prompt (SnapKV's observation window), and nothing after;
            ``0`` records no mass at all, only which prompt slots are real (StreamingLLM).
        value_weighted: also accumulate each head's mass multiplied by the entry's projected value norm
            ``||v_j W_o^h||_1`` (CriticalKV; `weighted_row_mass`).
    """

    def __init__(self, num_groups: int = 3, observation_window: int | None = None, value_weighted: bool = False):
        self.num_groups = check_int("num_groups", num_groups, 1)
        self.observation_window = check_int("observation_window", observation_window, 0, none_ok=True)
        self.value_weighted = check_bool("value_weighted", value_weighted)
        self.mass: list[torch.Tensor | None] = [None] * num_groups
        self.weighted: list[torch.Tensor | None] = [None] * num_groups
        self.prompt_real: torch.Tensor | None = None

    @property
    def records_mass(self) -> bool:
        """Whether attention mass is computed at all (not for ``observation_window == 0``)."""
        return self.observation_window != 0

    def counted_rows(self, start: int, q_len: int) -> slice | None:
        """The query rows of a forward whose first row sits at slot ``start`` that add mass (``None``: none)."""
        if not self.records_mass:
            return None
        if self.observation_window is None:
            return slice(0, q_len)
        return slice(max(0, q_len - self.observation_window), q_len) if start == 0 else None

    def set_prompt(self, real: torch.Tensor) -> None:
        """Record bool ``[B, P]``: which prompt slots hold real tokens (not padding); first forward only."""
        if self.prompt_real is None:
            self.prompt_real = real.detach().to("cpu", torch.bool).clone()

    def add(self, group: int, slot_mass: torch.Tensor, weighted: torch.Tensor | None = None) -> None:
        """Add FP32 ``[B, n]`` mass of slots ``0 .. n - 1`` to ``group`` (and, with ``value_weighted``, the
        value-weighted mass ``weighted`` ``[B, n]``, required then)."""
        if self.value_weighted != (weighted is not None):
            raise ValueError(f"weighted mass must be given exactly when value_weighted ({self.value_weighted})")
        _accumulate(self.mass, group, slot_mass)
        if weighted is not None:
            _accumulate(self.weighted, group, weighted)

    def row_mass(self, row: int, num_slots: int) -> torch.Tensor:
        """FP32 ``[groups, num_slots]`` mass of sequence ``row`` (slots never attended: 0)."""
        return _row(self.mass, row, num_slots)

    def weighted_row_mass(self, row: int, num_slots: int) -> torch.Tensor:
        """FP32 ``[groups, num_slots]`` value-weighted mass of sequence ``row`` (``value_weighted`` only)."""
        if not self.value_weighted:
            raise ValueError("this AttentionMass records no value-weighted mass (value_weighted=False)")
        return _row(self.weighted, row, num_slots)

    def select_rows(self, indices: torch.Tensor) -> None:
        """Batch row ``i`` becomes old row ``indices[i]``."""
        indices = indices.cpu()
        self.mass = [None if mass is None else mass[indices] for mass in self.mass]
        self.weighted = [None if mass is None else mass[indices] for mass in self.weighted]
        if self.prompt_real is not None:
            self.prompt_real = self.prompt_real[indices]


def _accumulate(store: list[torch.Tensor | None], group: int, slot_mass: torch.Tensor) -> None:
    """``store[group] += slot_mass`` (``[B, n]``, moved to FP32 on the CPU), padding the stored slots as they grow."""
    slot_mass = slot_mass.detach().to("cpu", torch.float32)
    current = store[group]
    if current is None:
        store[group] = slot_mass.clone()
        return
    if current.shape[1] < slot_mass.shape[1]:
        current = torch.nn.functional.pad(current, (0, slot_mass.shape[1] - current.shape[1]))
    current[:, : slot_mass.shape[1]] += slot_mass
    store[group] = current


def _row(store: list[torch.Tensor | None], row: int, num_slots: int) -> torch.Tensor:
    """FP32 ``[groups, num_slots]`` of sequence ``row`` of ``store`` (slots never recorded: 0)."""
    out = torch.zeros(len(store), num_slots)
    for group, mass in enumerate(store):
        if mass is not None:
            n = min(num_slots, mass.shape[1])
            out[group, :n] = mass[row, :n]
    return out
