"""Retention actions, layer groups and scheduled payload costs (PASK §3.2, A.2, B.3).

Costs are in bits per token: for layer group ``c`` with ``n_c = 2 Σ_l H_kv,l d_l`` K/V elements and
``k_c = 2 Σ_l H_kv,l`` K/V rows, ``m(R, c) = 0``, ``m(H, c) = 16 n_c`` and ``m(L, c) = 4 n_c + 16 k_c + 4 p_c`` with
``p_c = 2 Σ_l H_kv,l (d_l mod 2)`` padding nibbles for odd head dimensions. ``C_full = Σ_c m(H, c)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from ..validation import check_int


class Action(IntEnum):
    """What happens to a token's K/V in one layer group once it leaves the recent window; ordered ``R < L < H``."""

    R = 0
    """Release: the entry is dropped."""
    L = 1
    """Low precision: packed INT4 codes with one FP16 scale per token x KV-head row."""
    H = 2
    """High precision: kept in BF16 (the model's dtype in the torch reference)."""


GROUP_NAMES = ("lower", "middle", "upper")
TIED_GROUP_NAME = "all"
GROUP_COUNTS = (3, 1)
"""The layer groupings a policy may use: PASK's three groups (A.2), or one group of every layer (the Fig. 5
"no layer groups" ablation, which ties a token's action across depth; payload costs add up over layers, so one group
of all layers costs exactly what three groups with the same action cost)."""


def check_group_count(count: int) -> None:
    """Raise ``ValueError`` unless ``count`` is one of `GROUP_COUNTS`."""
    if isinstance(count, bool) or count not in GROUP_COUNTS:
        raise ValueError(
            f"layer_groups must be 3 (PASK's lower / middle / upper groups) or 1 (every layer one group: the "
            f"no-layer-groups ablation), got {count!r}"
        )


def group_names(count: int) -> tuple[str, ...]:
    """The names of ``count`` layer groups: ``("lower", "middle", "upper")`` or ``("all",)``."""
    check_group_count(count)
    return GROUP_NAMES if count == 3 else (TIED_GROUP_NAME,)


def layer_groups(num_layers: int, count: int = 3) -> tuple[range, ...]:
    """The lower / middle / upper layer groups ``[0, b1), [b1, b2), [b2, L)`` with ``b1 = ⌊(L+2)/3⌋`` and
    ``b2 = ⌊(2L+2)/3⌋`` (A.2); with ``count=1`` the single group ``[0, L)``."""
    check_int("num_layers", num_layers, 1)
    check_group_count(count)
    if count == 1:
        return (range(0, num_layers),)
    b1, b2 = (num_layers + 2) // 3, (2 * num_layers + 2) // 3
    return range(0, b1), range(b1, b2), range(b2, num_layers)


@dataclass(frozen=True)
class GroupCosts:
    """Per-token scheduled payload costs of the layer groups (three, or one in the no-layer-groups ablation), in bits.

    Attributes:
        groups: the layer indices of each group (`layer_groups`).
        elements: ``n_c`` per group; rows: ``k_c``; padding: ``p_c``.
    """

    groups: tuple[range, ...]
    elements: tuple[int, ...]
    rows: tuple[int, ...]
    padding: tuple[int, ...]

    @classmethod
    def from_dims(cls, kv_heads: list[int], head_dims: list[int], groups: int = 3) -> GroupCosts:
        """Costs for layers with ``kv_heads[l]`` KV heads of dimension ``head_dims[l]``, in ``groups`` layer groups
        (`GROUP_COUNTS`)."""
        if len(kv_heads) != len(head_dims) or not kv_heads:
            raise ValueError("kv_heads and head_dims must be non-empty lists with one entry per layer")
        ranges = layer_groups(len(kv_heads), groups)
        elements = tuple(2 * sum(kv_heads[i] * head_dims[i] for i in g) for g in ranges)
        rows = tuple(2 * sum(kv_heads[i] for i in g) for g in ranges)
        padding = tuple(2 * sum(kv_heads[i] * (head_dims[i] % 2) for i in g) for g in ranges)
        return cls(ranges, elements, rows, padding)

    @classmethod
    def from_config(cls, config, groups: int = 3) -> GroupCosts:
        """Costs for a transformers model config (``num_hidden_layers``, ``num_key_value_heads``, ``head_dim``) in
        ``groups`` layer groups (`GROUP_COUNTS`)."""
        config = getattr(config, "get_text_config", lambda: config)()
        n_layers = config.num_hidden_layers
        kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls.from_dims([kv] * n_layers, [head_dim] * n_layers, groups)

    def group_of_layer(self, layer_idx: int) -> int:
        """The index (0, 1, 2; 0 with one group) of the group holding ``layer_idx``."""
        for c, group in enumerate(self.groups):
            if layer_idx in group:
                return c
        raise ValueError(f"layer_idx {layer_idx} is outside the model's {self.groups[-1].stop} layers")

    def cost(self, action: Action, group: int) -> int:
        """``m(action, group)`` in bits."""
        if action == Action.H:
            return 16 * self.elements[group]
        if action == Action.L:
            return 4 * self.elements[group] + 16 * self.rows[group] + 4 * self.padding[group]
        return 0

    def total(self, actions) -> int:
        """``M(a) = Σ_c m(a_c, c)`` for one action per group."""
        return sum(self.cost(Action(a), c) for c, a in enumerate(actions))

    @property
    def full(self) -> int:
        """``C_full = Σ_c m(H, c)``: the bits of one token kept at full precision in every layer."""
        return sum(16 * n for n in self.elements)
