"""What one compacted KV head costs in bytes, per storage format, and the most entries a byte budget buys.

Counted as `CompactedCache` counts its context (``cache/compacted_layers.py``): every stored tensor's bytes and, per
KV head, one int64 row offset (``prefix_offsets`` has ``H_kv + 1`` entries per layer: the extra one is the layer's,
not a head's). Kept positions are not stored. Per kept entry:

- ``"bf16"``: key and value rows in the cache's dtype (``element_bytes`` each element: 2 for BF16/FP16) and an FP32
  bias: ``(D_k + D_v) · element_bytes + 4`` bytes.
- ``"int4"``: packed key and value codes (``ceil(D_k / 2) + ceil(D_v / 2)`` bytes), an FP16 value scale (2) and an FP32
  bias (4); plus, per group of ``key_group`` kept entries (one group per head when ``key_group`` is None), one row
  of ``D_k`` FP16 key scales and one of ``D_k`` FP16 key offsets (``4 D_k`` bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..validation import check_int

STORAGES = ("bf16", "int4")
"""The storage formats of a compacted head."""

BIAS_BYTES = 4
"""One FP32 logit bias per kept entry."""

OFFSET_BYTES = 8
"""One int64 row offset per KV head."""

SCALE_BYTES = 2
"""One FP16 scale."""


STORAGE_CHOICES = (*STORAGES, "auto")
"""What a head compacted within a byte budget may be asked for: a format, or ``"auto"`` (the better of both)."""


def check_storage(storage: object, allowed: tuple[str, ...] = STORAGES) -> str:
    """``storage`` if it is one of ``allowed``, else ValueError naming the argument."""
    if storage not in allowed:
        raise ValueError(f"storage must be one of {list(allowed)}, got {storage!r}")
    return storage


@dataclass(frozen=True)
class StorageLayout:
    """The byte layout of one compacted KV head.

    Attributes:
        storage: ``"bf16"`` (keys and values in the cache's dtype) or ``"int4"``.
        key_dim: ``D_k``.
        value_dim: ``D_v``.
        element_bytes: bytes per key or value element for ``"bf16"`` (2: BF16 / FP16; 4 for an FP32 cache).
        key_group: ``"int4"`` only: kept entries per row of key scales and offsets, None for one row per head.
    """

    storage: str
    key_dim: int
    value_dim: int
    element_bytes: int = 2
    key_group: int | None = None

    def __post_init__(self) -> None:
        check_storage(self.storage)
        check_int("key_dim", self.key_dim, 1, counts="key channels")
        check_int("value_dim", self.value_dim, 1, counts="value channels")
        check_int("element_bytes", self.element_bytes, 1, counts="bytes per bf16-storage element")
        check_int("key_group", self.key_group, 1, counts="kept entries per row of key scales", none_ok=True)

    def nbytes(self, entries: int) -> int:
        """Bytes of a head with ``entries`` kept entries (``OFFSET_BYTES`` alone for none)."""
        entries = check_int("entries", entries, 0, counts="kept entries")
        if self.storage == "bf16":
            per_entry = (self.key_dim + self.value_dim) * self.element_bytes + BIAS_BYTES
            return entries * per_entry + OFFSET_BYTES
        codes = (self.key_dim + 1) // 2 + (self.value_dim + 1) // 2
        groups = 0 if entries == 0 else -(-entries // (self.key_group or entries))
        per_group = 2 * self.key_dim * SCALE_BYTES  # scales and offsets
        return entries * (codes + SCALE_BYTES + BIAS_BYTES) + groups * per_group + OFFSET_BYTES

    def entries_for(self, nbytes: int) -> int:
        """The most kept entries whose `nbytes` is at most ``nbytes`` (0 when not even one fits)."""
        nbytes = check_int("nbytes", nbytes, 0, counts="bytes")
        low, high = 0, max(0, nbytes)  # every entry costs at least one byte
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if self.nbytes(middle) <= nbytes else (low, middle - 1)
        return low
