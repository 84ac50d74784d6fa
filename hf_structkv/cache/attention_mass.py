"""`AttentionMass`: optional per-slot attention statistics of a `StructuredMixedPrecisionCache`, for attention-based
retention baselines (H2O, SnapKV, MiKV; `hf_structkv.policy.baselines`).

Per layer group, the probability mass each cached slot has received, summed over the group's layers, all query heads
and the counted query rows (`attention_mass` in the torch reference, a second pass over the same partitions after
attention: the attention output is untouched). Off by default: a cache records it only when its policy asks
(``policy.attention_statistics()``). Recording runs in the torch reference only; with the Triton backend it raises.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..validation import check_int


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
    """

    def __init__(self, num_groups: int = 3, observation_window: int | None = None):
        self.num_groups = check_int("num_groups", num_groups, 1)
        self.observation_window = check_int("observation_window", observation_window, 0, none_ok=True)
        self.mass: list[torch.Tensor | None] = [None] * num_groups
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

    def add(self, group: int, slot_mass: torch.Tensor) -> None:
        """Add FP32 ``[B, n]`` mass of slots ``0 .. n - 1`` to ``group``."""
        slot_mass = slot_mass.detach().to("cpu", torch.float32)
        current = self.mass[group]
        if current is None:
            self.mass[group] = slot_mass.clone()
            return
        if current.shape[1] < slot_mass.shape[1]:
            current = torch.nn.functional.pad(current, (0, slot_mass.shape[1] - current.shape[1]))
        current[:, : slot_mass.shape[1]] += slot_mass
        self.mass[group] = current

    def row_mass(self, row: int, num_slots: int) -> torch.Tensor:
        """FP32 ``[groups, num_slots]`` mass of sequence ``row`` (slots never attended: 0)."""
        out = torch.zeros(self.num_groups, num_slots)
        for group, mass in enumerate(self.mass):
            if mass is not None:
                n = min(num_slots, mass.shape[1])
                out[group, :n] = mass[row, :n]
        return out

    def select_rows(self, indices: torch.Tensor) -> None:
        """Batch row ``i`` becomes old row ``indices[i]``."""
        indices = indices.cpu()
        self.mass = [None if mass is None else mass[indices] for mass in self.mass]
        if self.prompt_real is not None:
            self.prompt_real = self.prompt_real[indices]
