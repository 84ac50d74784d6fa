"""Triton kernel for attention over a compacted prefix (ragged per KV head, FP32 logit bias) and the appended tokens.

It computes exactly what ``hf_structkv.attention.compacted_reference.compacted_attention`` computes, without padding
the ragged prefix and without repeating keys for grouped-query attention: each program owns one (batch row, KV head)
pair, a block of rows of the flattened ``[group query heads x queries]`` matrix of that KV head, and one split of the
keys ``[prefix of the head ‖ appended tokens]``. It keeps FP32 online-softmax statistics; the splits (split-KV, for
decode over long prefixes) are merged with the same statistics (ALGORITHMS.md eq. 15) by a second kernel.

CPU tensors run under the Triton interpreter only: ``TRITON_INTERPRET=1`` set before triton is first imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_structkv.validation import is_int

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

_MASK_CAUSAL, _MASK_BOOL, _MASK_ADDITIVE = 0, 1, 2


@triton.jit
def _compacted_attention_kernel(
    q_ptr,
    prefix_k_ptr,
    prefix_v_ptr,
    prefix_bias_ptr,
    prefix_offsets_ptr,
    app_k_ptr,
    app_v_ptr,
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
    n_appended,
    n_rows,
    split_len,
    n_splits,
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
    stride_akb,
    stride_akh,
    stride_akn,
    stride_akd,
    stride_avb,
    stride_avh,
    stride_avn,
    stride_avd,
    stride_mb,
    stride_mq,
    stride_mn,
    stride_ob,
    stride_oq,
    stride_oh,
    stride_od,
    MASK_KIND: tl.constexpr,
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
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    d_ok = d < head_dim
    dv_ok = dv < value_dim
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    exp_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    # This split covers keys [key_lo, key_hi) of the logical sequence [prefix of head h (length L) ‖ appended].
    prefix_start = tl.load(prefix_offsets_ptr + h)
    prefix_len = tl.load(prefix_offsets_ptr + h + 1) - prefix_start
    key_lo = split * split_len
    key_hi = key_lo + split_len

    lo = prefix_start + tl.minimum(key_lo, prefix_len)
    hi = prefix_start + tl.minimum(key_hi, prefix_len)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        k = tl.load(
            prefix_k_ptr + cols[:, None] * stride_pkn + d[None, :] * stride_pkd,
            mask=col_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        v = tl.load(
            prefix_v_ptr + cols[:, None] * stride_pvn + dv[None, :] * stride_pvd,
            mask=col_ok[:, None] & dv_ok[None, :],
            other=0.0,
        )
        bias = tl.load(prefix_bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        s = scores(q, k, scaling, softcap, USE_SOFTCAP, DOT_PRECISION) + bias[None, :]
        m, exp_sum, alpha, p = online_softmax_step(m, exp_sum, tl.where(col_ok[None, :], s, float("-inf")))
        acc = acc * alpha[:, None] + stats_dot(p.to(v.dtype), v, DOT_PRECISION)

    app_lo = tl.minimum(tl.maximum(key_lo - prefix_len, 0), n_appended)
    app_hi = tl.minimum(tl.maximum(key_hi - prefix_len, 0), n_appended)
    app_k_base = app_k_ptr + b * stride_akb + h * stride_akh
    app_v_base = app_v_ptr + b * stride_avb + h * stride_avh
    for start in range(app_lo, app_hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < app_hi
        k = tl.load(
            app_k_base + cols[:, None] * stride_akn + d[None, :] * stride_akd,
            mask=col_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        v = tl.load(
            app_v_base + cols[:, None] * stride_avn + dv[None, :] * stride_avd,
            mask=col_ok[:, None] & dv_ok[None, :],
            other=0.0,
        )
        s = scores(q, k, scaling, softcap, USE_SOFTCAP, DOT_PRECISION)
        visible = col_ok[None, :] & row_ok[:, None]
        if MASK_KIND == 0:  # causal, bottom-right aligned: query i sees appended keys 0 .. n - q + i
            visible = visible & (cols[None, :] <= i[:, None] + (n_appended - q_len))
        else:
            mask_ptrs = mask_ptr + b * stride_mb + i[:, None] * stride_mq + cols[None, :] * stride_mn
            mask_block = tl.load(mask_ptrs, mask=visible, other=0)
            if MASK_KIND == 1:
                visible = visible & (mask_block != 0)
            else:
                s = s + mask_block.to(tl.float32)
        m, exp_sum, alpha, p = online_softmax_step(m, exp_sum, tl.where(visible, s, float("-inf")))
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
        dv_ok,
        split,
        n_splits,
        stride_ob,
        stride_oq,
        stride_oh,
        stride_od,
        WRITE_PARTIALS,
        BLOCK_M,
        BLOCK_DV,
    )


def _check_offsets(prefix_offsets: list[int], n_entries: int) -> list[int]:
    offsets = list(prefix_offsets) if isinstance(prefix_offsets, (list, tuple)) else []
    if len(offsets) < 2 or any(not is_int(x) for x in offsets):
        raise ValueError(f"prefix_offsets must be H_kv + 1 >= 2 Python ints (row offsets), got {prefix_offsets!r}")
    if offsets[0] < 0 or offsets[-1] > n_entries or any(a > b for a, b in zip(offsets[:-1], offsets[1:])):
        raise ValueError(
            f"prefix_offsets must be non-decreasing within [0, {n_entries}] (the prefix rows), got {offsets}"
        )
    return offsets


def _appended_mask(mask: torch.Tensor | None, batch: int, q_len: int, n_appended: int):
    """``(kind, tensor [B, q, n] with broadcast strides)`` for the kernel; mask semantics as in the reference."""
    if mask is None:
        return _MASK_CAUSAL, None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"appended_mask must be None or a tensor, got {type(mask).__name__}")
    if mask.dim() == 0 or mask.shape[-1] != n_appended:
        raise ValueError(
            f"attention mask covers {mask.shape[-1] if mask.dim() else 0} keys but {n_appended} tokens are appended "
            "after the compacted prefix; the mask of a compacted cache spans the appended tokens only (build it with "
            "the model's own mask creation, not by hand)"
        )
    try:
        expanded = mask.expand(batch, 1, q_len, n_appended)[:, 0]
    except RuntimeError as error:
        raise ValueError(
            f"appended_mask of shape {tuple(mask.shape)} does not broadcast to [B={batch}, 1, q={q_len}, "
            f"n={n_appended}] (one mask for all heads)"
        ) from error
    if mask.dtype == torch.bool:
        return _MASK_BOOL, expanded.view(torch.uint8)
    if not mask.is_floating_point():
        raise TypeError(f"appended_mask must be boolean (True = visible) or an additive float mask, got {mask.dtype}")
    return _MASK_ADDITIVE, expanded


def triton_compacted_attention(
    query: torch.Tensor,
    prefix_keys: torch.Tensor,
    prefix_values: torch.Tensor,
    prefix_bias: torch.Tensor,
    prefix_offsets: list[int],
    appended_keys: torch.Tensor,
    appended_values: torch.Tensor,
    appended_mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton version of ``compacted_attention`` (same arguments, same result up to floating-point rounding).

    Args:
        query: ``[B, H_q, q, D]`` post-RoPE queries (fp32, fp16 or bf16); ``H_q`` a multiple of ``H_kv``.
        prefix_keys: ``[N, D]`` kept keys, KV head ``h`` in rows ``prefix_offsets[h]:prefix_offsets[h+1]``.
        prefix_values: ``[N, D_v]`` kept values, same layout.
        prefix_bias: ``[N]`` logit biases (read as FP32).
        prefix_offsets: ``H_kv + 1`` non-decreasing row offsets (Python ints).
        appended_keys: ``[B, H_kv, n, D]``; appended_values: ``[B, H_kv, n, D_v]``.
        appended_mask: ``None`` (causal, bottom-right aligned), boolean (True = visible) or additive float mask
            broadcastable to ``[B, 1, q, n]``.
        scaling: logit scale; softcap: optional tanh soft-capping applied before the bias (None or 0: none).
        num_splits: split-KV factor (keys of a head split into this many chunks merged afterwards); ``None``
            chooses from the device (1 on CPU).

    Query, keys and values must share one dtype (fp32 uses IEEE FP32 dot products; fp16/bf16 use FP32
    accumulation with the softmax weights rounded to the value dtype for the value product, as FlashAttention).

    Returns:
        ``[B, q, H_q, D_v]`` in ``query.dtype``.
    """
    check_tensor("query", query, 4)
    check_tensor("prefix_keys", prefix_keys, 2)
    check_tensor("prefix_values", prefix_values, 2)
    check_tensor("prefix_bias", prefix_bias, 1)
    check_tensor("appended_keys", appended_keys, 4)
    check_tensor("appended_values", appended_values, 4)
    batch, n_q_heads, q_len, head_dim = query.shape
    n_entries, value_dim = prefix_values.shape
    offsets = _check_offsets(prefix_offsets, prefix_keys.shape[0])
    n_kv_heads = len(offsets) - 1
    n_appended = appended_keys.shape[-2]
    if n_q_heads % n_kv_heads:
        raise ValueError(f"{n_q_heads} query heads cannot be grouped over {n_kv_heads} KV heads")
    if prefix_keys.shape[1] != head_dim or appended_keys.shape[-1] != head_dim:
        raise ValueError(
            f"keys must have the query head dim {head_dim}: prefix_keys {tuple(prefix_keys.shape)}, "
            f"appended_keys {tuple(appended_keys.shape)}"
        )
    if prefix_keys.shape[0] != n_entries or prefix_bias.shape[0] != n_entries:
        raise ValueError(
            f"prefix_keys {tuple(prefix_keys.shape)}, prefix_values {tuple(prefix_values.shape)} and prefix_bias "
            f"{tuple(prefix_bias.shape)} must have the same number of rows N"
        )
    if tuple(appended_keys.shape[:3]) != (batch, n_kv_heads, n_appended):
        raise ValueError(
            f"appended_keys must be [B={batch}, H_kv={n_kv_heads}, n, D], got {tuple(appended_keys.shape)}"
        )
    if tuple(appended_values.shape) != (batch, n_kv_heads, n_appended, value_dim):
        raise ValueError(
            f"appended_values must be [B={batch}, H_kv={n_kv_heads}, n={n_appended}, D_v={value_dim}], "
            f"got {tuple(appended_values.shape)}"
        )
    tensors = {
        "prefix_keys": prefix_keys,
        "prefix_values": prefix_values,
        "appended_keys": appended_keys,
        "appended_values": appended_values,
    }
    for name, t in tensors.items():
        if t.dtype != query.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but query has {query.dtype}: cast them to one dtype")
    for name, t in {**tensors, "prefix_bias": prefix_bias}.items():
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device} but query is on {query.device}: move them to one device")
    check_runs_on(query.device)
    check_num_splits(num_splits)
    mask_kind, mask = _appended_mask(appended_mask, batch, q_len, n_appended)

    out = torch.empty(batch, q_len, n_q_heads, value_dim, dtype=query.dtype, device=query.device)
    if out.numel() == 0:
        return out
    group = n_q_heads // n_kv_heads
    n_rows = group * q_len
    block_m = row_block_size(n_rows)
    block_dv = max(16, triton.next_power_of_2(value_dim))
    row_blocks = triton.cdiv(n_rows, block_m)
    max_keys = max(b - a for a, b in zip(offsets[:-1], offsets[1:])) + n_appended
    if num_splits is None:
        num_splits = auto_splits(query.device, row_blocks * batch * n_kv_heads, max_keys)
    split_len = max(BLOCK_N, triton.cdiv(triton.cdiv(max_keys, num_splits), BLOCK_N) * BLOCK_N)
    n_splits = max(1, triton.cdiv(max_keys, split_len))
    stats = (
        SplitStats(batch * n_kv_heads, n_splits, row_blocks, block_m, block_dv, query.device) if n_splits > 1 else None
    )
    offsets_tensor = torch.tensor(offsets, dtype=torch.int64).to(query.device, non_blocking=True)
    mask_arg, mask_strides = (query, (0, 0, 0)) if mask is None else (mask, mask.stride())

    _compacted_attention_kernel[(row_blocks, n_splits, batch * n_kv_heads)](
        query,
        prefix_keys,
        prefix_values,
        prefix_bias,
        offsets_tensor,
        appended_keys,
        appended_values,
        mask_arg,
        out,
        *stats_arguments(stats, out),
        float(scaling),
        float(softcap or 1.0),
        n_kv_heads,
        group,
        q_len,
        n_appended,
        n_rows,
        split_len,
        n_splits,
        head_dim,
        value_dim,
        *query.stride(),
        *prefix_keys.stride(),
        *prefix_values.stride(),
        *appended_keys.stride(),
        *appended_values.stride(),
        *mask_strides,
        *out.stride(),
        MASK_KIND=mask_kind,
        **launch_options(query, softcap, stats, head_dim, block_m, block_dv),
    )
    if stats is not None:
        stats.merge_into(out, n_kv_heads, group, block_m)
    return out
