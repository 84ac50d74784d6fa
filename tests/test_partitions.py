"""The partition merge (eq. 15) equals one softmax over the concatenated keys."""

import pytest
import torch

from hf_structkv.attention.partitions import merge_partitions, partition_stats


def _softmax_reference(scores: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    weights = torch.softmax(scores.double(), dim=-1)
    return torch.nan_to_num(weights) @ values.double()


@pytest.mark.parametrize("sizes", [(5, 7), (1, 1, 3), (0, 4), (6, 0), (3, 0, 2)])
def test_merge_equals_single_softmax(sizes):
    g = torch.Generator().manual_seed(0)
    scores = [torch.randn(2, 3, 4, n, generator=g) * 4 for n in sizes]
    values = [torch.randn(2, 3, n, 5, generator=g) for n in sizes]
    merged = merge_partitions([partition_stats(s, v) for s, v in zip(scores, values)])
    expected = _softmax_reference(torch.cat(scores, -1), torch.cat(values, -2))
    torch.testing.assert_close(merged.double(), expected, atol=1e-6, rtol=1e-5)


def test_masked_entries_and_fully_masked_rows():
    g = torch.Generator().manual_seed(1)
    s1, s2 = torch.randn(1, 4, 3, generator=g), torch.randn(1, 4, 5, generator=g)
    v1, v2 = torch.randn(1, 3, 2, generator=g), torch.randn(1, 5, 2, generator=g)
    s2[0, 1, 2:] = float("-inf")  # row 1 sees part of partition 2
    s1[0, 3], s2[0, 3] = float("-inf"), float("-inf")  # row 3 sees nothing
    merged = merge_partitions([partition_stats(s1, v1), partition_stats(s2, v2)])
    expected = _softmax_reference(torch.cat([s1[:, :3], s2[:, :3]], -1), torch.cat([v1, v2], -2))
    torch.testing.assert_close(merged[:, :3].double(), expected, atol=1e-6, rtol=1e-5)
    assert torch.equal(merged[0, 3], torch.zeros(2))
    assert torch.isfinite(merged).all()


def test_rejects_low_precision_scores_and_empty_list():
    with pytest.raises(TypeError, match="float32"):
        partition_stats(torch.zeros(1, 2, dtype=torch.bfloat16), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="at least one partition"):
        merge_partitions([])
