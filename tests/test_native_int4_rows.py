"""The C kernel's statistics of a mixed-precision cache's INT4 store (`native_int4_rows_stats`: one FP16 scale per
entry row, per batch row and KV head) against float64 statistics of the dequantised entries, those of a compacted
prefix's INT4 heads (`native_int4_prefix_stats`) against torch's from the codes, and the decode step of
`fused_mixed_precision_attention` that reads both from their codes against the reference."""

import functools
import shutil

import pytest
import torch
from test_compacted_int4_cache import int4_cache
from test_fused_mixed_attention import case

import hf_structkv
from hf_structkv.attention import mixed_sdpa
from hf_structkv.attention.int4_head_stats import int4_head_stats, reads_codes
from hf_structkv.attention.mixed_reference import Int4Partition, PrefixPartition, mixed_precision_attention
from hf_structkv.attention.native_int4 import MAX_DIM, native_int4_prefix_stats, native_int4_rows_stats
from hf_structkv.models import tiny_model
from hf_structkv.quant import dequantize_int4, quantize_int4

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler named cc on this machine")


def store(batch, kv_heads, length, dim, capacity, seed=0):
    """``(key_codes, key_scales, value_codes, value_scales)`` of ``length`` entries as views of buffers holding
    ``capacity`` entries per row and head (as a store keeps them)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, kv_heads, capacity, dim, generator=g) * torch.linspace(0.2, 3, dim)
    values = torch.randn(batch, kv_heads, capacity, dim, generator=g)
    fields = [*quantize_int4(keys), *quantize_int4(values)]
    return [field[:, :, :length] for field in fields]


def brute_force(query, fields, visible, scaling, offset=None):
    """float64 ``(row_max [B, H, g, 1], exp_sum, value_sum [B, H, g, 1, D_v])`` over the dequantised entries, each
    query row's scores shifted by ``offset [B, H, g]`` (before scaling) if given."""
    key_codes, key_scales, value_codes, value_scales = fields
    dim, value_dim = query.shape[-1], value_codes.shape[-1] * 2
    keys = dequantize_int4(key_codes, key_scales, dim, torch.float64)  # [B, H, n, D]
    values = dequantize_int4(value_codes, value_scales, value_dim, torch.float64)
    scores = query.double() @ keys.transpose(-1, -2)  # [B, H, g, n]
    scores = (scores if offset is None else scores + offset.double()[..., None]) * scaling
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    row_max = scores.amax(-1, keepdim=True)
    weights = torch.exp(scores - torch.where(row_max.isfinite(), row_max, torch.zeros_like(row_max)))
    return row_max, weights.sum(-1, keepdim=True), (weights @ values).unsqueeze(-2)


@pytest.mark.parametrize("dim", [2, 6, 16, 64, 128, MAX_DIM])
@pytest.mark.parametrize("length", [1, 16, 17, 100])
@pytest.mark.parametrize("group", [1, 7])
def test_statistics_equal_the_brute_force_over_the_dequantised_entries(dim, length, group):
    batch, kv_heads = 3, 2
    fields = store(batch, kv_heads, length, dim, capacity=length + 5, seed=dim + length)
    query = torch.randn(batch, kv_heads, group, dim, generator=torch.Generator().manual_seed(group))
    visible = torch.rand(batch, length, generator=torch.Generator().manual_seed(1)) < 0.7
    visible[:, -1] = True
    visible[2] = False  # a batch row that sees no entry (padding): -inf, 0, 0
    (got,) = native_int4_rows_stats(query[None], [(*fields, visible)], 0.3)
    want = brute_force(query, fields, visible, 0.3)
    assert not fields[0].is_contiguous() or length == 0  # read through the store's strides
    torch.testing.assert_close(got.row_max.double(), want[0], rtol=1e-5, atol=1e-5)
    for name, g, w in zip(("exp_sum", "value_sum"), got[1:], want[1:]):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5 * w.abs().max().item(), msg=name)
    assert got.row_max[2].eq(float("-inf")).all() and not got.exp_sum[2].any() and not got.value_sum[2].any()


def test_fields_laid_out_differently_are_read_alike():
    fields = store(2, 2, 20, 8, capacity=24)
    query, visible = torch.randn(2, 2, 3, 8), torch.ones(2, 20, dtype=torch.bool)
    (strided,) = native_int4_rows_stats(query[None], [(*fields, visible)], 0.5)
    mixed = [fields[0].contiguous(), fields[1], fields[2].transpose(0, 1).contiguous().transpose(0, 1), fields[3]]
    for got in (native_int4_rows_stats(query[None], [(*mixed, visible)], 0.5)[0], strided):
        torch.testing.assert_close(
            got.value_sum, brute_force(query, fields, visible, 0.5)[2].float(), rtol=1e-5, atol=1e-5
        )
    with pytest.raises(TypeError, match="queries and offsets must be float32"):
        native_int4_rows_stats(query.double()[None], [(*fields, visible)], 0.5)


def test_stores_of_different_lengths_with_their_own_queries_and_offsets_are_read_in_one_call():
    batch, kv_heads, group, dim = 2, 2, 3, 16
    lengths = [5, 40, 17]
    stores = []
    for i, length in enumerate(lengths):
        visible = torch.rand(batch, length, generator=torch.Generator().manual_seed(i)) < 0.8
        visible[:, 0] = True
        stores.append((*store(batch, kv_heads, length, dim, capacity=length + 3, seed=i), visible))
    g = torch.Generator().manual_seed(9)
    queries = torch.randn(len(lengths), batch, kv_heads, group, dim, generator=g)
    offsets = torch.randn(len(lengths), batch, kv_heads, group, generator=g) * 4
    for shifts in (offsets, None):
        got = native_int4_rows_stats(queries, stores, 0.4, shifts)
        for i, (stats, fields) in enumerate(zip(got, stores, strict=True)):
            want = brute_force(queries[i], fields[:4], fields[4], 0.4, None if shifts is None else shifts[i])
            for name, g_, w in zip(("row_max", "exp_sum", "value_sum"), stats, want):
                torch.testing.assert_close(g_.double(), w, rtol=1e-5, atol=1e-5 * w.abs().max().item(), msg=name)


@pytest.mark.parametrize("prefix", ["no prefix", "plain prefix", "INT4 prefix"])
@pytest.mark.parametrize("n_q_heads", [2, 6])
def test_a_decode_step_reads_the_store_from_its_codes_and_equals_the_reference(prefix, n_q_heads, monkeypatch):
    query, parts = case(prefix, 1, n_q_heads, torch.float32)
    calls = []
    real = mixed_sdpa.native_int4_rows_stats
    monkeypatch.setattr(mixed_sdpa, "native_int4_rows_stats", lambda *a: calls.append(1) or real(*a))
    got = mixed_sdpa.fused_mixed_precision_attention(query, parts, 0.3)
    assert calls == [1] * any(isinstance(p, Int4Partition) for p in parts)  # every INT4 store in one call
    torch.testing.assert_close(got, mixed_precision_attention(query, parts, 0.3), atol=1e-5, rtol=1e-5)


@functools.cache
def code_read_prefix():
    """A compacted layer's prefix with one INT4 head read from its codes (one row of key scales) and one in the dtype
    (tiny llama: 2 KV heads, head dim 16)."""
    model = hf_structkv.enable(tiny_model("llama"))
    context = torch.randint(3, 256, (1, 30), generator=torch.Generator().manual_seed(4))
    cache, _ = int4_cache(model, context, key_group=None, plain_heads=(0,), seed=5)
    prefix = cache.layers[0].served_prefix(None)
    assert [reads_codes(prefix, h) for h in range(prefix.num_kv_heads)] == [False, True]
    return prefix


@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("n_q_heads", [2, 6])
def test_prefix_heads_read_from_codes_at_a_decode_step_equal_the_reference(store, n_q_heads, monkeypatch):
    """With or without an INT4 store, a prefix head that `reads_codes` goes through the prefix kernel once per
    forward, the other head through its FP32 scores, and the step equals the reference."""
    query, parts = case("no prefix", 1, n_q_heads, torch.float32)
    parts = [PrefixPartition(code_read_prefix())] + [p for p in parts if store or not isinstance(p, Int4Partition)]
    calls = []
    real = mixed_sdpa.native_int4_prefix_stats
    monkeypatch.setattr(mixed_sdpa, "native_int4_prefix_stats", lambda *a: calls.append(a[2]) or real(*a))
    got = mixed_sdpa.fused_mixed_precision_attention(query, parts, 0.3)
    assert calls == [[1]]
    torch.testing.assert_close(got, mixed_precision_attention(query, parts, 0.3), atol=1e-5, rtol=1e-5)


def test_prefix_statistics_equal_the_torch_statistics_from_codes():
    prefix = code_read_prefix()
    query = torch.randn(3, 6, 1, 16, generator=torch.Generator().manual_seed(0))
    (got,) = native_int4_prefix_stats(query, 0.3, [1], prefix)
    want = int4_head_stats(query[:, 3:], prefix, 1, 0.3)  # [B, g, 1] and [B, g, 1, D_v]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.squeeze(2), atol=1e-5, rtol=1e-5)
