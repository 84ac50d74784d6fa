"""The INT4 refit's multipliers (issue 31): fitted on the exact kept keys, so they are the multipliers of the refit in
the cache's dtype on the same support whatever the served (rounded) keys, and the key rounding is carried by the
values' solve alone (the worst heads of ``benchmarks/results/compaction_loss_int4.json`` served question queries up to
1.95x worse than BF16 when the multipliers were fitted with the rounded keys)."""

import math

import pytest
import torch

from hf_structkv.compaction.head_method import refit_head
from hf_structkv.compaction.head_statistics import HeadProblem
from hf_structkv.compaction.quantized_refit import refit_with_served_keys
from hf_structkv.quant import dequantize_int4_channels, quantize_int4_channels


def head(seed: int, length: int = 48, dim: int = 8, queries: int = 96):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(length, dim, generator=generator) * 2
    keys[:, 1] *= 5  # an outlier channel: coarse per-channel rounding
    values = torch.randn(length, dim, generator=generator)
    calibration = torch.randn(queries, dim, generator=generator)
    return keys, values, calibration


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("key_group", [None, 4])
def test_multipliers_are_those_of_the_exact_keys_whatever_the_served_keys(seed, key_group):
    keys, values, calibration = head(seed)
    problem = HeadProblem.build(keys, values, calibration)
    indices = torch.arange(1, 48, 3)
    rounded = dequantize_int4_channels(
        *quantize_int4_channels(keys[indices], key_group), keys.shape[1], key_group, torch.float64
    )
    perturbed = keys[indices].double() + torch.randn(
        16, 8, generator=torch.Generator().manual_seed(7), dtype=torch.float64
    )
    exact = refit_head(problem, indices)
    for served in (rounded, perturbed):
        bias, values_fit, attention = refit_with_served_keys(problem, indices, served, 3.0, 0.0)
        assert torch.equal(bias, exact.bias)
        # the values solve (23) with the served keys in the attention: P̂ᵀ(P̂ V̂ − O) = 0
        logits = calibration.double() @ served.T / math.sqrt(keys.shape[1])
        torch.testing.assert_close(attention, torch.softmax(logits + bias, 1), rtol=0, atol=1e-12)
        residual = attention.T @ (attention @ values_fit - problem.outputs)
        assert residual.abs().max() <= 1e-8 * (attention.T @ problem.outputs).abs().max()
