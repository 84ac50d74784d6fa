"""Triton attention over a compacted prefix (ragged per KV head, FP32 logit bias) and the appended tokens.

It computes exactly what ``hf_structkv.attention.compacted_reference.compacted_attention`` computes, without padding
the ragged prefix and without repeating keys for grouped-query attention, with one launch of `attention_kernel`: the
prefix (its INT4 heads read as codes and FP16 scales, dequantised in registers) and the appended tokens (the store,
under the appended mask) of each (batch row, KV head). Its splits (split-KV, for decode over long prefixes) are merged
with FP32 statistics (ALGORITHMS.md eq. 15) by a second kernel.

CPU tensors run under the Triton interpreter only: ``TRITON_INTERPRET=1`` set before triton is first imported.
"""

from __future__ import annotations

from itertools import pairwise

import torch

from ...validation import is_int
from ..compacted_inputs import AppendedTokens, CompactedPrefix, check_inputs, key_groups
from .attention_kernel import MASK_ADDITIVE, MASK_BOOL, MASK_CAUSAL, KeyStore, run_attention
from .runtime import check_num_splits, check_runs_on, check_tensor


def _check_offsets(prefix_offsets: list[int], n_entries: int) -> list[int]:
    offsets = list(prefix_offsets) if isinstance(prefix_offsets, (list, tuple)) else []
    if len(offsets) < 2 or any(not is_int(x) for x in offsets):
        raise ValueError(f"prefix.offsets must be H_kv + 1 >= 2 Python ints (row offsets), got {prefix_offsets!r}")
    if offsets[0] < 0 or offsets[-1] > n_entries or any(a > b for a, b in zip(offsets[:-1], offsets[1:])):
        raise ValueError(
            f"prefix.offsets must be non-decreasing within [0, {n_entries}] (the prefix rows), got {offsets}"
        )
    return offsets


def _check_quantized(prefix: CompactedPrefix, head_dim: int, value_dim: int, device: torch.device) -> None:
    """The INT4 heads of ``prefix`` (offsets checked) as the kernel reads them: contiguous codes and FP16 scales of
    the `QuantizedHeads` shapes on ``device``, every head's rows within its storage (`_check_head_rows`); ValueError
    / TypeError naming the field."""
    quantized = prefix.quantized
    n_codes = quantized.key_codes.shape[0] if quantized.key_codes.dim() == 2 else 0
    n_groups = quantized.key_scales.shape[0] if quantized.key_scales.dim() == 2 else 0
    shapes = {
        "key_codes": (torch.uint8, (n_codes, (head_dim + 1) // 2)),
        "key_scales": (torch.float16, (n_groups, head_dim)),
        "key_offsets": (torch.float16, (n_groups, head_dim)),
        "value_codes": (torch.uint8, (n_codes, (value_dim + 1) // 2)),
        "value_scales": (torch.float16, (n_codes, 1)),
    }
    for field, (dtype, shape) in shapes.items():
        t = check_tensor(f"prefix.quantized.{field}", getattr(quantized, field), 2, dtypes=(dtype,))
        if tuple(t.shape) != shape or not t.is_contiguous() or t.device != device:
            raise ValueError(
                f"prefix.quantized.{field} must be a contiguous {list(shape)} tensor on {device}, got "
                f"{tuple(t.shape)} (strides {t.stride()}) on {t.device}"
            )
    _check_head_rows(prefix, n_codes, n_groups)


def _check_head_rows(prefix: CompactedPrefix, n_codes: int, n_groups: int) -> None:
    """Every KV head's rows of ``prefix`` (with INT4 heads: ``n_codes`` code rows, ``n_groups`` rows of key scales)
    within its storage, as the kernel reads them; ValueError naming the field."""
    quantized = prefix.quantized
    for field in ("int4_heads", "row_starts", "group_starts"):
        if len(getattr(quantized, field)) != prefix.num_kv_heads:
            raise ValueError(
                f"prefix.quantized.{field} must have one entry per KV head ({prefix.num_kv_heads}), "
                f"got {getattr(quantized, field)}"
            )
    for h, (start, end) in enumerate(pairwise(prefix.offsets)):
        row_start, group_start = quantized.row_starts[h], quantized.group_starts[h]
        if quantized.int4_heads[h]:
            fits = 0 <= row_start <= n_codes - (end - start)
            fits &= 0 <= group_start <= n_groups - key_groups(end - start, quantized.key_group)
        else:
            fits = 0 <= row_start <= prefix.keys.shape[0] - (end - start)
        if not fits:
            raise ValueError(
                f"prefix.quantized.row_starts / group_starts put KV head {h} ({end - start} entries) at rows "
                f"{row_start} / {group_start}, past its storage: they do not match prefix.offsets"
            )


def _appended_mask(mask: torch.Tensor | None, batch: int, q_len: int, n_appended: int):
    """``(kind, tensor [B, q, n] with broadcast strides)`` for the kernel; mask semantics as in the reference."""
    if mask is None:
        return MASK_CAUSAL, None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"appended.mask must be None or a tensor, got {type(mask).__name__}")
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
            f"appended.mask of shape {tuple(mask.shape)} does not broadcast to [B={batch}, 1, q={q_len}, "
            f"n={n_appended}] (one mask for all heads)"
        ) from error
    if mask.dtype == torch.bool:
        return MASK_BOOL, expanded.view(torch.uint8)
    if not mask.is_floating_point():
        raise TypeError(f"appended.mask must be boolean (True = visible) or an additive float mask, got {mask.dtype}")
    return MASK_ADDITIVE, expanded


def triton_compacted_attention(
    query: torch.Tensor,
    prefix: CompactedPrefix,
    appended: AppendedTokens,
    scaling: float,
    softcap: float | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """``compacted_attention`` through `attention_kernel`: the same arguments and ``num_splits``, the same result up
    to floating-point rounding.

    Args:
        query: ``[B, H_q, q, D]`` post-RoPE queries (fp32, fp16 or bf16); ``H_q`` a multiple of ``H_kv``.
        prefix: `CompactedPrefix`: kept keys ``[N, D]`` and values ``[N, D_v]`` (KV head ``h`` in rows
            ``offsets[h]:offsets[h+1]``), logit biases ``[N]`` (read as FP32), ``H_kv + 1`` non-decreasing row
            offsets (Python ints); with INT4 heads (a `QuantizedPrefix`), ``keys`` / ``values`` hold only the other
            heads' rows and the kernel reads the INT4 heads' codes and FP16 scales in place, dequantised in
            registers (nothing dequantised is stored).
        appended: `AppendedTokens`: keys ``[B, H_kv, n, D]``, values ``[B, H_kv, n, D_v]``, mask ``None``
            (causal, bottom-right aligned), boolean (True = visible) or additive float, broadcastable to
            ``[B, 1, q, n]``.
        scaling: logit scale; softcap: optional tanh soft-capping applied before the bias (None or 0: none).
        num_splits: split-KV factor (keys of a head split into this many chunks merged afterwards); ``None``
            chooses from the device (1 on CPU).

    Query, keys and values must share one dtype (fp32 uses IEEE FP32 dot products; fp16/bf16 use FP32
    accumulation with the softmax weights rounded to the value dtype for the value product, as FlashAttention).

    Returns:
        ``[B, q, H_q, D_v]`` in ``query.dtype``.
    """
    check_tensor("query", query, 4)
    check_inputs(prefix, appended)
    check_tensor("prefix.keys", prefix.keys, 2)
    check_tensor("prefix.values", prefix.values, 2)
    check_tensor("prefix.bias", prefix.bias, 1)
    appended_keys = check_tensor("appended.keys", appended.keys, 4)
    appended_values = check_tensor("appended.values", appended.values, 4)
    batch, n_q_heads, q_len, head_dim = query.shape
    n_entries, value_dim = prefix.values.shape
    n_appended = appended_keys.shape[-2]
    if prefix.keys.shape[1] != head_dim or appended_keys.shape[-1] != head_dim:
        raise ValueError(
            f"keys must have the query head dim {head_dim}: prefix.keys {tuple(prefix.keys.shape)}, "
            f"appended.keys {tuple(appended_keys.shape)}"
        )
    if prefix.keys.shape[0] != n_entries or (prefix.quantized is None and prefix.bias.shape[0] != n_entries):
        raise ValueError(
            f"prefix.keys {tuple(prefix.keys.shape)}, prefix.values {tuple(prefix.values.shape)} and prefix.bias "
            f"{tuple(prefix.bias.shape)} must have the same number of rows N"
        )
    offsets = _check_offsets(prefix.offsets, prefix.bias.shape[0])
    n_kv_heads = len(offsets) - 1
    if n_q_heads % n_kv_heads:
        raise ValueError(f"{n_q_heads} query heads cannot be grouped over {n_kv_heads} KV heads")
    if prefix.quantized is not None:
        _check_quantized(prefix._replace(offsets=offsets), head_dim, value_dim, query.device)
    if tuple(appended_keys.shape[:3]) != (batch, n_kv_heads, n_appended):
        raise ValueError(
            f"appended.keys must be [B={batch}, H_kv={n_kv_heads}, n, D], got {tuple(appended_keys.shape)}"
        )
    if tuple(appended_values.shape) != (batch, n_kv_heads, n_appended, value_dim):
        raise ValueError(
            f"appended.values must be [B={batch}, H_kv={n_kv_heads}, n={n_appended}, D_v={value_dim}], "
            f"got {tuple(appended_values.shape)}"
        )
    tensors = {
        "prefix.keys": prefix.keys,
        "prefix.values": prefix.values,
        "appended.keys": appended_keys,
        "appended.values": appended_values,
    }
    for name, t in tensors.items():
        if t.dtype != query.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but query has {query.dtype}: cast them to one dtype")
    for name, t in {**tensors, "prefix.bias": prefix.bias}.items():
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device} but query is on {query.device}: move them to one device")
    check_runs_on(query.device)
    check_num_splits(num_splits)
    mask_kind, mask = _appended_mask(appended.mask, batch, q_len, n_appended)

    out = torch.empty(batch, q_len, n_q_heads, value_dim, dtype=query.dtype, device=query.device)
    if out.numel() == 0:
        return out
    store = KeyStore(appended_keys, appended_values, mask_kind, mask)
    return run_attention(query, out, [store], scaling, softcap, num_splits, prefix._replace(offsets=offsets))
