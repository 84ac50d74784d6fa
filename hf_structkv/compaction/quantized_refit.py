"""INT4 storage of a compacted head with a quantization-aware refit (``design/ALGORITHMS.md`` §3, "INT4 compacted
prefix").

On the support a method selected, the kept keys are quantized per channel (`quantize_int4_channels`, FP16 scales and
offsets per head or per group of kept entries), then the shared final refit runs against the exact statistics of the
full cache: multipliers (22) on the exact kept keys against the full row sums ``s`` (the mass they stand for), values
(23) with the served (dequantized) keys in the attention against the full outputs ``O``. The refit values are quantized
per row, row by row, each row's rounding error compensated on the rows not yet quantized through the normal equations of
(23) (the optimal-brain-quantization update; `quantize_values_compensated`), and kept only where that beats plain
rounding on the calibration queries. A head whose INT4 fit serves its calibration queries worse than the same method
fitted in the cache's dtype at the same bytes (`StorageLayout`), or serves a held-back share of them worse when refit
without it, is stored in that dtype instead, marked ``storage_fallback``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..quant import LARGEST_FP16, dequantize_int4, dequantize_int4_channels, quantize_int4, quantize_int4_channels
from .head_method import CalibratedMethod, HeadMethod, evict
from .head_statistics import FLOAT, CompactedHead, HeadProblem, QuantizedHead
from .head_storage import StorageLayout
from .refit import fit_multipliers, fit_values

CODE_LIMIT = 7 * LARGEST_FP16
"""Values beyond ``±7 · 65504`` saturate their INT4 codes; rows are clipped there before quantization."""


def refit_with_served_keys(
    problem: HeadProblem, indices: torch.Tensor, keys: torch.Tensor, bias_bound: float, value_shrinkage: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The shared final refit on the support ``indices [t]`` for the served ``keys [t, D]`` (float64): the
    multipliers ``w = argmin ‖E_S w − s‖²`` in ``[e^-β, e^β]`` (22) on the exact kept keys, then ``V̂ = argmin ‖P̂ V̂ −
    O‖²`` (23) with the served keys in ``P̂ = softmax(Z̃_S + log w)``, shrunk toward the original values by
    ``value_shrinkage`` (`fit_values`), with ``s``, ``O`` those of the full cache.

    The multipliers stand for the mass of the full row that the kept entries carry, which does not depend on how the
    keys are stored; fitted with the served keys instead, they also absorb the keys' rounding along the calibration
    queries, which other queries do not share (on the embedded model's L14h0 at 20x fewer bytes: calibration loss
    0.0067 either way, question queries 0.0716 with served-key multipliers, 0.0138 with exact-key ones; the values'
    solve, linear in the attention, carries the rounding instead).

    Returns:
        ``(bias [t], values [t, D_v], attention [N, t])`` in float64: ``log w`` rounded to float32, the refit
        values and ``P̂``.
    """
    weights = fit_multipliers(problem.unnormalized(indices), problem.row_sums, bias_bound)
    bias = weights.log().float().to(FLOAT)
    attention = torch.softmax(problem.logits_of(keys) + bias, dim=1)
    values = fit_values(attention, problem.outputs, prior=problem.values[indices], shrinkage=value_shrinkage)
    return bias, values, attention


def quantize_values_compensated(
    attention: torch.Tensor, values: torch.Tensor, damping: float = 0.01, block: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row INT4 codes of ``values`` that keep ``‖P̂ Ṽ − P̂ V̂‖²`` small: rows are quantized one at a time (largest
    diagonal of ``H = P̂ᵀP̂`` first), each row's error ``δ`` moved onto the rows not yet quantized by the exact
    minimiser of the quadratic ``tr((V − V̂)ᵀ H (V − V̂))`` with the quantized rows fixed (``V_rest −= H_rest,rest⁻¹
    H_rest,j δ``, carried out through the upper Cholesky factor of ``H⁻¹``; ``H`` damped by ``damping`` times its
    mean diagonal).

    The updates are applied lazily by blocks of ``block`` rows (as GPTQ does): a row's update reaches the rest of its
    block at once and the rows after the block in one matrix product when the block is done, which is the same
    arithmetic, not a row-sized pass over every later row per row.

    Args:
        attention: ``P̂ [N, t]`` float64.
        values: ``V̂ [t, D_v]`` float64.

    Returns:
        ``(codes [t, ceil(D_v / 2)] uint8, scales [t, 1] fp16)`` as `quantize_int4` lays them out.
    """
    gram = attention.T @ attention
    order = torch.argsort(gram.diagonal(), descending=True)
    gram = gram[order][:, order]
    gram.diagonal().add_(damping * gram.diagonal().mean().clamp_min(torch.finfo(FLOAT).tiny))
    upper = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(gram)), upper=True)
    work = values[order].clamp(-CODE_LIMIT, CODE_LIMIT)
    codes, scales = [], []
    for start in range(0, work.shape[0], block):
        stop = min(start + block, work.shape[0])
        errors = torch.empty(stop - start, work.shape[1], dtype=work.dtype)
        for j in range(start, stop):
            row_codes, row_scale = quantize_int4(work[j : j + 1])
            errors[j - start] = (work[j] - dequantize_int4(row_codes, row_scale, work.shape[1], FLOAT)[0]) / upper[j, j]
            work[j + 1 : stop] -= upper[j, j + 1 : stop, None] * errors[j - start][None, :]
            work[j + 1 : stop].clamp_(-CODE_LIMIT, CODE_LIMIT)
            codes.append(row_codes)
            scales.append(row_scale)
        work[stop:] -= upper[start:stop, stop:].T @ errors
        work[stop:].clamp_(-CODE_LIMIT, CODE_LIMIT)
    restore = torch.argsort(order)
    return torch.cat(codes)[restore], torch.cat(scales)[restore]


def quantize_values(
    attention: torch.Tensor, values: torch.Tensor, outputs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row INT4 ``(codes, scales)`` of the refit ``values [t, D_v]``: compensated (`quantize_values_compensated`)
    where that serves ``attention [N, t]`` closer to ``outputs [N, D_v]`` than plain rounding does, else rounded."""
    rounded = quantize_int4(values.clamp(-CODE_LIMIT, CODE_LIMIT))
    try:
        compensated = quantize_values_compensated(attention, values)
    except torch.linalg.LinAlgError:
        return rounded
    errors = [
        (attention @ dequantize_int4(*candidate, values.shape[1], FLOAT) - outputs).square().sum()
        for candidate in (compensated, rounded)
    ]
    return compensated if errors[0] < errors[1] else rounded


def quantize_head(
    problem: HeadProblem, selected: CompactedHead, rule: HeadMethod, key_group: int | None = None
) -> QuantizedHead:
    """``selected`` (a head in the cache's dtype) stored in INT4.

    A calibrated method with ``refit`` (`CalibratedMethod`) is refit with the quantized keys
    (`refit_with_served_keys`, its ``bias_bound`` and ``value_shrinkage``) and its values quantized with compensation
    where that beats plain rounding on the calibration queries; any other head keeps its biases and values, rounded.

    Returns:
        `QuantizedHead` with float32 served keys and values (``train_loss`` unset).
    """
    indices = selected.indices
    key_codes, key_scales, key_offsets = quantize_int4_channels(problem.keys[indices], key_group)
    dim, value_dim = problem.keys.shape[1], problem.values.shape[1]
    keys = dequantize_int4_channels(key_codes, key_scales, key_offsets, dim, key_group, FLOAT)
    bias = selected.bias.to(FLOAT)
    value_codes, value_scales = quantize_int4(selected.values.to(FLOAT).clamp(-CODE_LIMIT, CODE_LIMIT))
    if isinstance(rule, CalibratedMethod) and rule.refit and problem.queries is not None:
        bias, values, attention = refit_with_served_keys(problem, indices, keys, rule.bias_bound, rule.value_shrinkage)
        value_codes, value_scales = quantize_values(attention, values, problem.outputs)
    return QuantizedHead(
        indices,
        bias.float(),
        dequantize_int4(value_codes, value_scales, value_dim),
        keys=keys.float(),
        key_codes=key_codes,
        key_scales=key_scales,
        key_offsets=key_offsets,
        value_codes=value_codes,
        value_scales=value_scales,
        key_group=key_group,
    )


def compact_int4(
    problem: HeadProblem,
    rule: HeadMethod,
    budget: int,
    seed: int,
    value_dtype: torch.dtype,
    key_group: int | None = None,
    guard_share: float = 0.25,
    fallback_entries: int | None = None,
) -> CompactedHead:
    """``rule`` on ``min(budget, T)`` entries stored in INT4 (`quantize_head`), guarded against the same rule fitted
    in ``value_dtype`` (the cache's) on ``fallback_entries`` entries (None: the most entries the INT4 head's bytes
    buy, `StorageLayout`): that head is served instead, marked ``storage_fallback``, when its loss on the calibration
    queries is lower, or when it is lower on a seeded ``guard_share`` of them that the INT4 refit is redone without
    (the refit of many entries can fit its calibration queries closely and others badly; 0: no such check).

    Returns:
        a `QuantizedHead`, or on fallback a `CompactedHead` with float32 bias and values in ``value_dtype``.
    """
    selected = dtype_head(problem, rule, budget, seed, value_dtype)
    quantized = quantize_head(problem, selected, rule, key_group)
    if problem.queries is None:
        return quantized
    same_bytes = fallback_entries
    if same_bytes is None:
        dim, value_dim = problem.keys.shape[1], problem.values.shape[1]
        nbytes = StorageLayout("int4", dim, value_dim, key_group=key_group).nbytes(quantized.indices.numel())
        element_bytes = torch.empty(0, dtype=value_dtype).element_size()
        same_bytes = StorageLayout("bf16", dim, value_dim, element_bytes).entries_for(nbytes)
    if same_bytes < 1:
        return quantized
    plain = dtype_head(problem, rule, same_bytes, seed, value_dtype)
    if not problem.relative_loss(quantized) <= problem.relative_loss(plain):
        return replace(plain, storage_fallback=True)
    if guard_share > 0 and problem.queries.shape[0] >= 2:
        fit, check = problem.split(guard_share, seed)
        if not check.relative_loss(quantize_head(fit, selected, rule, key_group)) <= check.relative_loss(plain):
            return replace(plain, storage_fallback=True)
    return quantized


def in_dtype(head: CompactedHead, value_dtype: torch.dtype) -> CompactedHead:
    """``head`` as the cache stores it: float32 bias, values in ``value_dtype``."""
    return CompactedHead(head.indices, head.bias.float(), head.values.to(value_dtype))


def dtype_head(
    problem: HeadProblem, rule: HeadMethod, budget: int, seed: int, value_dtype: torch.dtype
) -> CompactedHead:
    """``rule`` on ``min(budget, T)`` entries in ``value_dtype`` (`in_dtype`); ``budget >= T`` keeps every entry as it
    is (bias 0, original values)."""
    if budget >= problem.length:
        head = evict(problem, torch.arange(problem.length, device=problem.keys.device))
    else:
        head = rule.compact(problem, budget, seed)
    return in_dtype(head, value_dtype)
