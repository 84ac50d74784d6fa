"""The FP32 online-softmax pieces of `attention_kernel`, its launch options, and the merge of split statistics (eq. 15).

A program of the attention kernel owns a block of ``BLOCK_M`` query rows and one split of the keys; it keeps the FP32
row maximum ``m``, exp-sum and unnormalised output ``acc`` over its keys. With one split it writes the output
itself; with several, each writes its statistics to ``[B * H_kv, n_splits, rows_padded]`` buffers (``acc`` with a
last dim ``BLOCK_DV``) and `merge_splits_kernel` merges them exactly (ALGORITHMS.md eq. 15).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import INTERPRETED

BLOCK_N = 64
"""Keys per inner-loop step (and the granularity of a split)."""
MIN_KEYS_PER_SPLIT = 256
"""Automatic split-KV never gives a program fewer keys than this."""


@triton.jit
def query_rows(
    q_ptr,
    b,
    h,
    group,
    q_len,
    n_rows,
    head_dim,
    stride_qb,
    stride_qh,
    stride_qs,
    stride_qd,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The program's block of rows of KV head ``h``'s flattened ``[group query heads x q queries]`` matrix.

    Returns:
        ``(q [BLOCK_M, BLOCK_D] (zeros past the rows / head dim), rows, row_ok, i, head)``: row ``r`` is query
        ``i[r]`` of query head ``head[r] = h * group + r // q_len``.
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    i = rows % q_len
    head = h * group + rows // q_len
    d = tl.arange(0, BLOCK_D)
    q = tl.load(
        q_ptr + b * stride_qb + head[:, None] * stride_qh + i[:, None] * stride_qs + d[None, :] * stride_qd,
        mask=row_ok[:, None] & (d < head_dim)[None, :],
        other=0.0,
    )
    return q, rows, row_ok, i, head


@triton.jit
def tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def stats_dot(a, b, DOT_PRECISION: tl.constexpr):
    """FP32-accumulated ``a @ b``. The interpreter multiplies bf16 bit patterns as integers (Triton 3.9), so there
    the operands are widened to FP32 first, which gives the same products (exact in FP32)."""
    if INTERPRETED:
        product = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        product = tl.dot(a, b, input_precision=DOT_PRECISION)
    return product


@triton.jit
def scores(q, k, scaling, softcap, USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """FP32 ``softcap(q·kᵀ · scaling)`` ``[BLOCK_M, BLOCK_N]`` of queries ``[BLOCK_M, D]`` and keys ``[BLOCK_N, D]``."""
    s = stats_dot(q, tl.trans(k), DOT_PRECISION) * scaling
    if USE_SOFTCAP:
        s = softcap * tanh(s / softcap)
    return s


@triton.jit
def online_softmax_step(m, exp_sum, s):
    """Fold a block of FP32 scores ``s`` ``[M, N]`` (masked entries -inf) into the running row maximum ``m`` and
    exp-sum; returns ``(m, exp_sum, alpha, p)``: the caller updates ``acc = acc * alpha[:, None] + p @ v``."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    # Rows that have seen no key keep m = -inf; shift them by 0 so that exp(-inf) = 0 instead of NaN.
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - shift)
    p = tl.exp(s - shift[:, None])
    return m_new, exp_sum * alpha + tl.sum(p, axis=1), alpha, p


@triton.jit
def merge_splits_kernel(
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    out_ptr,
    n_kv_heads,
    group,
    q_len,
    n_rows,
    n_splits,
    value_dim,
    stride_ob,
    stride_oq,
    stride_oh,
    stride_od,
    BLOCK_M: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Merge the per-split statistics of one block of rows (eq. 15) and write the output; grid
    ``(row_blocks, B * H_kv)``. A row that no split saw gets zeros."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // n_kv_heads
    h = pid_bh % n_kv_heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dv = tl.arange(0, BLOCK_DV)
    n_rows_padded = tl.num_programs(0) * BLOCK_M

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for split in range(n_splits):
        row_max = tl.maximum(row_max, tl.load(part_m_ptr + (pid_bh * n_splits + split) * n_rows_padded + rows))
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    numerator = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    denominator = tl.zeros([BLOCK_M], tl.float32)
    for split in range(n_splits):
        stat = (pid_bh * n_splits + split) * n_rows_padded + rows
        weight = tl.exp(tl.load(part_m_ptr + stat) - shift)  # 0 for a split that the row does not see
        denominator += weight * tl.load(part_l_ptr + stat)
        numerator += weight[:, None] * tl.load(part_acc_ptr + stat[:, None] * BLOCK_DV + dv[None, :])

    out = numerator / tl.where(denominator > 0, denominator, 1.0)[:, None]
    g = rows // q_len
    i = rows % q_len
    head = h * group + g
    out_ptrs = out_ptr + b * stride_ob + i[:, None] * stride_oq + head[:, None] * stride_oh + dv[None, :] * stride_od
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=(rows < n_rows)[:, None] & (dv < value_dim)[None, :])


class SplitStats:
    """FP32 buffers of per-split statistics for ``B * H_kv`` (batch row, KV head) pairs and ``row_blocks`` blocks of
    ``block_m`` rows: ``m`` / ``exp_sum`` ``[B * H_kv, n_splits, rows_padded]``, ``acc`` ``[..., block_dv]``."""

    def __init__(self, n_pairs: int, n_splits: int, row_blocks: int, block_m: int, block_dv: int, device):
        shape = (n_pairs, n_splits, row_blocks * block_m)
        self.m = torch.empty(shape, dtype=torch.float32, device=device)
        self.exp_sum = torch.empty_like(self.m)
        self.acc = torch.empty((*shape, block_dv), dtype=torch.float32, device=device)

    def shift_maximum(self, first_split: int, n_splits: int, logit_shift: torch.Tensor, group: int) -> None:
        """Add ``logit_shift`` (FP32 ``[B, H_q, q]``, one value per query row) to the row maxima of splits
        ``first_split .. first_split + n_splits - 1``: their statistics become those of logits shifted by it (the
        exp-sums and accumulators are relative to the maximum and do not change; ``-inf`` stays ``-inf``)."""
        batch, n_q_heads, q_len = logit_shift.shape
        rows = logit_shift.float().reshape(batch * (n_q_heads // group), group * q_len)  # row g * q + i of head h
        self.m[:, first_split : first_split + n_splits, : rows.shape[1]] += rows[:, None, :]

    def merge_into(self, out: torch.Tensor, n_kv_heads: int, group: int, block_m: int) -> None:
        """Write the merged output ``out`` ``[B, q, H_q, D_v]``."""
        n_pairs, n_splits, rows_padded = self.m.shape
        _, q_len, _, value_dim = out.shape
        merge_splits_kernel[(rows_padded // block_m, n_pairs)](
            self.m,
            self.exp_sum,
            self.acc,
            out,
            n_kv_heads,
            group,
            q_len,
            group * q_len,
            n_splits,
            value_dim,
            *out.stride(),
            BLOCK_M=block_m,
            BLOCK_DV=self.acc.shape[-1],
        )


def stats_arguments(stats: SplitStats | None, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three statistics pointers of a kernel launch: the split buffers, or ``out`` as an unused placeholder
    when the kernel writes its result directly (one split)."""
    return (out, out, out) if stats is None else (stats.m, stats.exp_sum, stats.acc)


def launch_options(
    query: torch.Tensor, softcap: float | None, stats: SplitStats | None, head_dim: int, block_m: int, block_dv: int
) -> dict:
    """Compile-time options shared by the attention kernels: soft-capping, partial-statistics output, FP32 dot
    products for FP32 inputs (TF32 otherwise) and the block sizes."""
    return {
        "USE_SOFTCAP": bool(softcap),
        "WRITE_PARTIALS": stats is not None,
        "DOT_PRECISION": "ieee" if query.dtype == torch.float32 else "tf32",
        "BLOCK_M": block_m,
        "BLOCK_N": BLOCK_N,
        "BLOCK_D": max(16, triton.next_power_of_2(head_dim)),
        "BLOCK_DV": block_dv,
    }


def row_block_size(n_rows: int) -> int:
    """``BLOCK_M``: 16 rows (the smallest ``tl.dot`` tile) for decode-sized groups, 64 for chunks."""
    return 16 if n_rows <= 16 else 64


def auto_splits(device: torch.device, programs: int, max_keys: int) -> int:
    """Splits of the keys so that a decode step (few programs) fills the GPU; 1 under the interpreter."""
    if device.type != "cuda":
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(target, programs), triton.cdiv(max_keys, MIN_KEYS_PER_SPLIT)))
