"""INT4 storage of compacted heads (issue 31): byte layout, served = dequantised stored tensors, the quantization-aware
refit against its normal equations, the compensated value quantization against a brute-force sequential solve, the
per-head fallback, every method, extreme inputs, bad input."""

import math
from dataclasses import replace

import pytest
import torch

from hf_structkv.compaction.head_compaction import HEAD_METHODS, compact_head, relative_loss
from hf_structkv.compaction.head_statistics import CompactedHead, HeadProblem, QuantizedHead
from hf_structkv.compaction.head_storage import OFFSET_BYTES, StorageLayout
from hf_structkv.compaction.quantized_refit import (
    compact_int4,
    quantize_head,
    quantize_values_compensated,
    refit_with_served_keys,
)
from hf_structkv.quant import dequantize_int4, dequantize_int4_channels, quantize_int4

FLOAT = torch.float64


def head_inputs(seed: int, length: int = 96, dim: int = 8, queries: int = 160, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(length, dim, generator=generator) * 2
    keys[:, 0] += 6.0  # a channel far from zero, as post-RoPE keys have
    values = torch.randn(length, dim, generator=generator)
    calibration = torch.randn(queries, dim, generator=generator)
    heldout = torch.randn(queries // 2, dim, generator=generator)
    return keys.to(dtype), values.to(dtype), calibration, heldout


# ------------------------------------------------------------------------------------------------- byte layout
@pytest.mark.parametrize("key_group", [None, 1, 5, 32])
def test_int4_layout_counts_codes_scales_offsets_bias_and_offset(key_group):
    layout = StorageLayout("int4", 64, 64, key_group=key_group)
    for entries in (1, 7, 40):
        groups = 1 if key_group is None else math.ceil(entries / key_group)
        want = entries * (32 + 32 + 2 + 4) + groups * 64 * 2 * 2 + OFFSET_BYTES
        assert layout.nbytes(entries) == want
    assert layout.nbytes(0) == OFFSET_BYTES


def test_bf16_layout_and_entries_for_is_the_largest_fitting_count():
    assert StorageLayout("bf16", 64, 64).nbytes(10) == 10 * (128 * 2 + 4) + OFFSET_BYTES
    assert StorageLayout("bf16", 64, 64, element_bytes=4).nbytes(10) == 10 * (128 * 4 + 4) + OFFSET_BYTES
    for layout in (StorageLayout("bf16", 6, 5), StorageLayout("int4", 7, 5, key_group=3), StorageLayout("int4", 4, 4)):
        for nbytes in range(0, 400, 7):
            brute = max([t for t in range(400) if layout.nbytes(t) <= nbytes], default=0)
            assert layout.entries_for(nbytes) == brute


def test_layout_rejects_bad_arguments_by_name():
    with pytest.raises(ValueError, match="storage must be one of"):
        StorageLayout("fp8", 4, 4)
    with pytest.raises(ValueError, match="key_group must be an integer >= 1"):
        StorageLayout("int4", 4, 4, key_group=0)
    with pytest.raises(ValueError, match="nbytes must be an integer >= 0"):
        StorageLayout("int4", 4, 4).entries_for(-1)


# ----------------------------------------------------------------------------------------- stored and served
@pytest.mark.parametrize("key_group", [None, 4])
@pytest.mark.parametrize("method", ["kv_surgeon", "loo", "streaming_llm"])
def test_served_keys_and_values_are_the_dequantised_stored_tensors(method, key_group):
    keys, values, calibration, _ = head_inputs(0)
    problem = HeadProblem.build(keys, values, calibration)
    rule = HEAD_METHODS[method]()
    head = quantize_head(problem, rule.compact(problem, 24, 0), rule, key_group)  # what compact_head serves unless
    head = replace(head, train_loss=problem.relative_loss(head))  # the same bytes in BF16 serve better
    assert isinstance(head, QuantizedHead) and head.storage == "int4" and not head.storage_fallback
    dim = keys.shape[1]
    stored_keys = dequantize_int4_channels(head.key_codes, head.key_scales, head.key_offsets, dim, key_group)
    assert torch.equal(head.keys, stored_keys) and torch.equal(head.served_keys(keys), stored_keys)
    assert torch.equal(head.values, dequantize_int4(head.value_codes, head.value_scales, values.shape[1]))
    assert head.key_group == key_group and head.bias.dtype == torch.float32
    assert torch.equal(head.indices, torch.sort(head.indices).values) and head.indices.unique().numel() == 24
    # nbytes is every stored tensor's bytes plus one int64 offset, and the layout's count
    stored = (head.key_codes, head.key_scales, head.key_offsets, head.value_codes, head.value_scales, head.bias)
    assert head.nbytes() == sum(t.numel() * t.element_size() for t in stored) + 8
    assert head.nbytes() == StorageLayout("int4", dim, values.shape[1], key_group=key_group).nbytes(24)
    # the loss is that of the served tensors: a dense softmax over the dequantised keys
    attention = torch.softmax(calibration.double() @ stored_keys.double().T / math.sqrt(dim) + head.bias.double(), 1)
    full = torch.softmax(calibration.double() @ keys.double().T / math.sqrt(dim), 1) @ values.double()
    dense = ((attention @ head.values.double() - full).square().sum() / full.square().sum()).item()
    assert head.train_loss == pytest.approx(dense, rel=1e-9)


def test_bf16_head_counts_its_stored_bytes():
    keys, values, calibration, _ = head_inputs(1)
    head = compact_head(keys, values, calibration, 10, "kv_surgeon")
    assert type(head) is CompactedHead and head.storage == "bf16" and not head.storage_fallback
    assert head.nbytes() == 10 * 8 * 2 + 10 * 8 * 2 + 10 * 4 + 8
    assert head.nbytes(key_dim=16) == 10 * 16 * 2 + 10 * 8 * 2 + 10 * 4 + 8


# ------------------------------------------------------------------------------- the quantization-aware refit
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_refit_with_served_keys_satisfies_its_normal_equations(seed):
    keys, values, calibration, _ = head_inputs(seed, length=40, queries=120, dtype=torch.float32)
    problem = HeadProblem.build(keys, values, calibration)
    indices = torch.arange(0, 40, 4)
    served = (
        keys[indices] + 0.05 * torch.randn(10, keys.shape[1], generator=torch.Generator().manual_seed(9))
    ).double()
    bias, fitted, attention = refit_with_served_keys(problem, indices, served, bias_bound=30.0, value_shrinkage=0.0)
    # brute force: the full softmax over the exact keys; the multipliers (22) on the exact kept columns, the values
    # (23) with the served keys in the attention
    logits = calibration.double() @ keys.double().T / math.sqrt(keys.shape[1])
    row_max = logits.amax(1, keepdim=True)
    row_sums = torch.exp(logits - row_max).sum(1)
    outputs = torch.softmax(logits, 1) @ values.double()
    served_logits = calibration.double() @ served.T / math.sqrt(keys.shape[1])
    unnormalized = torch.exp(logits[:, indices] - row_max)
    weights = bias.exp()
    assert bool((bias.abs() < 30).all())  # the box is inactive: (22) is plain least squares
    gradient = unnormalized.T @ (unnormalized @ weights - row_sums)  # zero up to the float32 rounding of the biases
    assert gradient.abs().max() <= 1e-5 * (unnormalized.T @ row_sums).abs().max()
    served_attention = torch.softmax(served_logits + bias, 1)
    assert torch.allclose(attention, served_attention, atol=1e-12)
    residual = served_attention.T @ (served_attention @ fitted - outputs)  # (23): P̂ᵀ(P̂V̂ − O) = 0
    assert residual.abs().max() <= 1e-8 * (served_attention.T @ outputs).abs().max()


def sequential_reference(attention: torch.Tensor, values: torch.Tensor, damping: float) -> list[list[int]]:
    """Row by row (largest diagonal of H first): round the row, then set every row not yet rounded to the exact
    minimiser of tr((V − V̂)ᵀ H (V − V̂)) with the rounded rows fixed, by a fresh solve."""
    gram = attention.T @ attention
    gram = gram + damping * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=gram.dtype)
    order = torch.argsort((attention.T @ attention).diagonal(), descending=True).tolist()
    work, done, codes = values.clone(), [], {}
    for j in order:
        row_codes, row_scale = quantize_int4(work[j : j + 1])
        codes[j] = row_codes
        work[j] = dequantize_int4(row_codes, row_scale, values.shape[1], FLOAT)[0]
        done.append(j)
        rest = [k for k in range(values.shape[0]) if k not in done]
        if rest:
            shift = torch.linalg.solve(gram[rest][:, rest], gram[rest][:, done] @ (work[done] - values[done]))
            work[rest] = values[rest] - shift
    return torch.cat([codes[j] for j in range(values.shape[0])]).tolist()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("block", [1, 2, 4, 128])
def test_compensated_value_quantization_equals_the_sequential_exact_solve(seed, block):
    # lazy updates by blocks of rows (1: every row at once; 4: a block boundary inside the six rows) change nothing
    generator = torch.Generator().manual_seed(seed)
    attention = torch.softmax(torch.randn(30, 6, generator=generator, dtype=FLOAT) * 2, 1)
    values = torch.randn(6, 5, generator=generator, dtype=FLOAT)
    codes, scales = quantize_values_compensated(attention, values, damping=0.01, block=block)
    assert codes.tolist() == sequential_reference(attention, values, damping=0.01)
    assert scales.dtype == torch.float16 and scales.shape == (6, 1)


def test_compensation_beats_rounding_on_a_correlated_head():
    generator = torch.Generator().manual_seed(3)
    base = torch.randn(200, 12, generator=generator, dtype=FLOAT)
    attention = torch.softmax(torch.cat([base, base[:, :4] + 0.01 * torch.randn(200, 4, generator=generator)], 1), 1)
    values = torch.randn(16, 8, generator=generator, dtype=FLOAT)
    rounded = dequantize_int4(*quantize_int4(values), 8, FLOAT)
    compensated = dequantize_int4(*quantize_values_compensated(attention, values), 8, FLOAT)
    target = attention @ values
    assert (attention @ compensated - target).square().sum() < (attention @ rounded - target).square().sum()


# --------------------------------------------------------------------------------------------------- fallback
def test_fallback_serves_the_same_bytes_in_the_cache_dtype_where_int4_fits_worse():
    # one kept entry: any key serves the whole attention, so the BF16 value (the exact least-squares mean of the
    # outputs) beats its INT4 rounding, and one BF16 entry fits in the bytes of one INT4 entry with its key scales
    keys, values, calibration, _ = head_inputs(4, dim=64)
    head = compact_head(keys, values, calibration, 1, "kv_surgeon", storage="int4")
    assert StorageLayout("bf16", 64, 64).entries_for(StorageLayout("int4", 64, 64).nbytes(1)) == 1
    assert type(head) is CompactedHead and head.storage_fallback and head.storage == "bf16"
    plain = compact_head(keys, values, calibration, 1, "kv_surgeon")
    assert torch.equal(head.values, plain.values) and torch.equal(head.bias, plain.bias)
    assert head.values.dtype == torch.bfloat16 and head.train_loss == plain.train_loss


@pytest.mark.parametrize("method", sorted(HEAD_METHODS))
def test_every_method_stores_int4_never_worse_than_its_bf16_fit_at_the_same_bytes(method):
    keys, values, calibration, heldout = head_inputs(5)
    budget = 30
    head = compact_head(keys, values, calibration, budget, method, storage="int4", key_group=8)
    same_bytes = StorageLayout("bf16", 8, 8).entries_for(StorageLayout("int4", 8, 8, key_group=8).nbytes(budget))
    plain = compact_head(keys, values, calibration, same_bytes, method)
    assert head.train_loss <= plain.train_loss
    assert head.storage_fallback == (head.storage == "bf16")
    assert math.isfinite(relative_loss(head, keys, heldout, values))


# ------------------------------------------------------------------------------------------ extreme and bad
@pytest.mark.parametrize(
    "case",
    ["huge_keys", "huge_values", "zero_values", "duplicate_keys", "outlier_channel", "tiny_values", "keep_all"],
)
def test_extreme_inputs_give_finite_served_heads(case):
    keys, values, calibration, _ = head_inputs(6, dtype=torch.float32)
    budget = 12
    if case == "huge_keys":
        keys = keys * 1e3
    elif case == "huge_values":
        values = values * 1e7
    elif case == "zero_values":
        values = torch.zeros_like(values)
    elif case == "duplicate_keys":
        keys = keys[:1].expand_as(keys).clone()
    elif case == "outlier_channel":
        keys[:, 3] *= 1e4
    elif case == "tiny_values":
        values = values * 1e-30
    else:
        budget = keys.shape[0] + 5
    for key_group in (None, 5):
        head = compact_head(keys, values, calibration, budget, "kv_surgeon", storage="int4", key_group=key_group)
        assert torch.isfinite(head.values).all() and torch.isfinite(head.bias).all()
        assert torch.isfinite(head.served_keys(keys)).all() and math.isfinite(head.train_loss)


def test_query_free_int4_needs_no_queries():
    keys, values, _, _ = head_inputs(7)
    head = compact_head(keys, values, None, 16, "streaming_llm", storage="int4")
    assert isinstance(head, QuantizedHead) and head.train_loss is None and not head.bias.any()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"storage": "fp8"}, ValueError, "storage must be one of"),
        ({"storage": "bf16", "key_group": 4}, ValueError, "key_group is for storage='int4'"),
        ({"storage": "int4", "key_group": 0}, ValueError, "key_group must be an integer >= 1"),
        ({"storage": "int4", "key_group": 2.0}, TypeError, "key_group must be an integer"),
    ],
)
def test_bad_storage_arguments_are_named(kwargs, error, match):
    keys, values, calibration, _ = head_inputs(8)
    with pytest.raises(error, match=match):
        compact_head(keys, values, calibration, 4, "kv_surgeon", **kwargs)


def test_split_guard_falls_back_where_the_int4_refit_only_fits_its_calibration_queries():
    # 30 kept entries against 32 calibration queries: the INT4 refit nearly interpolates them (a lower calibration
    # loss than the BF16 entries of the same bytes) and serves other queries badly; refit without a quarter of them,
    # it loses on that quarter, so the BF16 head is served
    keys, values, calibration, heldout = head_inputs(1, queries=32)
    problem = HeadProblem.build(keys, values, calibration)
    rule = HEAD_METHODS["kv_surgeon"](fallback_threshold=1.0)
    unguarded = compact_int4(problem, rule, 30, 0, torch.bfloat16, guard_share=0.0)
    guarded = compact_int4(problem, rule, 30, 0, torch.bfloat16, guard_share=0.25)
    assert isinstance(unguarded, QuantizedHead) and not unguarded.storage_fallback
    assert type(guarded) is CompactedHead and guarded.storage_fallback
    assert problem.relative_loss(unguarded) < problem.relative_loss(guarded)
    assert relative_loss(guarded, keys, heldout, values) < relative_loss(unguarded, keys, heldout, values)
