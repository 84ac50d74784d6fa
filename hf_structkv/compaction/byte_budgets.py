"""Byte budgets of the KV heads of one chunk for ``compact(storage="int4" | "auto")``: ``ratio`` is the byte ratio
against the full cache in the model's dtype, and the bytes are spent.

A head whose entry budget is ``t`` (`HeadBudgets` / `UniformBudgets`) is owed the bytes of ``t`` keys and values in
the model's dtype, ``t · (D + D_v) · e`` (``e`` bytes per element: 2 for BF16 / FP16, 4 for FP32); the chunk's total
``Σ_h t_h · (D + D_v) · e`` is ``1/ratio`` of its full keys and values. A head cannot spend more than the bytes of all
its ``T`` entries in INT4 (`StorageLayout`), which is below that share when its budget is large: in an FP32 model an
INT4 entry costs about a sixth of a dtype entry (``D = 64``, key groups of 32), so a head given more than about
``T / 6`` entries used to leave the rest unspent, and the shipped allocation, which gives some heads up to 3/4 of the
context, made ``ratio=4`` store 9.6x fewer bytes. Here:

- the total is shared among the heads in proportion to their entry budgets, each head capped at the bytes of its
  whole head in INT4 (`water_fill`: a capped head's excess goes to the others in proportion);
- when every head is capped and bytes are left (``ratio`` below the whole cache's INT4 ratio, 6.6 in FP32 and 3.3 in
  BF16), ``"auto"`` keeps whole heads in the dtype, heaviest budget first, while the rest pays for one; ``"int4"``
  stores every head whole in INT4 and reaches only that ratio.

Each head spends at most its bytes (`compact_head_to_bytes` keeps the most entries that fit), so the achieved byte
ratio is at least ``ratio`` and above it by at most one entry and one row of key scales per head (and the unspent rest
under ``"auto"``'s last step, or ``"int4"`` below its ratio).
"""

from __future__ import annotations

from ..user_warnings import warn_user
from .budgets import largest_remainder, water_fill
from .head_storage import StorageLayout, check_storage

__all__ = ["head_byte_budgets"]


def head_byte_budgets(
    entry_budgets: dict[int, list[int]],
    length: int,
    key_dim: int,
    value_dim: int,
    element_bytes: int,
    storage: str,
    key_group: int | None,
) -> dict[int, list[int]]:
    """The byte budget of each KV head of a chunk of ``length`` tokens.

    Args:
        entry_budgets: ``{global layer: [kept entries per KV head]}`` (each ``>= 1``) in the model's dtype.
        key_dim, value_dim: ``D``, ``D_v`` of every global layer.
        element_bytes: bytes per key or value element in the model's dtype.
        storage: ``"int4"`` or ``"auto"``.
        key_group: kept entries per row of INT4 key scales (None: one row per head).

    Returns:
        ``{global layer: [bytes per KV head]}`` (ints ``>= 1``), summing to at most the bytes of the entry budgets
        (exactly them when no head is capped; the water-filled shares rounded by largest remainder).

    Warns:
        UserWarning: ``"int4"`` when the bytes exceed those of every head whole in INT4: the heads then store fewer
            bytes than asked (a higher byte ratio, fitted to their own bytes), and the warning names ``"auto"``,
            which spends them.
    """
    check_storage(storage, ("int4", "auto"))
    layers = list(entry_budgets)
    weights = [t for layer in layers for t in entry_budgets[layer]]
    entry_bytes = (key_dim + value_dim) * element_bytes
    total = sum(weights) * entry_bytes
    whole_int4 = StorageLayout("int4", key_dim, value_dim, key_group=key_group).nbytes(length)
    if total <= len(weights) * whole_int4:
        shares = largest_remainder(water_fill(weights, total, 1.0, float(whole_int4)), total, whole_int4)
    else:
        shares = [whole_int4] * len(weights)
        if storage == "int4":
            warn_user(
                f"storage='int4' keeps every KV head whole in INT4, {length * entry_bytes / whole_int4:.2f}x fewer "
                f"bytes than in the model's dtype: that is all INT4 can store, more compression than the ratio asked "
                f"for (the heads are fitted to their own bytes); storage='auto' spends the bytes asked for"
            )
        if storage == "auto":
            whole_dtype = StorageLayout("bf16", key_dim, value_dim, element_bytes).nbytes(length)
            left = total - len(weights) * whole_int4
            for h in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
                if left < whole_dtype - whole_int4:
                    break
                shares[h] = whole_dtype
                left -= whole_dtype - whole_int4
    out, start = {}, 0
    for layer in layers:
        out[layer] = shares[start : start + len(entry_budgets[layer])]
        start += len(entry_budgets[layer])
    return out
