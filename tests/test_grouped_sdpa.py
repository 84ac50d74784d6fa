"""`grouped_sdpa` against a float64 softmax per query head; at one query per row it reads the KV head once."""

import pytest
import torch

from hf_structkv.attention.grouped_sdpa import grouped_sdpa


def brute_force(query, keys, values, mask, scale):
    """float64 ``softmax(q·kᵀ·scale + mask)·v`` per batch row and query head."""
    batch, group, q_len, _ = query.shape
    mask = mask.double().expand(batch, 1, q_len, keys.shape[-2])
    out = torch.zeros(batch, group, q_len, values.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for head in range(group):
            scores = query[b, head].double() @ keys[b, 0].double().T * scale + mask[b, 0]
            out[b, head] = torch.softmax(scores, dim=-1) @ values[b, 0].double()
    return out


@pytest.mark.parametrize(("q_len", "mask_batch"), [(1, 3), (1, 1), (4, 3), (4, 1)])
def test_matches_a_softmax_per_query_head(q_len, mask_batch):
    g = torch.Generator().manual_seed(0)
    batch, group, n = 3, 7, 11
    query = torch.randn(batch, group, q_len, 8, generator=g)
    keys, values = torch.randn(batch, 1, n, 8, generator=g), torch.randn(batch, 1, n, 5, generator=g)
    mask = torch.randn(mask_batch, 1, q_len, n, generator=g)
    mask[0, 0, :, :3] = float("-inf")  # padding of row 0 (every row when the mask is shared)
    got = grouped_sdpa(query, keys, values, mask, 0.4)
    assert got.shape == (batch, group, q_len, 5)
    torch.testing.assert_close(got.double(), brute_force(query, keys, values, mask, 0.4), atol=1e-6, rtol=1e-6)


def test_one_query_per_row_reads_the_kv_head_once(monkeypatch):
    """At ``q == 1`` SDPA gets one head of ``g`` query rows and the keys / values of the single KV head."""
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, keys, values, **kwargs):
        seen.append((query.shape, keys.shape, values.shape))
        return sdpa(query, keys, values, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    query, keys, values = torch.randn(2, 7, 1, 8), torch.randn(2, 1, 9, 8), torch.randn(2, 1, 9, 4)
    grouped_sdpa(query, keys, values, torch.zeros(2, 1, 1, 9), 0.3)
    assert seen == [((2, 1, 7, 8), (2, 1, 9, 8), (2, 1, 9, 4))]
