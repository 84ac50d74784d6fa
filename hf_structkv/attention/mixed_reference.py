"""Plain-torch reference attention over the disjoint partitions of a mixed-precision cache layer (PASK B.5, eq. 15).

A layer's visible keys live in exactly one of: a compacted prefix (a shared tool catalogue: ragged per KV head, with
per-entry logit biases, `PrefixPartition`), a high-precision store (BF16, or the model dtype), a packed INT4 store
(codes and FP16 scales per token x KV-head row, dequantised here, inside attention) and the recent region (the
newest tokens, the current step's included). Each partition yields FP32 softmax statistics; they are merged exactly
with `merge_partitions`. This defines correctness for the torch backend's fused path
(`mixed_sdpa.fused_mixed_precision_attention`: one SDPA call per KV head over all partitions) and for the Triton
mixed-precision kernel (which serves layers without a prefix); the ``reference`` backend serves it.

A prefill (many query rows over many keys) runs in blocks of query rows, each block's logits bounded by
``max_score_elements`` (`SCORE_BLOCK_ELEMENTS` by default), so its memory grows as ``block x keys``, not as
``queries x keys``; rows are independent, so the blocks' outputs are the unblocked output.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..quant.int4 import dequantize_int4
from ..quant.int4_centred import dequantize_int4_centred
from .compacted_inputs import CompactedPrefix
from .partitions import PartitionStats, merge_partitions, partition_stats


@dataclass(frozen=True)
class DensePartition:
    """Keys and values held as floating-point tensors.

    Attributes:
        keys: ``[B, H_kv, n, D]``; values: ``[B, H_kv, n, D_v]``.
        visible: bool ``[B, q, n]`` (True = the query row sees the entry).
    """

    keys: torch.Tensor
    values: torch.Tensor
    visible: torch.Tensor

    @property
    def num_kv_heads(self) -> int:
        return self.keys.shape[1]

    def float_keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys.float(), self.values.float()

    def float_head(self, h: int) -> tuple[torch.Tensor, torch.Tensor]:
        """FP32 keys ``[B, n, D]`` and values ``[B, n, D_v]`` of KV head ``h``."""
        return self.keys[:, h].float(), self.values[:, h].float()


@dataclass(frozen=True)
class Int4Partition:
    """Keys and values held as packed INT4 codes with one FP16 scale per token x KV-head row (`quantize_int4`); the
    keys optionally centred (`hf_structkv.quant.int4_centred`: ``k̂ = spread ⊙ (code · scale) + centre``).

    Attributes:
        key_codes: uint8 ``[B, H_kv, n, ceil(D/2)]``; key_scales: fp16 ``[B, H_kv, n, 1]``.
        value_codes / value_scales: the same for values (``D_v``).
        head_dim / value_dim: ``D`` and ``D_v`` (unpadded).
        visible: bool ``[B, q, n]``.
        key_centre / key_spread: fp16 ``[B, H_kv, 1, D]`` of centred keys, or both ``None`` (plain rows).
    """

    key_codes: torch.Tensor
    key_scales: torch.Tensor
    value_codes: torch.Tensor
    value_scales: torch.Tensor
    head_dim: int
    value_dim: int
    visible: torch.Tensor
    key_centre: torch.Tensor | None = None
    key_spread: torch.Tensor | None = None

    @property
    def num_kv_heads(self) -> int:
        return self.key_codes.shape[1]

    @property
    def centred(self) -> bool:
        return self.key_centre is not None

    def _keys(self, codes: torch.Tensor, scales: torch.Tensor, h: int | slice) -> torch.Tensor:
        if self.key_centre is None:
            return dequantize_int4(codes, scales, self.head_dim)
        centre, spread = self.key_centre[:, h], self.key_spread[:, h]
        return dequantize_int4_centred(codes, scales, centre, spread, self.head_dim)

    def float_keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self._keys(self.key_codes, self.key_scales, slice(None))
        values = dequantize_int4(self.value_codes, self.value_scales, self.value_dim)
        return keys, values

    def float_head(self, h: int) -> tuple[torch.Tensor, torch.Tensor]:
        """FP32 keys ``[B, n, D]`` and values ``[B, n, D_v]`` of KV head ``h``, dequantised from that head's codes
        only."""
        keys = self._keys(self.key_codes[:, h], self.key_scales[:, h], h)
        values = dequantize_int4(self.value_codes[:, h], self.value_scales[:, h], self.value_dim)
        return keys, values


@dataclass(frozen=True)
class PrefixPartition:
    """A compacted prefix shared by every batch row and visible to every query: per KV head ``h`` its kept entries
    (``prefix.head(h)``: keys ``[L_h, D]``, values ``[L_h, D_v]``, FP32 biases ``[L_h]``); entry ``j`` scores
    ``softcap(q . k_j * scaling) + bias_j``, as in `compacted_attention`.

    Attributes:
        prefix: the `CompactedPrefix` as the `CompactedLayer` serves it (``served_prefix``; INT4 heads are
            dequantised by its ``head``).
    """

    prefix: CompactedPrefix

    @property
    def num_kv_heads(self) -> int:
        return self.prefix.num_kv_heads


Partition = DensePartition | Int4Partition | PrefixPartition

SCORE_BLOCK_ELEMENTS = 1 << 25
"""Default largest number of FP32 logits (``B x H_q x rows x n``) one block of query rows holds per partition
(128 MiB); each partition's logits exist one at a time, next to a few same-sized intermediates (softcap, mask, exp)."""


def _prefix_stats(
    grouped_query: torch.Tensor, prefix: CompactedPrefix, scaling: float, softcap: float | None
) -> PartitionStats:
    """FP32 statistics of a compacted prefix for ``grouped_query`` ``[B, H_kv, g, q, D]``: per KV head over its own
    ``L_h`` entries (biases added), stacked to ``[B, H_kv, g, q]`` / ``[B, H_kv, g, q, D_v]``."""
    per_head = []
    for h in range(prefix.num_kv_heads):
        keys, values, bias = prefix.head(h)  # [L_h, D], [L_h, D_v], [L_h]
        scores = (grouped_query[:, h] @ keys.float().transpose(-1, -2)) * scaling  # [B, g, q, L_h]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        per_head.append(partition_stats(scores + bias.float(), values))
    return PartitionStats(*(torch.stack(field, dim=1) for field in zip(*per_head, strict=True)))


def _scores(
    grouped_query: torch.Tensor, part: DensePartition | Int4Partition, scaling: float, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 logits ``[B, H_kv, g, q, n]`` of one partition for ``grouped_query`` ``[B, H_kv, g, q, D]`` (invisible
    entries ``-inf``) and its values ``[B, H_kv, n, D_v]``."""
    keys, values = part.float_keys_values()  # [B, H_kv, n, D], [B, H_kv, n, D_v]
    scores = (grouped_query @ keys.unsqueeze(2).transpose(-1, -2)) * scaling  # [B, H_kv, g, q, n]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    return scores.masked_fill(~part.visible[:, None, None], float("-inf")), values


def _stats(grouped_query: torch.Tensor, part: Partition, scaling: float, softcap: float | None) -> PartitionStats:
    """FP32 statistics of one partition for ``grouped_query`` ``[B, H_kv, g, q, D]``."""
    if isinstance(part, PrefixPartition):
        return _prefix_stats(grouped_query, part.prefix, scaling, softcap)
    scores, values = _scores(grouped_query, part, scaling, softcap)
    return partition_stats(scores, values.unsqueeze(2))


def _float_partition(part: Partition) -> Partition:
    """``part`` with its keys and values in FP32 (INT4 dequantised), so that blocks of query rows share one copy."""
    if isinstance(part, PrefixPartition):
        return PrefixPartition(part.prefix.dense(torch.float32))
    return DensePartition(*part.float_keys_values(), part.visible)


def num_entries(part: Partition) -> int:
    """Entries a query row scores in ``part`` (for a prefix: its longest KV head)."""
    if isinstance(part, PrefixPartition):
        offsets = part.prefix.offsets
        return max((stop - start for start, stop in zip(offsets, offsets[1:])), default=0)
    return part.visible.shape[-1]


def rows_per_block(q_len: int, logits_per_row: int, max_score_elements: int) -> int:
    """Query rows per block: the most of ``q_len`` rows whose ``logits_per_row`` FP32 logits each fit
    ``max_score_elements`` (at least one row).

    Raises:
        ValueError: ``max_score_elements`` is not a positive int.
    """
    if isinstance(max_score_elements, bool) or not isinstance(max_score_elements, int) or max_score_elements < 1:
        raise ValueError(f"max_score_elements must be a positive int, got {max_score_elements!r}")
    return max(1, min(q_len, max_score_elements // max(logits_per_row, 1)))


def _row_block(query: torch.Tensor, partitions: list[Partition], max_score_elements: int) -> int:
    """Query rows per block of the reference: the most whose logits ``[B, H_q, rows, n]`` of the largest partition
    fit ``max_score_elements``."""
    batch, n_q_heads, q_len, _ = query.shape
    per_row = batch * n_q_heads * max(num_entries(part) for part in partitions)
    return rows_per_block(q_len, per_row, max_score_elements)


def group_query(query: torch.Tensor, partitions: list[Partition]) -> torch.Tensor:
    """``query`` ``[B, H_q, q, D]`` as FP32 ``[B, H_kv, g, q, D]`` over the partitions' KV heads.

    Raises:
        ValueError: no partition, partitions with different numbers of KV heads, or ``H_q`` not a multiple of them.
    """
    if not partitions:
        raise ValueError("partitions must hold at least one partition")
    batch, n_q_heads, q_len, head_dim = query.shape
    n_kv_heads = partitions[0].num_kv_heads
    if any(part.num_kv_heads != n_kv_heads for part in partitions) or n_q_heads % n_kv_heads:
        raise ValueError(
            f"{n_q_heads} query heads cannot be grouped over the partitions' KV heads "
            f"{[part.num_kv_heads for part in partitions]}"
        )
    return query.float().view(batch, n_kv_heads, n_q_heads // n_kv_heads, q_len, head_dim)


def mixed_precision_attention(
    query: torch.Tensor,
    partitions: list[Partition],
    scaling: float,
    softcap: float | None = None,
    max_score_elements: int = SCORE_BLOCK_ELEMENTS,
) -> torch.Tensor:
    """Softmax attention over disjoint key partitions, merged with shared FP32 statistics (eq. 15).

    Args:
        query: ``[B, H_q, q, D]`` post-RoPE queries; ``H_q`` a multiple of ``H_kv`` (GQA: query head ``i`` reads KV
            head ``i // (H_q / H_kv)``; keys are never repeated).
        partitions: each visible key in exactly one partition; empty partitions (``n = 0``) contribute nothing; a
            `PrefixPartition` is visible to every row.
        scaling: logit scale; softcap: optional tanh soft-capping.
        max_score_elements: the most FP32 logits one partition holds at once: query rows are served in blocks of
            ``max(1, max_score_elements // (B * H_q * n))`` rows (``n`` the largest partition's entries).

    Returns:
        ``[B, q, H_q, D_v]`` in ``query.dtype``; a row that sees no key gets zeros.
    """
    batch, n_q_heads, q_len, _ = query.shape
    grouped = group_query(query, partitions)
    served = [_float_partition(part) for part in partitions]
    rows = _row_block(query, served, max_score_elements)
    blocks = []
    for start in range(0, max(q_len, 1), rows):
        block = slice(start, start + rows)
        parts = [
            part if isinstance(part, PrefixPartition) else replace(part, visible=part.visible[:, block])
            for part in served
        ]
        stats = [_stats(grouped[..., block, :], part, scaling, softcap) for part in parts]
        blocks.append(merge_partitions(stats))  # [B, H_kv, g, rows, D_v]
    out = torch.cat(blocks, dim=-2) if len(blocks) > 1 else blocks[0]
    return out.reshape(batch, n_q_heads, q_len, -1).transpose(1, 2).contiguous().to(query.dtype)


def attention_probabilities(
    query: torch.Tensor,
    partitions: list[Partition],
    scaling: float,
    softcap: float | None = None,
) -> list[torch.Tensor]:
    """Attention probabilities of every query head for every entry. The softmax runs over the union of the
    partitions, as in `mixed_precision_attention` (same logits, FP32), so a row's probabilities sum to 1 per query
    head; a row that sees no key gets zeros.

    Args:
        query, partitions, scaling, softcap: as `mixed_precision_attention`.

    Returns:
        One FP32 tensor ``[B, H_kv, g, q, n]`` per partition (``g`` query heads per KV head).
    """
    if any(isinstance(part, PrefixPartition) for part in partitions):
        raise ValueError(
            "attention probabilities are per slot of a mixed-precision layer; a compacted prefix (PrefixPartition) "
            "has no slots: leave it out"
        )
    grouped = group_query(query, partitions)
    scores = [_scores(grouped, part, scaling, softcap)[0] for part in partitions]  # each [B, H_kv, g, q, n]
    row_max = torch.stack([s.amax(dim=-1) if s.shape[-1] else s.new_full(s.shape[:-1], -torch.inf) for s in scores])
    row_max = row_max.amax(dim=0)  # [B, H_kv, g, q]
    shift = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = [torch.exp(s - shift.unsqueeze(-1)) for s in scores]
    total = sum(w.sum(dim=-1) for w in weights)
    inverse = torch.where(total > 0, 1 / total.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(total))
    return [w * inverse.unsqueeze(-1) for w in weights]


def summed_mass(probabilities: list[torch.Tensor], value_norms: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The mass each entry receives, summed over query heads and query rows.

    Args:
        probabilities: `attention_probabilities`' output, one ``[B, H_kv, g, q, n]`` per partition.
        value_norms: optional, one FP32 ``[B, H_kv, g, n]`` per partition (`projected_value_norms`): each query
            head's probability of an entry is multiplied by it before the sum (CriticalKV's output-perturbation
            score ``sum_h a_hj * ||v_j W_o^h||_1``).

    Returns:
        One FP32 tensor ``[B, n]`` per partition.
    """
    if value_norms is not None:
        if len(value_norms) != len(probabilities):
            raise ValueError(
                f"value_norms needs one tensor per partition ({len(probabilities)}), got {len(value_norms)}"
            )
        probabilities = [p * norms.unsqueeze(-2) for p, norms in zip(probabilities, value_norms, strict=True)]
    return [p.sum(dim=(1, 2, 3)) for p in probabilities]


def attention_mass(
    query: torch.Tensor,
    partitions: list[Partition],
    scaling: float,
    softcap: float | None = None,
    value_norms: list[torch.Tensor] | None = None,
    max_score_elements: int = SCORE_BLOCK_ELEMENTS,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Attention probability mass each entry receives, summed over query heads and query rows: the statistic of
    attention-based retention baselines (H2O, SnapKV, MiKV); `summed_mass` of `attention_probabilities`, computed
    over blocks of query rows as `mixed_precision_attention` serves them (``max_score_elements``), so a prompt of
    ``P`` tokens needs ``block x P`` probabilities at once, not ``P x P``; rows are independent, so the sums are the
    unblocked ones. With ``value_norms`` the value-weighted mass (CriticalKV) is summed from the same probabilities:
    one pass over the scores yields both.

    Args:
        query, partitions, scaling, softcap: as `attention_probabilities`.
        value_norms: optional, one FP32 ``[B, H_kv, g, n]`` per partition (`projected_value_norms`).
        max_score_elements: as `mixed_precision_attention`.

    Returns:
        ``(mass, weighted)``: ``mass`` one FP32 tensor ``[B, n]`` per partition (its entries in order; a row that sees
        no key adds nothing); ``weighted`` the same for the value-weighted mass, ``None`` without ``value_norms``.
    """
    q_len = query.shape[2]
    rows = _row_block(query, partitions, max_score_elements)
    mass = [torch.zeros(part.visible.shape[0], part.visible.shape[-1], device=query.device) for part in partitions]
    weighted = None if value_norms is None else [m.clone() for m in mass]
    for start in range(0, max(q_len, 1), rows):
        block = slice(start, start + rows)
        parts = [replace(part, visible=part.visible[:, block]) for part in partitions]
        probabilities = attention_probabilities(query[:, :, block], parts, scaling, softcap)
        for total, block_mass in zip(mass, summed_mass(probabilities), strict=True):
            total += block_mass
        if weighted is not None:
            for total, block_mass in zip(weighted, summed_mass(probabilities, value_norms), strict=True):
                total += block_mass
    return mass, weighted


def head_output_projections(module: torch.nn.Module, num_query_heads: int, value_dim: int) -> torch.Tensor:
    """Each query head's slice of the attention output projection, FP32 ``[H_q, D_v, d_model]``: head ``h``'s output
    ``o_h [D_v]`` enters the residual stream as ``o_h @ result[h]`` (``o_proj.weight[:, h*D_v:(h+1)*D_v].T``).

    A quantized ``o_proj`` (its ``weight`` holds codes, not the matrix: bitsandbytes' 8-bit and 4-bit layers) is read
    as it computes: ``o_proj(I) − o_proj(0)`` (the identity's rows, its bias removed).

    Raises:
        ValueError: ``module`` has no ``o_proj`` linear layer of ``H_q * D_v`` inputs.
    """
    projection, inputs = getattr(module, "o_proj", None), num_query_heads * value_dim
    weight = getattr(projection, "weight", None)
    quantized = isinstance(weight, torch.Tensor) and not weight.is_floating_point()
    if quantized and isinstance(projection, torch.nn.Module) and getattr(projection, "in_features", None) == inputs:
        with torch.no_grad():
            identity = torch.eye(inputs, device=weight.device)
            weight = (projection(identity) - projection(torch.zeros_like(identity[:1]))).float().T  # [d_model, inputs]
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != inputs:
        raise ValueError(
            f"value-weighted attention statistics (CriticalKV) need the attention module's output projection o_proj "
            f"with {num_query_heads} x {value_dim} inputs; {type(module).__name__} has none"
        )
    return weight.float().view(weight.shape[0], num_query_heads, value_dim).permute(1, 2, 0)


def projected_value_norms(part: DensePartition | Int4Partition, projections: torch.Tensor) -> torch.Tensor:
    """L1 norm of every entry's value as each query head writes it into the residual stream, ``||v_j W_o^h||_1``.

    Args:
        part: a partition with values ``[B, H_kv, n, D_v]`` (INT4 dequantised).
        projections: `head_output_projections` ``[H_q, D_v, d_model]``, query head ``i`` reading KV head
            ``i // (H_q / H_kv)``.

    Returns:
        FP32 ``[B, H_kv, g, n]``, ``g = H_q / H_kv``.
    """
    _, values = part.float_keys_values()  # [B, H_kv, n, D_v]
    n_kv_heads = values.shape[1]
    grouped = projections.view(n_kv_heads, projections.shape[0] // n_kv_heads, *projections.shape[1:])
    return (values.unsqueeze(2) @ grouped.unsqueeze(0)).abs().sum(dim=-1)  # [B, H_kv, g, n]
