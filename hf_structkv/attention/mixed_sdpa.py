"""Mixed-precision attention through torch's fused ``scaled_dot_product_attention``: the reference's computation
without its per-partition score tensors.

Per KV head, every partition of a mixed-precision layer (a compacted prefix, the high store, the INT4 store
dequantised for that head only, the recent region) becomes one key/value set, and the partitions' visibility and
the prefix biases one additive FP32 mask (``-inf`` where a row does not see a slot, ``bias_j`` on prefix entry
``j``); one SDPA call (FP32 inputs, so FP32 softmax and accumulation) per KV head and block of query rows computes the
softmax over their union, which equals `mixed_precision_attention`'s partition merge (eq. 15) up to rounding.
Blocks of query rows are bounded by the same ``max_score_elements`` as the reference's, counted over the logits
``[B, g, rows, N]`` one call would hold (``N`` every partition's entries of the KV head). At a decode step the
KV head's query heads are rows of one SDPA call over its entries (`grouped_sdpa`), with no copy of them per query
head; on the CPU, where the C kernel builds (`native_int4`), a decode step with INT4 partitions reads them from their
codes instead (`native_int4_rows_stats`: the softmax statistics of every INT4 store of the layer, e.g. one per group
of a ``centred-g128`` layout, for every batch row and KV head in one call), and
so are a compacted prefix's INT4 heads that `reads_codes` (`native_int4_prefix_stats`, a compacted tool catalogue's),
merged with the other partitions' statistics from their FP32 scores by eq. 15, with nothing dequantised. A row that
sees no key (padding) gets zeros, as in the reference (SDPA's softmax over nothing may give NaN). Soft-capping (tanh)
has no SDPA form: such a call goes to the reference.

Attention statistics (H2O / SnapKV / MiKV / CriticalKV) are not computed here: the layer computes them afterwards
in a second pass with the reference's `attention_mass` whichever function served the output
(`MixedPrecisionLayer.record_attention`).
"""

from __future__ import annotations

import torch

from .grouped_sdpa import grouped_sdpa
from .int4_head_stats import reads_codes
from .mixed_reference import (
    SCORE_BLOCK_ELEMENTS,
    DensePartition,
    Int4Partition,
    Partition,
    PrefixPartition,
    group_query,
    mixed_precision_attention,
    num_entries,
    rows_per_block,
)
from .native_int4 import native_int4_prefix_stats, native_int4_rows_stats, runs_natively
from .partitions import PartitionStats, merge_partitions, partition_stats


def _head_entries(
    h: int, batch: int, prefixes: list[PrefixPartition], slots: list[DensePartition | Int4Partition]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KV head ``h``'s entries of every partition, prefixes first: FP32 keys ``[B, N, D]``, values ``[B, N, D_v]``
    and the prefix entries' biases ``[L]`` (``L <= N``: the first ``L`` entries)."""
    prefix_heads = [part.prefix.head(h) for part in prefixes]  # each ([L_h, D], [L_h, D_v], [L_h])
    slot_heads = [part.float_head(h) for part in slots]  # each ([B, n, D], [B, n, D_v])
    keys = [k.float().expand(batch, -1, -1) for k, _, _ in prefix_heads] + [k for k, _ in slot_heads]
    values = [v.float().expand(batch, -1, -1) for _, v, _ in prefix_heads] + [v for _, v in slot_heads]
    bias = [b.float() for _, _, b in prefix_heads]
    return torch.cat(keys, dim=1), torch.cat(values, dim=1), torch.cat(bias) if bias else keys[0].new_zeros(0)


def fused_mixed_precision_attention(
    query: torch.Tensor,
    partitions: list[Partition],
    scaling: float,
    softcap: float | None = None,
    max_score_elements: int = SCORE_BLOCK_ELEMENTS,
) -> torch.Tensor:
    """`mixed_precision_attention` (same arguments, shapes and result up to rounding) with one fused SDPA call per KV
    head and block of query rows.

    Args:
        query: ``[B, H_q, q, D]``; partitions: `DensePartition` / `Int4Partition` (visibility ``[B, q, n]``) and
            `PrefixPartition` (visible to every row, per-entry biases), ``H_kv`` KV heads each.
        scaling: logit scale; softcap: optional tanh soft-capping (served by the reference).
        max_score_elements: the most FP32 logits ``B x g x rows x N`` one call covers (``N``: every partition's
            entries, a prefix's longest KV head): blocks of ``max(1, max_score_elements // (B * g * N))`` query rows.

    Returns:
        ``[B, q, H_q, D_v]`` in ``query.dtype``; a row that sees no key gets zeros.
    """
    if softcap:
        return mixed_precision_attention(query, partitions, scaling, softcap, max_score_elements)
    grouped = group_query(query, partitions)  # [B, H_kv, g, q, D] FP32
    batch, n_kv_heads, group, q_len, _ = grouped.shape
    code_heads = _prefix_code_heads(partitions) if q_len == 1 else {}
    if q_len == 1 and _reads_codes_natively(partitions, code_heads, query.device):
        out = _decode_reading_codes(grouped, partitions, code_heads, scaling)  # [B, H_kv, g, 1, D_v]
        return out.reshape(batch, -1, 1, out.shape[-1]).transpose(1, 2).contiguous().to(query.dtype)
    rows = rows_per_block(q_len, batch * group * sum(num_entries(part) for part in partitions), max_score_elements)
    prefixes = [part for part in partitions if isinstance(part, PrefixPartition)]
    slots = [part for part in partitions if not isinstance(part, PrefixPartition)]
    heads = []
    for h in range(n_kv_heads):
        keys, values, bias = _head_entries(h, batch, prefixes, slots)  # [B, N, D], [B, N, D_v], [L]
        out = values.new_zeros(batch, group, q_len, values.shape[-1])  # rows without a visible key stay zero
        if keys.shape[1] == 0:
            heads.append(out)
            continue
        keys, values = keys.unsqueeze(1), values.unsqueeze(1)  # [B, 1, N, D], [B, 1, N, D_v]
        for start in range(0, q_len, rows):
            block = slice(start, start + rows)
            block_query = grouped[:, h, :, block]  # [B, g, r, D]
            mask = [bias.expand(batch, block_query.shape[-2], -1)]  # [B, r, L]
            if slots:
                visible = torch.cat([part.visible[:, block] for part in slots], dim=-1)  # [B, r, n]
                mask.append(torch.zeros(visible.shape, dtype=torch.float32, device=keys.device))
                mask[-1].masked_fill_(~visible, float("-inf"))
            mask = torch.cat(mask, dim=-1).unsqueeze(1)  # [B, 1, r, N]
            attended = grouped_sdpa(block_query, keys, values, mask, scaling)  # [B, g, r, D_v]
            if bias.numel() == 0:  # without prefix entries a padded row may see nothing: zeros, as the reference
                attended = attended.masked_fill(~visible.any(dim=-1)[:, None, :, None], 0.0)
            out[:, :, block] = attended
        heads.append(out)
    return torch.cat(heads, dim=1).transpose(1, 2).contiguous().to(query.dtype)


def _prefix_code_heads(partitions: list[Partition]) -> dict[int, list[int]]:
    """Per prefix partition (by its index in ``partitions``), its KV heads that are read from their codes
    (`reads_codes`)."""
    return {
        i: [h for h in range(p.prefix.num_kv_heads) if reads_codes(p.prefix, h)]
        for i, p in enumerate(partitions)
        if isinstance(p, PrefixPartition)
    }


def _reads_codes_natively(partitions: list[Partition], code_heads: dict[int, list[int]], device: torch.device) -> bool:
    """Whether a decode step has INT4 entries to read from their codes (an INT4 store, or prefix heads in
    ``code_heads``) and the C kernel serves every such partition's dimensions on ``device``."""
    dims = [(p.head_dim, p.value_dim) for p in partitions if isinstance(p, Int4Partition)]
    dims += [
        (partitions[i].prefix.keys.shape[-1], partitions[i].prefix.values.shape[-1]) for i, h in code_heads.items() if h
    ]
    return bool(dims) and all(runs_natively(device, *pair) for pair in dims)


def _decode_reading_codes(
    grouped: torch.Tensor, partitions: list[Partition], code_heads: dict[int, list[int]], scaling: float
) -> torch.Tensor:
    """A decode step with the INT4 entries read from their codes (the INT4 stores by one `native_int4_rows_stats`
    call, the prefix heads in ``code_heads`` by `native_int4_prefix_stats`, one call per prefix partition, each for
    every batch row and KV head) and the other entries' statistics from their FP32 scores, merged (eq. 15).

    Args:
        grouped: ``[B, H_kv, g, 1, D]`` FP32 queries.
        code_heads: `_prefix_code_heads` of ``partitions``.

    Returns:
        ``[B, H_kv, g, 1, D_v]`` FP32; a row that sees no key gets zeros.
    """
    batch, n_kv_heads, group = grouped.shape[:3]
    dense = [part for part in partitions if isinstance(part, DensePartition)]
    query = grouped[:, :, :, 0]  # [B, H_kv, g, D]
    code_stats = _int4_stores_stats(
        query, [p for p in partitions if isinstance(p, Int4Partition)], scaling
    )  # each [B, H_kv, g, 1] and [B, H_kv, g, 1, D_v]
    prefix_stats: dict[int, list[PartitionStats]] = {h: [] for h in range(n_kv_heads)}  # each [B, g], [B, g, D_v]
    plain: dict[int, list[PrefixPartition]] = {h: [] for h in range(n_kv_heads)}
    flat_query = query.reshape(batch, n_kv_heads * group, 1, -1)
    for i, heads in code_heads.items():
        stats = (
            dict(zip(heads, native_int4_prefix_stats(flat_query, scaling, heads, partitions[i].prefix)))
            if heads
            else {}
        )
        for h in range(n_kv_heads):
            if h in stats:
                prefix_stats[h].append(stats[h])
            else:
                plain[h].append(partitions[i])
    visible = (
        torch.cat([p.visible[:, 0] for p in dense], dim=-1) if dense else query.new_zeros(batch, 0, dtype=torch.bool)
    )
    dense_mask = torch.zeros(visible.shape, device=query.device).masked_fill_(~visible, float("-inf"))  # [B, n]
    outputs = []
    for h in range(n_kv_heads):
        keys, values, bias = _head_entries(h, batch, plain[h], dense)  # [B, N, D], [B, N, D_v], [L]
        mask = torch.cat([bias.expand(batch, -1), dense_mask], dim=-1)  # [B, N]
        scores = torch.bmm(query[:, h], keys.transpose(1, 2)) * scaling + mask.unsqueeze(1)  # [B, g, N]
        parts = [partition_stats(scores, values), *prefix_stats[h]]  # batched products, no copy per query head
        parts += [PartitionStats(*(t[:, h, :, 0] for t in stats)) for stats in code_stats]
        outputs.append(merge_partitions(parts))  # [B, g, D_v]
    return torch.stack(outputs, dim=1).unsqueeze(3)


def _int4_stores_stats(query: torch.Tensor, parts: list[Int4Partition], scaling: float) -> list[PartitionStats]:
    """`native_int4_rows_stats` of a layer's INT4 stores for ``query`` ``[B, H_kv, g, D]`` (FP32), in one call;
    centred keys are read from their codes too: ``q · k̂ = (q ⊙ spread) · (code · scale) + q · centre``, the first
    term the plain rows' score for the query ``q ⊙ spread``, the second the store's logit offset for that query.

    Returns:
        per store, `PartitionStats` ``[B, H_kv, g, 1]`` / ``[B, H_kv, g, 1, D_v]``.
    """
    if not parts:
        return []
    queries = torch.stack([query * p.key_spread.float() if p.centred else query for p in parts])  # [S, B, H_kv, g, D]
    offsets = None
    if any(p.centred for p in parts):
        zeros = query.new_zeros(query.shape[:-1])
        offsets = torch.stack([(query * p.key_centre.float()).sum(-1) if p.centred else zeros for p in parts])
    stores = [(p.key_codes, p.key_scales, p.value_codes, p.value_scales, p.visible[:, 0]) for p in parts]
    return native_int4_rows_stats(queries, stores, scaling, offsets)
