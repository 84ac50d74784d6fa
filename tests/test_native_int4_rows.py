"""The C kernel's statistics of a mixed-precision cache's INT4 store (`native_int4_rows_stats`: one FP16 scale per
entry row, per batch row and KV head) against float64 statistics of the dequantised entries, and the decode step of
`fused_mixed_precision_attention` that reads the store from its codes against the reference."""

import shutil

import pytest
import torch
from test_fused_mixed_attention import case

from hf_structkv.attention import mixed_sdpa
from hf_structkv.attention.mixed_reference import Int4Partition, mixed_precision_attention
from hf_structkv.attention.native_int4 import MAX_DIM, native_int4_rows_stats
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


def brute_force(query, fields, visible, scaling):
    """float64 ``(row_max [B, H, g, 1], exp_sum, value_sum [B, H, g, 1, D_v])`` over the dequantised entries."""
    key_codes, key_scales, value_codes, value_scales = fields
    dim, value_dim = query.shape[-1], value_codes.shape[-1] * 2
    keys = dequantize_int4(key_codes, key_scales, dim, torch.float64)  # [B, H, n, D]
    values = dequantize_int4(value_codes, value_scales, value_dim, torch.float64)
    scores = query.double() @ keys.transpose(-1, -2) * scaling  # [B, H, g, n]
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
    got = native_int4_rows_stats(query, *fields, visible, 0.3)
    want = brute_force(query, fields, visible, 0.3)
    assert not fields[0].is_contiguous() or length == 0  # read through the store's strides
    torch.testing.assert_close(got.row_max.double(), want[0], rtol=1e-5, atol=1e-5)
    for name, g, w in zip(("exp_sum", "value_sum"), got[1:], want[1:]):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5 * w.abs().max().item(), msg=name)
    assert got.row_max[2].eq(float("-inf")).all() and not got.exp_sum[2].any() and not got.value_sum[2].any()


def test_fields_laid_out_differently_are_read_alike():
    fields = store(2, 2, 20, 8, capacity=24)
    query, visible = torch.randn(2, 2, 3, 8), torch.ones(2, 20, dtype=torch.bool)
    strided = native_int4_rows_stats(query, *fields, visible, 0.5)
    mixed = [fields[0].contiguous(), fields[1], fields[2].transpose(0, 1).contiguous().transpose(0, 1), fields[3]]
    for got in (native_int4_rows_stats(query, *mixed, visible, 0.5), strided):
        torch.testing.assert_close(
            got.value_sum, brute_force(query, fields, visible, 0.5)[2].float(), rtol=1e-5, atol=1e-5
        )
    with pytest.raises(TypeError, match="query must be float32"):
        native_int4_rows_stats(query.double(), *fields, visible, 0.5)


@pytest.mark.parametrize("prefix", ["no prefix", "plain prefix", "INT4 prefix"])
@pytest.mark.parametrize("n_q_heads", [2, 6])
def test_a_decode_step_reads_the_store_from_its_codes_and_equals_the_reference(prefix, n_q_heads, monkeypatch):
    query, parts = case(prefix, 1, n_q_heads, torch.float32)
    calls = []
    real = mixed_sdpa.native_int4_rows_stats
    monkeypatch.setattr(mixed_sdpa, "native_int4_rows_stats", lambda *a: calls.append(1) or real(*a))
    got = mixed_sdpa.fused_mixed_precision_attention(query, parts, 0.3)
    assert calls == [1] * sum(isinstance(p, Int4Partition) for p in parts)
    torch.testing.assert_close(got, mixed_precision_attention(query, parts, 0.3), atol=1e-5, rtol=1e-5)
