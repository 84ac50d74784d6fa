"""`mixed_precision_attention` serves many query rows (a prefill) in blocks of rows whose logits fit
``max_score_elements``: blocked == unblocked over every partition kind (compacted prefix, plain and INT4; dense high
store in bf16; INT4 low store; recent region), GQA, batch 2 with a left-padded row; no block's logits exceed the
bound."""

import pytest
import torch
from test_compacted_int4_cache import int4_cache

import hf_structkv
from hf_structkv.attention import mixed_reference
from hf_structkv.attention.compacted_inputs import CompactedPrefix
from hf_structkv.attention.mixed_reference import (
    DensePartition,
    Int4Partition,
    PrefixPartition,
    mixed_precision_attention,
)
from hf_structkv.models import tiny_model
from hf_structkv.quant import quantize_int4

Q_LEN, SUFFIX = 9, 17  # 9 query rows (the newest slots) over 17 suffix slots
UNBLOCKED = 1 << 40


def plain_prefix(n_kv_heads: int, dim: int, seed: int) -> CompactedPrefix:
    """A ragged bf16 prefix with random biases: KV head ``h`` keeps ``3 + 4h`` entries."""
    g = torch.Generator().manual_seed(seed)
    offsets = [0]
    for h in range(n_kv_heads):
        offsets.append(offsets[-1] + 3 + 4 * h)
    keys = torch.randn(offsets[-1], dim, generator=g).bfloat16()
    values = torch.randn(offsets[-1], dim, generator=g).bfloat16()
    return CompactedPrefix(keys, values, torch.randn(offsets[-1], generator=g) * 0.5, offsets)


def int4_prefix() -> CompactedPrefix:
    """The first layer's prefix of a compacted cache with INT4 KV heads (tiny llama: 2 KV heads, head dim 16)."""
    model = hf_structkv.enable(tiny_model("llama"))
    context = torch.randint(3, 256, (1, 30), generator=torch.Generator().manual_seed(4))
    cache, _ = int4_cache(model, context, key_group=8, plain_heads=(0,), seed=5)
    prefix = cache.layers[0].served_prefix(None)
    assert prefix.quantized is not None and any(prefix.quantized.int4_heads)
    return prefix


def partitions(prefix: CompactedPrefix, n_kv_heads: int, dim: int, seed: int) -> list:
    """Prefix, a bf16 high store, an INT4 low store and the recent region (the last `Q_LEN` slots) over `SUFFIX`
    slots; row 1 left-padded by 5 slots; causal."""
    g = torch.Generator().manual_seed(seed)
    keys, values = (
        torch.randn(2, n_kv_heads, SUFFIX, dim, generator=g),
        torch.randn(2, n_kv_heads, SUFFIX, dim, generator=g),
    )
    rows = torch.arange(Q_LEN).unsqueeze(-1) + (SUFFIX - Q_LEN)
    visible = (torch.arange(SUFFIX) <= rows).expand(2, Q_LEN, SUFFIX).clone()  # [B, q, n]
    visible[1, :, :5] = False  # left padding of row 1
    older = torch.randperm(SUFFIX - Q_LEN, generator=g)
    high, low, recent = older[:3].sort().values, older[3:].sort().values, torch.arange(SUFFIX - Q_LEN, SUFFIX)
    key_codes, key_scales = quantize_int4(keys[:, :, low])
    value_codes, value_scales = quantize_int4(values[:, :, low])
    return [
        PrefixPartition(prefix),
        DensePartition(keys[:, :, high].bfloat16(), values[:, :, high].bfloat16(), visible[..., high]),
        Int4Partition(key_codes, key_scales, value_codes, value_scales, dim, dim, visible[..., low]),
        DensePartition(keys[:, :, recent], values[:, :, recent], visible[..., recent]),
    ]


CASES = {
    "plain prefix, 3 query heads over 1 KV head": (lambda: plain_prefix(1, 8, seed=1), 3, 1, 8),
    "plain prefix, 6 query heads over 2 KV heads": (lambda: plain_prefix(2, 8, seed=2), 6, 2, 8),
    "INT4 prefix, 4 query heads over 2 KV heads": (int4_prefix, 4, 2, 16),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_blocked_rows_equal_one_block_with_a_bounded_score_size(monkeypatch, case, softcap):
    make_prefix, n_q_heads, n_kv_heads, dim = CASES[case]
    parts = partitions(make_prefix(), n_kv_heads, dim, seed=3)
    query = torch.randn(2, n_q_heads, Q_LEN, dim, generator=torch.Generator().manual_seed(6))
    score_sizes = []
    stats = mixed_reference.partition_stats

    def recorded_stats(scores, values):
        score_sizes.append(scores.shape)
        return stats(scores, values)

    monkeypatch.setattr(mixed_reference, "partition_stats", recorded_stats)
    unblocked = mixed_precision_attention(query, parts, 0.3, softcap, max_score_elements=UNBLOCKED)
    assert {shape[-2] for shape in score_sizes} == {Q_LEN}  # one block of every row
    per_row = 2 * n_q_heads * SUFFIX  # the largest partition here is a store of at most SUFFIX slots
    for rows in (1, 2, 4):
        score_sizes.clear()
        blocked = mixed_precision_attention(query, parts, 0.3, softcap, max_score_elements=rows * per_row)
        torch.testing.assert_close(blocked, unblocked, atol=1e-6, rtol=1e-5)
        assert max(shape.numel() for shape in score_sizes) <= rows * per_row
        assert sum(shape[-2] for shape in score_sizes) == Q_LEN * (len(parts) - 1 + n_kv_heads)  # every row once
        assert len(score_sizes) > len(parts) - 1 + n_kv_heads  # in more than one block


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_bad_block_bound_is_refused(bad):
    part = DensePartition(torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4), torch.ones(1, 1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="max_score_elements must be a positive int"):
        mixed_precision_attention(torch.randn(1, 2, 1, 4), [part], 0.5, max_score_elements=bad)
