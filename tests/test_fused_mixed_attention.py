"""`fused_mixed_precision_attention` (one SDPA call per KV head and block of query rows) against the reference
`mixed_precision_attention`: every partition kind (compacted prefix with biases, plain or INT4; a high store; an INT4
store; the recent region), GQA, batch 2 with left padding and rows that see no key, fp32 / bf16 / fp16 inputs, one
query row and a prefill in several blocks of a tiny score budget; soft-capping goes to the reference."""

import functools

import pytest
import torch
from test_blocked_mixed_attention import int4_prefix, plain_prefix

from hf_structkv.attention.compacted_inputs import CompactedPrefix
from hf_structkv.attention.mixed_reference import (
    DensePartition,
    Int4Partition,
    PrefixPartition,
    mixed_precision_attention,
)
from hf_structkv.attention.mixed_sdpa import fused_mixed_precision_attention
from hf_structkv.quant import quantize_int4

SUFFIX, RECENT, PAD = 17, 9, 10  # slots; the newest RECENT slots are the recent region; row 1 left-padded by PAD
UNBLOCKED = 1 << 40


def slot_partitions(q_len: int, n_kv_heads: int, dim: int, dtype: torch.dtype, seed: int) -> list:
    """A high store (``dtype``), an INT4 store and the recent region (``dtype``) over ``SUFFIX`` slots, the queries the
    newest ``q_len`` slots, causal; batch row 1 left-padded by ``PAD`` slots, so its query rows at padded positions see
    no slot at all."""
    g = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(2, n_kv_heads, SUFFIX, dim, generator=g) for _ in range(2))
    positions = torch.arange(q_len).unsqueeze(-1) + (SUFFIX - q_len)
    visible = (torch.arange(SUFFIX) <= positions).expand(2, q_len, SUFFIX).clone()  # [B, q, n]
    visible[1, :, :PAD] = False
    visible[1, positions.squeeze(-1) < PAD] = False  # padded query rows see nothing
    older = torch.randperm(SUFFIX - RECENT, generator=g)
    high, low, recent = older[:3].sort().values, older[3:].sort().values, torch.arange(SUFFIX - RECENT, SUFFIX)
    key_codes, key_scales = quantize_int4(keys[:, :, low])
    value_codes, value_scales = quantize_int4(values[:, :, low])
    return [
        DensePartition(keys[:, :, high].to(dtype), values[:, :, high].to(dtype), visible[..., high]),
        Int4Partition(key_codes, key_scales, value_codes, value_scales, dim, dim, visible[..., low]),
        DensePartition(keys[:, :, recent].to(dtype), values[:, :, recent].to(dtype), visible[..., recent]),
    ]


def with_empty_head(prefix: CompactedPrefix) -> CompactedPrefix:
    """``prefix`` with KV head 0's entries dropped (a head that kept nothing: its padded rows see no key)."""
    start = prefix.offsets[1]
    offsets = [0] + [offset - start for offset in prefix.offsets[1:]]
    return CompactedPrefix(prefix.keys[start:], prefix.values[start:], prefix.bias[start:], offsets)


PREFIXES = {
    "no prefix": None,
    "plain prefix": lambda: plain_prefix(2, 16, seed=1),
    "plain prefix, KV head 0 empty": lambda: with_empty_head(plain_prefix(2, 16, seed=2)),
    "INT4 prefix": functools.cache(int4_prefix),  # tiny llama: 2 KV heads, head dim 16
}
DTYPES = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {}, torch.float16: {}}


def case(prefix: str, q_len: int, n_q_heads: int, dtype: torch.dtype, seed: int = 3):
    """``(query [2, H_q, q, 16], partitions)`` over 2 KV heads."""
    parts = slot_partitions(q_len, 2, 16, dtype, seed)
    if PREFIXES[prefix] is not None:
        parts.insert(0, PrefixPartition(PREFIXES[prefix]()))
    query = torch.randn(2, n_q_heads, q_len, 16, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return query, parts


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize("q_len", [1, RECENT])
@pytest.mark.parametrize("n_q_heads", [2, 6])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_equals_the_reference(prefix, q_len, n_q_heads, dtype):
    query, parts = case(prefix, q_len, n_q_heads, dtype)
    want = mixed_precision_attention(query, parts, 0.3)
    got = fused_mixed_precision_attention(query, parts, 0.3)
    assert got.shape == want.shape == (2, q_len, n_q_heads, 16) and got.dtype == dtype
    torch.testing.assert_close(got, want, **DTYPES[dtype])
    if q_len == RECENT and prefix in ("no prefix", "plain prefix, KV head 0 empty"):
        blind = torch.zeros(2, q_len, n_q_heads, dtype=torch.bool)  # rows that see no key, per query head
        blind[1, : PAD - (SUFFIX - q_len), : n_q_heads if prefix == "no prefix" else n_q_heads // 2] = True
        assert not want[blind].any() and not got[blind].any() and got[~blind].abs().amax(-1).gt(0).all()


def math_sdpa(query, keys, values, attn_mask, scale):
    """Unfused softmax attention, NaN on a row whose mask is ``-inf`` everywhere (as torch's math backend gives)."""
    return torch.softmax(query @ keys.transpose(-1, -2) * scale + attn_mask, dim=-1) @ values


def test_rows_that_see_no_key_are_zero_even_where_sdpa_gives_nan(monkeypatch):
    query, parts = case("no prefix", RECENT, 6, torch.float32)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", math_sdpa)
    got = fused_mixed_precision_attention(query, parts, 0.3)
    assert not got.isnan().any()
    torch.testing.assert_close(got, mixed_precision_attention(query, parts, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prefix", ["no prefix", "plain prefix"])
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_a_prefill_in_blocks_of_rows_within_the_score_budget(monkeypatch, prefix, rows):
    query, parts = case(prefix, RECENT, 6, torch.float32)
    offsets = parts[0].prefix.offsets if prefix != "no prefix" else [0]
    entries = SUFFIX + max(stop - start for start, stop in zip(offsets, offsets[1:] or [0]))  # the longest head's N
    budget = rows * 2 * 3 * entries  # B x g x rows x N
    calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def recorded(query, keys, values, attn_mask, scale):
        calls.append((query.shape, keys.shape))
        return sdpa(query, keys, values, attn_mask=attn_mask, scale=scale)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    got = fused_mixed_precision_attention(query, parts, 0.3, max_score_elements=budget)
    assert len(calls) == 2 * -(-RECENT // rows)  # KV heads x blocks
    # [B, g, r, D]; a block of one row goes to grouped_sdpa as [B, 1, g, D] (the 3 query heads as one head's rows)
    block_rows = [1 if q[1] == 1 else q[2] for q, _ in calls]
    assert all(q[0] == 2 and 3 in q[1:3] and q[:-1].numel() * k[-2] <= budget for q, k in calls)
    assert all(r <= rows for r in block_rows) and sum(block_rows) == 2 * RECENT  # every row once per KV head
    monkeypatch.undo()
    want = mixed_precision_attention(query, parts, 0.3, max_score_elements=UNBLOCKED)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    one_block = fused_mixed_precision_attention(query, parts, 0.3, max_score_elements=UNBLOCKED)
    torch.testing.assert_close(got, one_block, atol=1e-6, rtol=1e-6)


def test_softcap_goes_to_the_reference(monkeypatch):
    query, parts = case("plain prefix", RECENT, 6, torch.float32)

    def refused(*args, **kwargs):
        raise AssertionError("soft-capping has no SDPA form")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", refused)
    got = fused_mixed_precision_attention(query, parts, 0.3, softcap=2.0)
    assert torch.equal(got, mixed_precision_attention(query, parts, 0.3, softcap=2.0))


def test_partitions_without_entries_and_bad_inputs():
    empty = DensePartition(torch.zeros(2, 2, 0, 8), torch.zeros(2, 2, 0, 8), torch.zeros(2, 3, 0, dtype=torch.bool))
    nothing = CompactedPrefix(torch.zeros(0, 8), torch.zeros(0, 8), torch.zeros(0), [0, 0, 0])
    query = torch.randn(2, 4, 3, 8)
    for parts in ([empty], [PrefixPartition(nothing), empty]):
        got = fused_mixed_precision_attention(query, parts, 0.5)
        assert torch.equal(got, torch.zeros(2, 3, 4, 8)) and torch.equal(
            got, mixed_precision_attention(query, parts, 0.5)
        )
    keys, values = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    visible = torch.rand(2, 3, 5, generator=torch.Generator().manual_seed(0)) > 0.3
    parts = [empty, DensePartition(keys, values, visible), empty]
    torch.testing.assert_close(
        fused_mixed_precision_attention(query, parts, 0.5), mixed_precision_attention(query, parts, 0.5)
    )
    with pytest.raises(ValueError, match="max_score_elements must be a positive int"):
        fused_mixed_precision_attention(query, parts, 0.5, max_score_elements=0)
    with pytest.raises(ValueError, match="cannot be grouped"):
        fused_mixed_precision_attention(torch.randn(2, 3, 3, 8), parts, 0.5)
    with pytest.raises(ValueError, match="at least one"):
        fused_mixed_precision_attention(query, [], 0.5)
