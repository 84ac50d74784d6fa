"""Partitioned mixed-precision attention (eq. 15) against dense softmax attention over the same entries: the reference
merge of partition statistics and the fused SDPA path alike."""

import pytest
import torch

from hf_structkv.attention.mixed_reference import DensePartition, Int4Partition, mixed_precision_attention
from hf_structkv.attention.mixed_sdpa import fused_mixed_precision_attention
from hf_structkv.quant import dequantize_int4, quantize_int4

PATHS = pytest.mark.parametrize(
    "attend", [mixed_precision_attention, fused_mixed_precision_attention], ids=["reference", "fused"]
)


def dense_reference(query, keys, values, visible, scaling):
    """``query [B,Hq,q,D]``, ``keys/values [B,Hkv,n,D]``, ``visible [B,q,n]`` -> ``[B,q,Hq,D]`` in FP64."""
    group = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = (query.double() @ k.transpose(-1, -2)) * scaling
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (weights @ v).transpose(1, 2)


@pytest.mark.parametrize(("n_q_heads", "n_kv_heads"), [(2, 2), (4, 2), (7, 1), (8, 2)])
@pytest.mark.parametrize("q_len", [1, 3])
@PATHS
def test_three_partitions_equal_dense_attention_over_the_same_entries(n_q_heads, n_kv_heads, q_len, attend):
    torch.manual_seed(0)
    batch, d, n = 2, 7, 23
    query = torch.randn(batch, n_q_heads, q_len, d)
    keys, values = torch.randn(batch, n_kv_heads, n, d), torch.randn(batch, n_kv_heads, n, d)
    where = torch.randint(0, 3, (n,))  # 0 high, 1 low, 2 recent
    visible = torch.rand(batch, q_len, n) > 0.3
    high, low, recent = (
        (where == 0).nonzero().squeeze(1),
        (where == 1).nonzero().squeeze(1),
        (where == 2).nonzero().squeeze(1),
    )
    key_codes, key_scales = quantize_int4(keys[:, :, low])
    value_codes, value_scales = quantize_int4(values[:, :, low])
    parts = [
        DensePartition(keys[:, :, high], values[:, :, high], visible[..., high]),
        Int4Partition(key_codes, key_scales, value_codes, value_scales, d, d, visible[..., low]),
        DensePartition(keys[:, :, recent], values[:, :, recent], visible[..., recent]),
    ]
    out = attend(query, parts, scaling=0.4)
    # the dense reference sees exactly the entries the partitions hold: INT4 ones dequantised
    seen_keys, seen_values = keys.clone(), values.clone()
    seen_keys[:, :, low] = dequantize_int4(key_codes, key_scales, d)
    seen_values[:, :, low] = dequantize_int4(value_codes, value_scales, d)
    want = dense_reference(query, seen_keys, seen_values, visible, 0.4)
    assert out.shape == (batch, q_len, n_q_heads, d)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@PATHS
def test_empty_partitions_and_rows_that_see_nothing(attend):
    query = torch.randn(1, 2, 2, 4)
    empty = DensePartition(torch.zeros(1, 2, 0, 4), torch.zeros(1, 2, 0, 4), torch.zeros(1, 2, 0, dtype=torch.bool))
    keys, values = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    visible = torch.tensor([[[True, True, False], [False, False, False]]])
    out = attend(query, [empty, DensePartition(keys, values, visible)], scaling=0.5)
    torch.testing.assert_close(out.double(), dense_reference(query, keys, values, visible, 0.5))
    assert not out[0, 1].any()


@PATHS
def test_bf16_inputs_accumulate_in_fp32_and_return_bf16(attend):
    torch.manual_seed(1)
    query = torch.randn(1, 4, 1, 16, dtype=torch.bfloat16)
    keys, values = torch.randn(1, 2, 40, 16, dtype=torch.bfloat16), torch.randn(1, 2, 40, 16, dtype=torch.bfloat16)
    visible = torch.ones(1, 1, 40, dtype=torch.bool)
    parts = [
        DensePartition(keys[:, :, :20], values[:, :, :20], visible[..., :20]),
        DensePartition(keys[:, :, 20:], values[:, :, 20:], visible[..., 20:]),
    ]
    out = attend(query, parts, scaling=0.25)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), dense_reference(query, keys, values, visible, 0.25), atol=1e-2, rtol=0)


@PATHS
def test_softcap_and_bad_head_grouping(attend):
    query = torch.randn(1, 3, 1, 4)
    keys, values = torch.randn(1, 1, 5, 4) * 10, torch.randn(1, 1, 5, 4)
    visible = torch.ones(1, 1, 5, dtype=torch.bool)
    out = attend(query, [DensePartition(keys, values, visible)], scaling=1.0, softcap=2.0)
    scores = 2.0 * torch.tanh((query.double() @ keys.double().transpose(-1, -2)) / 2.0)
    want = (torch.softmax(scores, -1) @ values.double()).transpose(1, 2)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cannot be grouped"):
        attend(torch.randn(1, 3, 1, 4), [DensePartition(torch.randn(1, 2, 5, 4), values, visible)], 1.0)
    with pytest.raises(ValueError, match="at least one"):
        attend(query, [], 1.0)
