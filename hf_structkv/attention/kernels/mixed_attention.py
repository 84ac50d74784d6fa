"""Triton attention over the disjoint partitions of a mixed-precision cache layer (PASK B.5, eq. 15).

It computes what ``hf_structkv.attention.mixed_reference.mixed_precision_attention`` computes. Each partition (a
dense store in the query dtype, a packed-INT4 store with one FP16 scale per token x KV-head row, the recent region)
is read in place by its own launch of `attention_kernel` (no prefix; the partition's visibility as a boolean mask;
an INT4 store with centred keys, `hf_structkv.quant.int4_centred`, is read as codes too: its launch reads the query
``q ⊙ s`` and the logit shift ``q · μ`` shared by all its entries is added to its softmax statistics afterwards,
``q · k̂ = (q ⊙ s) · (code · scale) + q · μ``; with soft-capping, which no shift commutes with, it is dequantised to
the query dtype first), split along its keys (split-KV for long histories); every (partition, split) writes FP32
softmax statistics into one shared buffer, and `merge_splits_kernel` merges them all (eq. 15).
"""

from __future__ import annotations

import torch

from ..mixed_reference import DensePartition, Int4Partition
from .attention_kernel import MASK_BOOL, KeyStore, run_attention
from .runtime import check_num_splits, check_runs_on, check_tensor


def _check_partition(index: int, part: object, query: torch.Tensor, value_dim: int) -> None:
    """Shapes, dtypes and device of ``partitions[index]`` against the query ``[B, H_q, q, D]``."""
    batch, _, q_len, head_dim = query.shape
    name = f"partitions[{index}]"
    if isinstance(part, DensePartition):
        check_tensor(f"{name}.keys", part.keys, 4)
        check_tensor(f"{name}.values", part.values, 4)
        for field in ("keys", "values"):
            if getattr(part, field).dtype != query.dtype:
                raise TypeError(
                    f"{name}.{field} has dtype {getattr(part, field).dtype} but query has {query.dtype}: cast them "
                    "to one dtype"
                )
        n_kv, n = part.keys.shape[1], part.keys.shape[2]
        shapes = {"keys": (part.keys, head_dim), "values": (part.values, value_dim)}
    else:
        for field in ("key_codes", "value_codes"):
            check_tensor(f"{name}.{field}", getattr(part, field), 4, dtypes=(torch.uint8,))
        for field in ("key_scales", "value_scales"):
            check_tensor(f"{name}.{field}", getattr(part, field), 4, dtypes=(torch.float16,))
        if part.head_dim != head_dim or part.value_dim != value_dim:
            raise ValueError(
                f"{name} holds head_dim {part.head_dim} / value_dim {part.value_dim}, expected {head_dim} / {value_dim}"
            )
        n_kv, n = part.key_codes.shape[1], part.key_codes.shape[2]
        shapes = {
            "key_codes": (part.key_codes, (head_dim + 1) // 2),
            "value_codes": (part.value_codes, (value_dim + 1) // 2),
            "key_scales": (part.key_scales, 1),
            "value_scales": (part.value_scales, 1),
        }
        if (part.key_centre is None) != (part.key_spread is None):
            raise ValueError(f"{name}: key_centre and key_spread come together (centred keys) or not at all")
        for field in ("key_centre", "key_spread") if part.centred else ():
            t = check_tensor(f"{name}.{field}", getattr(part, field), 4, dtypes=(torch.float16,))
            if tuple(t.shape) != (batch, n_kv, 1, head_dim):
                raise ValueError(
                    f"{name}.{field} must be [B={batch}, H_kv={n_kv}, 1, D={head_dim}], got {tuple(t.shape)}"
                )
            if t.device != query.device:
                raise ValueError(
                    f"{name}.{field} is on {t.device} but query is on {query.device}: move them to one device"
                )
    for field, (t, width) in shapes.items():
        if tuple(t.shape) != (batch, n_kv, n, width):
            raise ValueError(f"{name}.{field} must be [B={batch}, H_kv={n_kv}, n={n}, {width}], got {tuple(t.shape)}")
    check_tensor(f"{name}.visible", part.visible, 3, dtypes=(torch.bool,))
    if tuple(part.visible.shape) != (batch, q_len, n):
        raise ValueError(f"{name}.visible must be [B={batch}, q={q_len}, n={n}], got {tuple(part.visible.shape)}")
    for field, t in [*((f, t) for f, (t, _) in shapes.items()), ("visible", part.visible)]:
        if t.device != query.device:
            raise ValueError(f"{name}.{field} is on {t.device} but query is on {query.device}: move them to one device")


def _key_store(part: DensePartition | Int4Partition, query: torch.Tensor, scaling: float) -> KeyStore:
    """The partition as the kernel reads it: its tensors, its visibility as a boolean mask; for centred INT4 keys
    the query ``q ⊙ s`` ``[B, H_q, q, D]`` (query dtype) and the FP32 logit shift ``q · μ · scaling``
    ``[B, H_q, q]``, ``s`` / ``μ`` of each query head's KV head."""
    visible = part.visible.view(torch.uint8)
    if not isinstance(part, Int4Partition):
        return KeyStore(part.keys, part.values, MASK_BOOL, visible)
    store = KeyStore(part.key_codes, part.value_codes, MASK_BOOL, visible, part.key_scales, part.value_scales)
    if not part.centred:
        return store
    group = query.shape[1] // part.num_kv_heads
    spread = part.key_spread.float().repeat_interleave(group, dim=1)  # [B, H_q, 1, D]
    centre = part.key_centre.float().repeat_interleave(group, dim=1)
    scaled = (query.float() * spread).to(query.dtype)
    return store._replace(query=scaled, logit_shift=(query.float() * centre).sum(-1) * scaling)


def _dequantised(part: DensePartition | Int4Partition, dtype: torch.dtype) -> DensePartition | Int4Partition:
    """``part`` with centred INT4 keys dequantised to ``dtype`` (a dense store), others as they are."""
    if not isinstance(part, Int4Partition) or not part.centred:
        return part
    keys, values = part.float_keys_values()
    return DensePartition(keys.to(dtype), values.to(dtype), part.visible)


def _num_keys(part: DensePartition | Int4Partition) -> int:
    return part.visible.shape[-1]


def triton_mixed_precision_attention(
    query: torch.Tensor,
    partitions: list[DensePartition | Int4Partition],
    scaling: float,
    softcap: float | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """``mixed_precision_attention`` with one launch of `attention_kernel` per non-empty partition: the same
    arguments and ``num_splits``, the same result up to floating-point rounding.

    Args:
        query: ``[B, H_q, q, D]`` post-RoPE queries (fp32, fp16 or bf16); ``H_q`` a multiple of ``H_kv``.
        partitions: ``DensePartition`` (keys / values in the query dtype) and ``Int4Partition`` (packed codes,
            FP16 scales); each with its bool visibility ``[B, q, n]``; empty ones contribute nothing.
        scaling: logit scale; softcap: optional tanh soft-capping (None or 0: none).
        num_splits: about how many key splits in all (over the partitions, merged afterwards); ``None`` chooses
            from the device (one per non-empty partition on CPU).

    Returns:
        ``[B, q, H_q, D_v]`` in ``query.dtype``; a row that sees no key gets zeros.
    """
    check_tensor("query", query, 4)
    if not isinstance(partitions, (list, tuple)) or not partitions:
        raise ValueError("partitions must be a non-empty list of DensePartition / Int4Partition")
    check_runs_on(query.device)
    check_num_splits(num_splits)
    batch, n_q_heads, q_len, head_dim = query.shape
    for index, part in enumerate(partitions):
        if not isinstance(part, (DensePartition, Int4Partition)):
            raise TypeError(
                f"partitions[{index}] must be a DensePartition or an Int4Partition, got {type(part).__name__}"
            )
    if softcap:  # a logit shift does not commute with soft-capping: centred keys are dequantised
        partitions = [_dequantised(part, query.dtype) for part in partitions]
    first = partitions[0]
    value_dim = (
        first.value_dim
        if isinstance(first, Int4Partition)
        else check_tensor("partitions[0].values", first.values, 4).shape[-1]
    )
    for index, part in enumerate(partitions):
        _check_partition(index, part, query, value_dim)
    n_kv_heads = first.num_kv_heads
    if any(part.num_kv_heads != n_kv_heads for part in partitions) or n_q_heads % n_kv_heads:
        raise ValueError(
            f"{n_q_heads} query heads cannot be grouped over the partitions' KV heads "
            f"{[part.num_kv_heads for part in partitions]}"
        )

    out = torch.zeros(batch, q_len, n_q_heads, value_dim, dtype=query.dtype, device=query.device)
    active = [_key_store(part, query, scaling) for part in partitions if _num_keys(part) > 0]
    if out.numel() == 0 or not active:
        return out
    return run_attention(query, out, active, scaling, softcap, num_splits)
