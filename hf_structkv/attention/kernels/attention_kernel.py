"""The one attention kernel behind both wrappers: a block of query rows over [compacted prefix ‖ a store of keys].

A program owns one (batch row ``b``, KV head ``h``) pair, a block of rows of the flattened ``[group query heads x
queries]`` matrix of that KV head (GQA: keys are never repeated) and one split of the keys of the logical sequence
``[prefix of head h ‖ keys of (b, h) in the store]``. The prefix (optional) is a `CompactedPrefix`: ragged per KV head,
shared by the batch, every entry visible, FP32 logit biases; its INT4 heads (`QuantizedHeads`) are read as codes
with per-channel key scales and offsets and per-row value scales, dequantised in registers (no dequantised copy of
the prefix is made). The store is ``[B, H_kv, n, ...]``: keys and values in
the query dtype, or packed INT4 codes with one FP16 scale per token x KV-head row (dequantised in registers: the
codes go through the dot products and the scales multiply the scores and the softmax weights, the same sum as
``code * scale``), read under a mask (causal, boolean, additive). The program keeps FP32 online-softmax statistics
and writes its output, or (several splits) its statistics for `merge_splits_kernel` (ALGORITHMS.md eq. 15).

`kernels.biased_attention` runs it once (the compacted prefix and the appended tokens), `kernels.mixed_attention`
once per partition of a mixed-precision layer (no prefix), all merged by `run_attention`.
"""

from __future__ import annotations

from itertools import pairwise
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..compacted_inputs import CompactedPrefix
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
)

MASK_NONE = tl.constexpr(0)
"""Every key visible (the compacted prefix)."""
MASK_CAUSAL = tl.constexpr(1)
"""Causal, bottom-right aligned: query ``i`` of ``q`` sees keys ``0 .. n - q + i`` of the store's ``n``."""
MASK_BOOL = tl.constexpr(2)
"""A uint8 ``[B, q, n]`` mask (nonzero = visible)."""
MASK_ADDITIVE = tl.constexpr(3)
"""A float ``[B, q, n]`` mask added to the scores."""

PLAIN = tl.constexpr(0)
"""Keys and values in the query dtype."""
INT4_ROWS = tl.constexpr(1)
"""Packed INT4 keys and values, one FP16 scale per row of each (`quantize_int4`: the PASK store)."""
INT4_CHANNELS = tl.constexpr(2)
"""Packed INT4 keys with FP16 per-channel scales and offsets per group of ``key_group`` rows
(`quantize_int4_channels`), values as in `INT4_ROWS` (the INT4 heads of a compacted prefix)."""


@triton.jit
def load_rows(
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
def channel_dequantized(
    codes, cols, col_ok, scale_base, offset_base, stride_sn, key_group, width, BLOCK_W: tl.constexpr
):
    """``code · scale + offset`` (FP32, then ``codes.dtype``) of the signed codes ``[BLOCK_N, BLOCK_W]`` of rows
    ``cols``: row ``r`` reads the scales and offsets ``[ceil(n / key_group), width]`` (rows ``stride_sn`` apart,
    contiguous along ``width``) of its group ``r // key_group``; the same sum as `dequantize_int4_channels`."""
    w = tl.arange(0, BLOCK_W)
    ok = col_ok[:, None] & (w < width)[None, :]
    at = (cols // key_group)[:, None] * stride_sn + w[None, :]
    scale = tl.load(scale_base + at, mask=ok, other=0).to(tl.float32)
    offset = tl.load(offset_base + at, mask=ok, other=0).to(tl.float32)
    return (codes.to(tl.float32) * scale + offset).to(codes.dtype)


@triton.jit
def attend_keys(
    q,
    m,
    exp_sum,
    acc,
    lo,
    hi,
    k_base,
    v_base,
    stride_kn,
    stride_kd,
    stride_vn,
    stride_vd,
    k_scale_base,
    v_scale_base,
    stride_ksn,
    stride_vsn,
    k_offset_base,
    key_group,
    bias_base,
    mask_base,
    stride_mq,
    stride_mn,
    i,
    row_ok,
    causal_shift,
    scaling,
    softcap,
    head_dim,
    value_dim,
    MASK_KIND: tl.constexpr,
    CODES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Fold keys ``lo .. hi`` (rows of the tiles at ``k_base`` / ``v_base``) into the FP32 statistics of the
    program's rows: ``m`` / ``exp_sum`` ``[BLOCK_M]``, ``acc`` ``[BLOCK_M, BLOCK_DV]``; returns them updated.

    Keys and values are read as ``CODES`` says (`PLAIN`, `INT4_ROWS`: the key scales ``[n]`` at ``k_scale_base``;
    `INT4_CHANNELS`: the key scales and offsets ``[ceil(n / key_group), D]`` at ``k_scale_base`` / ``k_offset_base``,
    rows ``stride_ksn`` apart; both INT4 kinds: the value scales ``[n]`` at ``v_scale_base``).
    Scores are ``softcap(q·k · scaling [· key scale]) [+ bias] [+ additive mask]``; a row sees a key where ``row_ok``
    and the mask (``MASK_KIND``, row ``i`` of the mask at ``mask_base``; causal: key ``<= i + causal_shift``) let it.
    """
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        k = load_rows(k_base, cols, col_ok, stride_kn, stride_kd, head_dim, BLOCK_D, CODES != PLAIN, q.dtype)
        v = load_rows(v_base, cols, col_ok, stride_vn, stride_vd, value_dim, BLOCK_DV, CODES != PLAIN, q.dtype)
        if CODES == INT4_ROWS:
            k_scale = tl.load(k_scale_base + cols * stride_ksn, mask=col_ok, other=0).to(tl.float32)
            s = scores(q, k, scaling * k_scale[None, :], softcap, USE_SOFTCAP, DOT_PRECISION)
        else:
            if CODES == INT4_CHANNELS:
                k = channel_dequantized(
                    k, cols, col_ok, k_scale_base, k_offset_base, stride_ksn, key_group, head_dim, BLOCK_D
                )
            s = scores(q, k, scaling, softcap, USE_SOFTCAP, DOT_PRECISION)
        if HAS_BIAS:
            s = s + tl.load(bias_base + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        visible = row_ok[:, None] & col_ok[None, :]
        if MASK_KIND == MASK_CAUSAL:
            visible = visible & (cols[None, :] <= i[:, None] + causal_shift)
        elif MASK_KIND != MASK_NONE:
            mask_block = tl.load(mask_base + i[:, None] * stride_mq + cols[None, :] * stride_mn, mask=visible, other=0)
            if MASK_KIND == MASK_BOOL:
                visible = visible & (mask_block != 0)
            else:
                s = s + mask_block.to(tl.float32)
        m, exp_sum, alpha, p = online_softmax_step(m, exp_sum, tl.where(visible, s, float("-inf")))
        if CODES != PLAIN:
            p = p * tl.load(v_scale_base + cols * stride_vsn, mask=col_ok, other=0).to(tl.float32)[None, :]
        acc = acc * alpha[:, None] + stats_dot(p.to(v.dtype), v, DOT_PRECISION)
    return m, exp_sum, acc


@triton.jit
def attention_kernel(
    q_ptr,
    prefix_k_ptr,
    prefix_v_ptr,
    prefix_bias_ptr,
    prefix_offsets_ptr,
    prefix_rows_ptr,
    prefix_key_codes_ptr,
    prefix_key_scales_ptr,
    prefix_key_offsets_ptr,
    prefix_value_codes_ptr,
    prefix_value_scales_ptr,
    key_group,
    k_ptr,
    v_ptr,
    k_scale_ptr,
    v_scale_ptr,
    mask_ptr,
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
    stride_pkn,
    stride_pkd,
    stride_pvn,
    stride_pvd,
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
    stride_mb,
    stride_mq,
    stride_mn,
    stride_ob,
    stride_oq,
    stride_oh,
    stride_od,
    HAS_PREFIX: tl.constexpr,
    INT4_PREFIX: tl.constexpr,
    MASK_KIND: tl.constexpr,
    STORE_CODES: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    WRITE_PARTIALS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Grid ``(row blocks, splits, B * H_kv)``; split ``s`` covers keys ``[s * split_len, (s + 1) * split_len)`` of
    ``[prefix of head h ‖ the n_keys keys of (b, h)]`` and is split ``split_base + s`` of the statistics buffers.

    Prefix head ``h`` has its biases at rows ``offsets[h] : offsets[h + 1]`` of ``prefix_bias``; its keys / values at
    the same rows of ``prefix_k`` / ``prefix_v``, or with ``INT4_PREFIX`` where ``prefix_rows[h]`` ``[H_kv, 3]`` (first
    row in its storage, first row of key scales, whether INT4) puts them: rows of ``prefix_k`` / ``prefix_v``, or of
    the contiguous INT4 tensors of a `QuantizedHeads` (`INT4_CHANNELS`, ``key_group`` kept entries per row of key
    scales), dequantised in registers."""
    split = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = pid_bh // n_kv_heads
    h = pid_bh % n_kv_heads
    q, rows, row_ok, i, head = query_rows(
        q_ptr, b, h, group, q_len, n_rows, head_dim, stride_qb, stride_qh, stride_qs, stride_qd, BLOCK_M, BLOCK_D
    )
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    exp_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    key_lo = split * split_len
    key_hi = key_lo + split_len

    prefix_len = 0
    if HAS_PREFIX:  # shared by the batch
        bias_start = tl.load(prefix_offsets_ptr + h)
        prefix_len = tl.load(prefix_offsets_ptr + h + 1) - bias_start
        prefix_lo = tl.minimum(key_lo, prefix_len)
        prefix_hi = tl.minimum(key_hi, prefix_len)
        row_start = bias_start
        plain_hi = prefix_hi
        if INT4_PREFIX:  # an INT4 head reads no rows of prefix_k / prefix_v
            row_start = tl.load(prefix_rows_ptr + 3 * h)
            is_int4 = tl.load(prefix_rows_ptr + 3 * h + 2) != 0
            plain_hi = tl.where(is_int4, prefix_lo, prefix_hi)
        m, exp_sum, acc = attend_keys(
            q, m, exp_sum, acc, prefix_lo, plain_hi,
            prefix_k_ptr + row_start * stride_pkn, prefix_v_ptr + row_start * stride_pvn,
            stride_pkn, stride_pkd, stride_pvn, stride_pvd,
            k_scale_ptr, v_scale_ptr, 0, 0, k_scale_ptr, 1,  # no scales
            prefix_bias_ptr + bias_start,
            mask_ptr, 0, 0, i, row_ok, 0,  # no mask
            scaling, softcap, head_dim, value_dim,
            MASK_NONE, PLAIN, True, USE_SOFTCAP, DOT_PRECISION, BLOCK_N, BLOCK_D, BLOCK_DV,
        )  # fmt: skip
        if INT4_PREFIX:  # a head in the query dtype reads no codes
            key_bytes = (head_dim + 1) // 2
            value_bytes = (value_dim + 1) // 2
            group_start = tl.load(prefix_rows_ptr + 3 * h + 1)
            m, exp_sum, acc = attend_keys(
                q, m, exp_sum, acc, prefix_lo, tl.where(is_int4, prefix_hi, prefix_lo),
                prefix_key_codes_ptr + row_start * key_bytes, prefix_value_codes_ptr + row_start * value_bytes,
                key_bytes, 1, value_bytes, 1,
                prefix_key_scales_ptr + group_start * head_dim, prefix_value_scales_ptr + row_start, head_dim, 1,
                prefix_key_offsets_ptr + group_start * head_dim, key_group,
                prefix_bias_ptr + bias_start,
                mask_ptr, 0, 0, i, row_ok, 0,  # no mask
                scaling, softcap, head_dim, value_dim,
                MASK_NONE, INT4_CHANNELS, True, USE_SOFTCAP, DOT_PRECISION, BLOCK_N, BLOCK_D, BLOCK_DV,
            )  # fmt: skip
    m, exp_sum, acc = attend_keys(
        q, m, exp_sum, acc,
        tl.minimum(tl.maximum(key_lo - prefix_len, 0), n_keys), tl.minimum(tl.maximum(key_hi - prefix_len, 0), n_keys),
        k_ptr + b * stride_kb + h * stride_kh, v_ptr + b * stride_vb + h * stride_vh,
        stride_kn, stride_kd, stride_vn, stride_vd,
        k_scale_ptr + b * stride_ksb + h * stride_ksh, v_scale_ptr + b * stride_vsb + h * stride_vsh,
        stride_ksn, stride_vsn, k_scale_ptr, 1,  # no key offsets
        prefix_bias_ptr,  # no bias
        mask_ptr + b * stride_mb, stride_mq, stride_mn, i, row_ok, n_keys - q_len,
        scaling, softcap, head_dim, value_dim,
        MASK_KIND, STORE_CODES, False, USE_SOFTCAP, DOT_PRECISION, BLOCK_N, BLOCK_D, BLOCK_DV,
    )  # fmt: skip

    dv = tl.arange(0, BLOCK_DV)
    if WRITE_PARTIALS:
        stat = (pid_bh * n_stat_splits + split_base + split) * (tl.num_programs(0) * BLOCK_M) + rows
        tl.store(part_m_ptr + stat, m)
        tl.store(part_l_ptr + stat, exp_sum)
        tl.store(part_acc_ptr + stat[:, None] * BLOCK_DV + dv[None, :], acc)
    else:  # the normalised output [B, q, H_q, D_v]: row r is query i[r] of query head head[r]
        out = acc / tl.where(exp_sum > 0, exp_sum, 1.0)[:, None]
        out_ptrs = (
            out_ptr + b * stride_ob + i[:, None] * stride_oq + head[:, None] * stride_oh + dv[None, :] * stride_od
        )
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dv < value_dim)[None, :])


class KeyStore(NamedTuple):
    """The keys of every (batch row, KV head) that one launch of `attention_kernel` reads, and their mask.

    Attributes:
        keys: ``[B, H_kv, n, D]`` in the query dtype, or uint8 packed INT4 codes ``[B, H_kv, n, ceil(D / 2)]``.
        values: ``[B, H_kv, n, D_v]``, or codes ``[B, H_kv, n, ceil(D_v / 2)]``.
        mask_kind: `MASK_CAUSAL`, `MASK_BOOL` or `MASK_ADDITIVE`.
        mask: ``[B, q, n]`` (any strides; uint8 for `MASK_BOOL`, float for `MASK_ADDITIVE`), None when causal.
        key_scales / value_scales: fp16 ``[B, H_kv, n, 1]`` scales of INT4 codes; None for keys / values as such.
        query: the ``[B, H_q, q, D]`` query this launch reads in place of the call's (e.g. scaled per channel for
            centred INT4 keys), or None.
        logit_shift: FP32 ``[B, H_q, q]`` added to every logit of this store (folded into its softmax statistics
            after the launch: no soft-capping), or None.
    """

    keys: torch.Tensor
    values: torch.Tensor
    mask_kind: tl.constexpr
    mask: torch.Tensor | None = None
    key_scales: torch.Tensor | None = None
    value_scales: torch.Tensor | None = None
    query: torch.Tensor | None = None
    logit_shift: torch.Tensor | None = None


def _prefix_arguments(prefix: CompactedPrefix | None, query: torch.Tensor) -> tuple[list, tuple[int, ...]]:
    """``(arguments, strides)`` of `attention_kernel` for ``prefix``: its keys, values, biases, offsets, per-head row
    table, the five INT4 tensors and ``key_group``, then the strides of its keys and values; ``query`` (unread) in
    place of what it lacks. The INT4 tensors must be contiguous (as a `QuantizedHeads` stores them)."""
    if prefix is None:
        return [query] * 10 + [1], (0, 0, 0, 0)
    device = query.device
    offsets = torch.tensor(prefix.offsets, dtype=torch.int64).to(device, non_blocking=True)
    quantized = prefix.quantized
    if quantized is None:
        int4_arguments = [query] * 6 + [1]
    else:
        rows = list(zip(quantized.row_starts, quantized.group_starts, quantized.int4_heads, strict=True))
        row_table = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        longest = max(end - start for start, end in pairwise(prefix.offsets))
        int4_arguments = [row_table, *quantized.tensors(), quantized.key_group or max(1, longest)]
    return [prefix.keys, prefix.values, prefix.bias, offsets, *int4_arguments], (
        *prefix.keys.stride(),
        *prefix.values.stride(),
    )


def run_attention(
    query: torch.Tensor,
    out: torch.Tensor,
    stores: list[KeyStore],
    scaling: float,
    softcap: float | None,
    num_splits: int | None,
    prefix: CompactedPrefix | None = None,
) -> torch.Tensor:
    """Attention of ``query`` over the disjoint union of the ``stores`` (and ``prefix``, read with ``stores[0]``),
    written into ``out``; arguments already checked by the caller.

    Args:
        query: ``[B, H_q, q, D]``; out: ``[B, q, H_q, D_v]`` of the query dtype, not empty.
        stores: one launch each; every one with at least one key, except a single store read with a prefix (which
            reads the call's query, no logit shift).
        scaling / softcap: as in `scores` (softcap None or 0: none).
        num_splits: about how many key splits in all (merged afterwards); ``None`` chooses from the device.
        prefix: the compacted prefix (offsets checked), or None.

    Returns:
        ``out``; a row that sees no key gets zeros.
    """
    batch, n_q_heads, q_len, head_dim = query.shape
    value_dim = out.shape[-1]
    n_kv_heads = stores[0].keys.shape[1]
    group = n_q_heads // n_kv_heads
    n_rows = group * q_len
    block_m = row_block_size(n_rows)
    block_dv = max(16, triton.next_power_of_2(value_dim))
    row_blocks = triton.cdiv(n_rows, block_m)
    key_counts = [store.keys.shape[2] for store in stores]
    if prefix is not None:
        key_counts[0] += max(end - start for start, end in pairwise(prefix.offsets))
    if num_splits is None:
        num_splits = auto_splits(query.device, row_blocks * batch * n_kv_heads, sum(key_counts))
    split_len = max(BLOCK_N, triton.cdiv(triton.cdiv(sum(key_counts), num_splits), BLOCK_N) * BLOCK_N)
    splits = [max(1, triton.cdiv(n, split_len)) for n in key_counts]
    stats = None
    if sum(splits) > 1:
        stats = SplitStats(batch * n_kv_heads, sum(splits), row_blocks, block_m, block_dv, query.device)
    prefix_arguments, prefix_strides = _prefix_arguments(prefix, query)
    options = launch_options(query, softcap, stats, head_dim, block_m, block_dv)

    if prefix is not None and (stores[0].query is not None or stores[0].logit_shift is not None):
        raise ValueError("the store read with a prefix reads the call's query without a logit shift")
    if softcap and any(store.logit_shift is not None for store in stores):
        raise ValueError("a logit shift cannot be folded into soft-capped logits: dequantise the store instead")
    split_base = 0
    for index, (store, n_splits) in enumerate(zip(stores, splits)):
        int4 = store.key_scales is not None
        key_scales, value_scales = (store.key_scales, store.value_scales) if int4 else (query, query)  # query: unread
        mask, mask_strides = (query, (0, 0, 0)) if store.mask is None else (store.mask, store.mask.stride())
        launch_query = query if store.query is None else store.query
        attention_kernel[(row_blocks, n_splits, batch * n_kv_heads)](
            launch_query,
            *prefix_arguments,
            store.keys,
            store.values,
            key_scales,
            value_scales,
            mask,
            out,
            *stats_arguments(stats, out),
            float(scaling),
            float(softcap or 1.0),
            n_kv_heads,
            group,
            q_len,
            n_rows,
            store.keys.shape[2],
            split_len,
            split_base,
            sum(splits),
            head_dim,
            value_dim,
            *launch_query.stride(),
            *prefix_strides,
            *store.keys.stride(),
            *store.values.stride(),
            *key_scales.stride()[:3],
            *value_scales.stride()[:3],
            *mask_strides,
            *out.stride(),
            HAS_PREFIX=prefix is not None and index == 0,
            INT4_PREFIX=prefix is not None and prefix.quantized is not None,
            MASK_KIND=store.mask_kind.value,
            STORE_CODES=(INT4_ROWS if int4 else PLAIN).value,
            **options,
        )
        if store.logit_shift is not None and stats is not None:  # one split alone: its softmax ignores the shift
            stats.shift_maximum(split_base, n_splits, store.logit_shift, group)
        split_base += n_splits
    if stats is not None:
        stats.merge_into(out, n_kv_heads, group, block_m)
    return out
