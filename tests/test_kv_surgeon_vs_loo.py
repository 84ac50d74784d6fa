"""KV-Surgeon against its LOO baseline on held-out queries, over a fixed seeded set of small synthetic heads.

ALGORITHMS.md §1: LOO (13) ranks each entry by the loss of deleting it alone; KV-Surgeon (Algorithm 1) eliminates
blocks on the surrogate (9) with compensation (14), so entries that stand in for each other are not all dropped. The
heads here have that redundancy, as real contexts do (repeated tokens, similar keys): each key and value is one of a
few cluster centres plus noise. Both methods share the final refit; the loss is the relative loss (4) on queries
that neither fit saw.
"""

import statistics

import pytest
import torch

from hf_structkv.compaction import compact_head, relative_loss

HEADS = 16
LENGTH = 128
HEAD_DIM = 32
QUERIES = 256
CLUSTERS = 16
NOISE = 0.3


def clustered_heads(seed: int = 0):
    """``HEADS`` tuples ``(K [T, D], V [T, D], Q_fit [N, D], Q_heldout [N, D])``: keys and values are ``CLUSTERS``
    Gaussian centres (one draw per token, shared by its key and value) plus ``NOISE`` Gaussian noise; fitting and
    held-out queries are independent standard Gaussian draws."""
    gen = torch.Generator().manual_seed(seed)
    heads = []
    for _ in range(HEADS):
        cluster = torch.randint(CLUSTERS, (LENGTH,), generator=gen)
        keys = torch.randn(CLUSTERS, HEAD_DIM, generator=gen)[cluster]
        keys = keys + NOISE * torch.randn(LENGTH, HEAD_DIM, generator=gen)
        values = torch.randn(CLUSTERS, HEAD_DIM, generator=gen)[cluster]
        values = values + NOISE * torch.randn(LENGTH, HEAD_DIM, generator=gen)
        queries = torch.randn(2 * QUERIES, HEAD_DIM, generator=gen)
        heads.append((keys, values, queries[:QUERIES], queries[QUERIES:]))
    return heads


def heldout_loss(method: str, head, budget: int) -> float:
    keys, values, fit, heldout = head
    return relative_loss(compact_head(keys, values, fit, budget, method=method), keys, heldout, values)


# Measured (generator seed 0, float32, CPU): mean held-out relative loss over the 16 heads
#   budget 32 (T/4):  kv_surgeon 0.0574, loo 0.1859 (ratio 0.31), kv_surgeon lower on 16 / 16 heads
#   budget 16 (T/8):  kv_surgeon 0.1245, loo 0.3168 (ratio 0.39), kv_surgeon lower on 16 / 16 heads
# Over generator seeds 0-9 the ratio stays within 0.28-0.40 (T/4) and 0.39-0.52 (T/8). On heads without redundancy
# (i.i.d. Gaussian keys and values) the two methods tie within 3% either way, which is why these heads are clustered.
@pytest.mark.parametrize("budget", [LENGTH // 4, LENGTH // 8])
def test_kv_surgeon_heldout_loss_beats_loo_on_average(budget):
    heads = clustered_heads()
    surgeon = [heldout_loss("kv_surgeon", head, budget) for head in heads]
    loo = [heldout_loss("loo", head, budget) for head in heads]
    assert statistics.fmean(surgeon) < 0.7 * statistics.fmean(loo), (surgeon, loo)
    assert sum(s < o for s, o in zip(surgeon, loo, strict=True)) >= 0.75 * HEADS  # the seed paper: 84% of heads
