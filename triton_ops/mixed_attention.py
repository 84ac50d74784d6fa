"""Triton kernel for attention over the disjoint partitions of a mixed-precision cache layer (PASK B.5, eq. 15).

It computes what ``hf_structkv.attention.mixed_reference.mixed_precision_attention`` computes. Each partition (a
dense store in the query dtype, a packed-INT4 store with one FP16 scale per token x KV-head row, the recent region)
is read in place by its own launch, split along its keys (split-KV for long histories); every (partition, split)
writes FP32 softmax statistics into one shared buffer, and `merge_splits_kernel` merges them all (eq. 15). INT4 rows
are dequantised in registers: the codes (small integers, exact in fp16/bf16) go through the dot products and the
scales multiply the scores (keys) and the softmax weights (values), which is the same sum as ``code * scale``.

A program owns one (batch row, KV head), a block of rows of the flattened ``[group query heads x queries]`` matrix
(GQA: keys are never repeated) and one split of one partition's keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_structkv.attention.mixed_reference import DensePartition, Int4Partition

from .runtime import check_num_splits, check_runs_on, check_tensor
from .softmax_stats import (
    BLOCK_N,
    SplitStats,
    auto_splits,
    launch_options,
    online_softmax_step,
    query_rows,
    row_block_size,
    scores,
    stats_arguments,
    stats_dot,
    store_result,
)


@triton.jit
def _load_rows(
    base, cols, col_ok, stride_n, stride_d, width, BLOCK_W: tl.constexpr, INT4: tl.constexpr, dtype: tl.constexpr
):
    """Rows ``cols`` of a ``[n, width]`` tile: the values themselves, or the signed INT4 codes (as ``dtype``) of
    packed rows ``[n, ceil(width / 2)]`` (element ``2j`` in the low nibble of byte ``j``, ``2j + 1`` in the high)."""
    w = tl.arange(0, BLOCK_W)
    ok = col_ok[:, None] & (w < width)[None, :]
    if INT4:
        packed = tl.load(base + cols[:, None] * stride_n + (w // 2)[None, :] * stride_d, mask=ok, other=0)
        nibble = (packed.to(tl.int32) >> ((w % 2) * 4)[None, :]) & 15
        # Through FP32 (exact for these small integers): the interpreter's int -> bf16 cast is wrong (Triton 3.9).
        tile = ((nibble ^ 8) - 8).to(tl.float32).to(dtype)
    else:
        tile = tl.load(base + cols[:, None] * stride_n + w[None, :] * stride_d, mask=ok, other=0.0)
    return tile


@triton.jit
def _partition_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_scale_ptr,
    v_scale_ptr,
    visible_ptr,
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    scaling,
    softcap,
    n_kv_heads,
    group,
    q_len,
    n_rows,
    n_keys,
    split_len,
    split_base,
    n_stat_splits,
    head_dim,
    value_dim,
    stride_qb,
    stride_qh,
    stride_qs,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_ksb,
    stride_ksh,
    stride_ksn,
    stride_vsb,
    stride_vsh,
    stride_vsn,
    stride_visb,
    stride_visq,
    stride_visn,
    stride_ob,
    stride_oq,
    stride_oh,
    stride_od,
    INT4: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    WRITE_PARTIALS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    split = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = pid_bh // n_kv_heads
    h = pid_bh % n_kv_heads
    q, rows, row_ok, i, head = query_rows(
        q_ptr, b, h, group, q_len, n_rows, head_dim, stride_qb, stride_qh, stride_qs, stride_qd, BLOCK_M, BLOCK_D
    )
    dv = tl.arange(0, BLOCK_DV)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    exp_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    k_base = k_ptr + b * stride_kb + h * stride_kh
    v_base = v_ptr + b * stride_vb + h * stride_vh
    lo = split * split_len
    hi = tl.minimum(lo + split_len, n_keys)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        k = _load_rows(k_base, cols, col_ok, stride_kn, stride_kd, head_dim, BLOCK_D, INT4, q.dtype)
        v = _load_rows(v_base, cols, col_ok, stride_vn, stride_vd, value_dim, BLOCK_DV, INT4, q.dtype)
        visible = row_ok[:, None] & col_ok[None, :]
        visible_ptrs = visible_ptr + b * stride_visb + i[:, None] * stride_visq + cols[None, :] * stride_visn
        visible = visible & (tl.load(visible_ptrs, mask=visible, other=0) != 0)
        if INT4:
            k_scale = tl.load(k_scale_ptr + b * stride_ksb + h * stride_ksh + cols * stride_ksn, mask=col_ok, other=0)
            v_scale = tl.load(v_scale_ptr + b * stride_vsb + h * stride_vsh + cols * stride_vsn, mask=col_ok, other=0)
            s = scores(q, k, scaling * k_scale.to(tl.float32)[None, :], softcap, USE_SOFTCAP, DOT_PRECISION)
        else:
            s = scores(q, k, scaling, softcap, USE_SOFTCAP, DOT_PRECISION)
        m, exp_sum, alpha, p = online_softmax_step(m, exp_sum, tl.where(visible, s, float("-inf")))
        if INT4:
            p = p * v_scale.to(tl.float32)[None, :]
        acc = acc * alpha[:, None] + stats_dot(p.to(v.dtype), v, DOT_PRECISION)

    store_result(
        m,
        exp_sum,
        acc,
        out_ptr,
        part_m_ptr,
        part_l_ptr,
        part_acc_ptr,
        b,
        head,
        i,
        rows,
        row_ok,
        dv,
        dv < value_dim,
        split_base + split,
        n_stat_splits,
        stride_ob,
        stride_oq,
        stride_oh,
        stride_od,
        WRITE_PARTIALS,
        BLOCK_M,
        BLOCK_DV,
    )


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
    for field, (t, width) in shapes.items():
        if tuple(t.shape) != (batch, n_kv, n, width):
            raise ValueError(f"{name}.{field} must be [B={batch}, H_kv={n_kv}, n={n}, {width}], got {tuple(t.shape)}")
    check_tensor(f"{name}.visible", part.visible, 3, dtypes=(torch.bool,))
    if tuple(part.visible.shape) != (batch, q_len, n):
        raise ValueError(f"{name}.visible must be [B={batch}, q={q_len}, n={n}], got {tuple(part.visible.shape)}")
    for field, t in [*((f, t) for f, (t, _) in shapes.items()), ("visible", part.visible)]:
        if t.device != query.device:
            raise ValueError(f"{name}.{field} is on {t.device} but query is on {query.device}: move them to one device")


def _partition_tensors(part: DensePartition | Int4Partition):
    """``(keys, values, key_scales, value_scales)`` as the kernel reads them (scales None for a dense partition)."""
    if isinstance(part, Int4Partition):
        return part.key_codes, part.value_codes, part.key_scales, part.value_scales
    return part.keys, part.values, None, None


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
    """Triton version of ``mixed_precision_attention`` (same arguments, same result up to floating-point rounding).

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
    active = [part for part in partitions if _num_keys(part) > 0]
    if out.numel() == 0 or not active:
        return out
    group = n_q_heads // n_kv_heads
    n_rows = group * q_len
    block_m = row_block_size(n_rows)
    block_dv = max(16, triton.next_power_of_2(value_dim))
    row_blocks = triton.cdiv(n_rows, block_m)
    total_keys = sum(_num_keys(part) for part in active)
    if num_splits is None:
        num_splits = auto_splits(query.device, row_blocks * batch * n_kv_heads, total_keys)
    split_len = max(BLOCK_N, triton.cdiv(triton.cdiv(total_keys, num_splits), BLOCK_N) * BLOCK_N)
    splits = [triton.cdiv(_num_keys(part), split_len) for part in active]
    stats = None
    if sum(splits) > 1:
        stats = SplitStats(batch * n_kv_heads, sum(splits), row_blocks, block_m, block_dv, query.device)
    split_base = 0
    for part, n_splits in zip(active, splits):
        keys, values, key_scales, value_scales = _partition_tensors(part)
        is_int4 = key_scales is not None
        key_scales = query if key_scales is None else key_scales  # any tensor: a dense launch reads no scale
        value_scales = query if value_scales is None else value_scales
        visible = part.visible.view(torch.uint8)
        _partition_kernel[(row_blocks, n_splits, batch * n_kv_heads)](
            query,
            keys,
            values,
            key_scales,
            value_scales,
            visible,
            out,
            *stats_arguments(stats, out),
            float(scaling),
            float(softcap or 1.0),
            n_kv_heads,
            group,
            q_len,
            n_rows,
            _num_keys(part),
            split_len,
            split_base,
            sum(splits),
            head_dim,
            value_dim,
            *query.stride(),
            *keys.stride(),
            *values.stride(),
            *key_scales.stride()[:3],
            *value_scales.stride()[:3],
            *visible.stride(),
            *out.stride(),
            INT4=is_int4,
            **launch_options(query, softcap, stats, head_dim, block_m, block_dv),
        )
        split_base += n_splits
    if stats is not None:
        stats.merge_into(out, n_kv_heads, group, block_m)
    return out
