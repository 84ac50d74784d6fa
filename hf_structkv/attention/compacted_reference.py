"""Plain-torch reference attention over a compacted prefix (ragged per KV head, per-entry logit bias) and the
dense appended tokens. It defines correctness for the Triton kernels; it runs on any device and dtype."""

from __future__ import annotations

import torch

from .compacted_inputs import AppendedTokens, CompactedPrefix, check_inputs
from .partitions import merge_partitions, partition_stats


def appended_scores_mask(mask: torch.Tensor | None, q_len: int, n_appended: int, device: torch.device) -> torch.Tensor:
    """Additive FP32 mask over the appended tokens, broadcastable to ``[B, 1, q, n]``.

    Args:
        mask: ``None`` (plain causal, bottom-right aligned: query ``i`` sees appended keys ``0 .. n - q + i``),
            a boolean ``[B|1, 1, q, n]`` mask (True = visible) or an additive float mask of that shape.
        q_len: number of queries ``q``.
        n_appended: number of appended keys ``n`` (including the current queries' own keys).
    """
    if mask is None:
        q_idx = torch.arange(q_len, device=device).unsqueeze(-1)
        k_idx = torch.arange(n_appended, device=device)
        visible = k_idx <= q_idx + (n_appended - q_len)
        mask = visible[None, None]
    if mask.shape[-1] != n_appended:
        raise ValueError(
            f"attention mask covers {mask.shape[-1]} keys but {n_appended} tokens are appended after the compacted "
            "prefix; the mask of a compacted cache spans the appended tokens only (build it with the model's own "
            "mask creation, not by hand)"
        )
    if mask.dtype == torch.bool:
        return torch.where(mask, 0.0, float("-inf")).to(torch.float32)
    return mask.to(torch.float32)


def kv_grouping(query: torch.Tensor, prefix: CompactedPrefix, appended: AppendedTokens) -> tuple[int, int]:
    """``(H_kv, g)``: the number of KV heads (from the prefix's ``H_kv + 1`` offsets) and query heads per KV head.

    Raises:
        TypeError: ``prefix`` is not a `CompactedPrefix` or ``appended`` not `AppendedTokens`.
        ValueError: ``H_q`` is not a multiple of ``H_kv``, or the appended keys have another number of KV heads.
    """
    check_inputs(prefix, appended)
    n_q_heads, n_kv_heads = query.shape[1], prefix.num_kv_heads
    if n_kv_heads < 1 or n_q_heads % n_kv_heads:
        raise ValueError(f"{n_q_heads} query heads cannot be grouped over {n_kv_heads} KV heads")
    if appended.keys.shape[1] != n_kv_heads:
        raise ValueError(f"appended keys have {appended.keys.shape[1]} KV heads, the prefix has {n_kv_heads}")
    return n_kv_heads, n_q_heads // n_kv_heads


def compacted_attention(
    query: torch.Tensor, prefix: CompactedPrefix, appended: AppendedTokens, scaling: float, softcap: float | None = None
) -> torch.Tensor:
    """Softmax attention over [compacted prefix (with biases) ‖ appended tokens], merged with FP32 statistics.

    The prefix is shared by the whole batch and fully visible to every query; the appended tokens follow the mask.
    Per KV head ``h`` the scores of prefix entry ``j`` are ``softcap(q·k_j · scaling) + bias_j``.

    Args:
        query: ``[B, H_q, q, D]`` post-RoPE queries; ``H_q`` a multiple of the number of KV heads ``H_kv``.
        prefix: the compacted prefix (`CompactedPrefix`: keys ``[N, D]``, values ``[N, D_v]``, biases ``[N]``,
            ``H_kv + 1`` row offsets).
        appended: the tokens appended after the prefix (`AppendedTokens`: keys ``[B, H_kv, n, D]``, values
            ``[B, H_kv, n, D_v]``, mask as in ``appended_scores_mask``).
        scaling: logit scale (``1/sqrt(D)`` for most models).
        softcap: optional tanh logit soft-capping (Gemma 2 style), applied before the bias.

    Returns:
        ``[B, q, H_q, D_v]`` attention output in ``query.dtype`` (the layout transformers' attention functions return).
    """
    q_len = query.shape[-2]
    n_kv_heads, group = kv_grouping(query, prefix, appended)
    n_appended = appended.keys.shape[-2]
    add_mask = appended_scores_mask(appended.mask, q_len, n_appended, query.device)

    def scores_of(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        s = (q @ k.to(torch.float32).transpose(-1, -2)) * scaling
        return softcap * torch.tanh(s / softcap) if softcap else s

    outputs = []
    for h in range(n_kv_heads):
        q_h = query[:, h * group : (h + 1) * group].to(torch.float32)  # [B, g, q, D]
        keys, values, bias = prefix.head(h)
        prefix_scores = scores_of(q_h, keys) + bias.to(torch.float32)
        appended_scores = scores_of(q_h, appended.keys[:, h : h + 1]) + add_mask
        parts = [
            partition_stats(prefix_scores, values),
            partition_stats(appended_scores, appended.values[:, h : h + 1]),
        ]
        outputs.append(merge_partitions(parts))  # [B, g, q, D_v]
    out = torch.cat(outputs, dim=1)  # [B, H_q, q, D_v]
    return out.transpose(1, 2).contiguous().to(query.dtype)
