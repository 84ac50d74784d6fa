"""`SlotStore`: per-batch-row storage of cache entries that keeps each entry's absolute position (a slot map).

Entries of different batch rows arrive independently (one row releases a token that another keeps), so every row
fills its own slots from the front; the tensors are padded to the longest row. A bulk append (a prompt leaving the
recent window) allocates exactly what it needs; later appends grow the capacity by ``max(grow, capacity / 32)``
slots at a time (at most ~3% unused capacity on long histories, one copy per ``grow`` appends on short ones).
The padding is real memory: `nbytes` counts the allocated capacity, `num_entries` the live entries.
"""

from __future__ import annotations

import torch

from ..validation import check_int


class SlotStore:
    """Named fields ``[B, H_kv, capacity, w]`` plus ``positions`` ``[B, capacity]`` (int32, ``-1`` = empty slot).

    Within a row, entries are stored in the order they were appended, which is increasing position.

    Args:
        grow: the fewest slots added when a small append needs room.
    """

    def __init__(self, grow: int = 16):
        self.grow = check_int("grow", grow, 1, counts="slots")
        self.fields: dict[str, torch.Tensor] = {}
        self.positions: torch.Tensor | None = None
        self.counts: list[int] = []

    @property
    def capacity(self) -> int:
        return 0 if self.positions is None else self.positions.shape[1]

    def num_entries(self) -> int:
        """Live entries over all rows."""
        return sum(self.counts)

    def longest_row(self) -> int:
        return max(self.counts, default=0)

    def _initialize(self, new_fields: dict[str, torch.Tensor]) -> None:
        first = next(iter(new_fields.values()))
        self.counts = [0] * first.shape[0]
        self.positions = torch.full((first.shape[0], 0), -1, dtype=torch.int32, device=first.device)
        self.fields = {name: t[:, :, :0].clone() for name, t in new_fields.items()}

    def _reserve(self, needed: int) -> None:
        """Make room for ``needed`` slots: exactly for a bulk append, else ``grow`` more slots."""
        if needed <= self.capacity:
            return
        extra = max(needed, self.capacity + max(self.grow, self.capacity // 32)) - self.capacity
        self.positions = torch.nn.functional.pad(self.positions, (0, extra), value=-1)
        self.fields = {
            name: torch.cat([t, t.new_zeros((*t.shape[:2], extra, *t.shape[3:]))], dim=2)
            for name, t in self.fields.items()
        }

    def append(self, new_fields: dict[str, torch.Tensor], positions: torch.Tensor, take: torch.Tensor) -> None:
        """Append, per row ``b``, the entries ``j`` with ``take[b, j]``.

        Args:
            new_fields: the same names as before, each ``[B, H_kv, k, w]``.
            positions: ``[k]`` integer absolute positions of the ``k`` candidate entries (shared by the rows).
            take: bool ``[B, k]``.
        """
        if not bool(take.any()):
            return
        if self.positions is None:
            self._initialize(new_fields)
        per_row = take.sum(dim=1).tolist()
        self._reserve(max(c + n for c, n in zip(self.counts, per_row)))
        for b, n in enumerate(per_row):
            if n == 0:
                continue
            chosen = take[b].nonzero().squeeze(1)
            start = self.counts[b]
            for name, tensor in new_fields.items():
                self.fields[name][b, :, start : start + n] = tensor[b, :, chosen]
            self.positions[b, start : start + n] = positions[chosen]
            self.counts[b] += n

    def view(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The fields cut to the longest row ``[B, H_kv, n, w]`` and ``positions`` ``[B, n]`` (``-1`` = empty)."""
        n = self.longest_row()
        return {name: t[:, :, :n] for name, t in self.fields.items()}, self.positions[:, :n]

    def crop(self, length: int) -> None:
        """Drop the entries at positions ``>= length``."""
        if self.positions is None:
            return
        for b in range(len(self.counts)):
            kept = int((self.positions[b, : self.counts[b]] < length).sum())
            self.positions[b, kept : self.counts[b]] = -1
            self.counts[b] = kept

    def select_rows(self, indices: torch.Tensor) -> None:
        """Keep / reorder / repeat batch rows: row ``i`` becomes old row ``indices[i]``."""
        if self.positions is None:
            return
        self.positions = self.positions.index_select(0, indices.to(self.positions.device))
        self.fields = {name: t.index_select(0, indices.to(t.device)) for name, t in self.fields.items()}
        self.counts = [self.counts[i] for i in indices.tolist()]

    def nbytes(self) -> int:
        """Allocated bytes: every field and the slot map, padding included."""
        tensors = list(self.fields.values()) + ([] if self.positions is None else [self.positions])
        return sum(t.numel() * t.element_size() for t in tensors)
