"""INT4 heads of a compacted prefix read from their codes (`int4_head_stats`, by the C kernel and by torch) against
dequantise-then-attend: the statistics against `partition_stats` over the served (dequantised) head, the fused torch
path against the reference `compacted_attention`, and an INT4 cache generating through the torch path as through the
reference."""

import shutil

import pytest
import torch
from test_compacted_attention import causal_visible, random_problem
from test_compacted_int4_cache import context_ids, generate, int4_cache, left_padded_batch

import hf_structkv
from hf_structkv.attention import compacted_sdpa
from hf_structkv.attention import int4_decode as int4_decode_module
from hf_structkv.attention.backend import BACKEND_ENV
from hf_structkv.attention.compacted_inputs import QuantizedHeads, QuantizedPrefix
from hf_structkv.attention.compacted_reference import compacted_attention
from hf_structkv.attention.compacted_sdpa import fused_compacted_attention
from hf_structkv.attention.int4_decode import int4_decode_attention
from hf_structkv.attention.int4_head_stats import int4_head_stats, reads_codes
from hf_structkv.attention.partitions import partition_stats
from hf_structkv.models import tiny_model
from hf_structkv.quant import quantize_int4, quantize_int4_channels

TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}  # bf16: an output ulp, both sides round to bf16


@pytest.fixture(params=["native", "torch"])
def int4_path(request, monkeypatch):
    """Each test that takes it runs twice: decode steps over INT4 heads by the C kernel (`native_int4`; skipped
    without a C compiler) and by the torch path (the kernel switched off); `int4_head_stats` itself is torch only."""
    if request.param == "torch":
        monkeypatch.setattr(int4_decode_module, "runs_natively", lambda *_: False)
    elif shutil.which("cc") is None:
        pytest.skip("no C compiler named cc on this machine")
    return request.param


def quantized(prefix, int4_heads, key_group):
    """``prefix`` with the KV heads flagged in ``int4_heads`` stored in INT4 (keys per channel in groups of
    ``key_group`` entries, values per row), the others left in the dtype (as tests/test_triton_biased_attention.py
    builds them; that module is skipped where triton cannot be imported)."""
    plain_keys, plain_values, parts, lengths = [prefix.keys[:0]], [prefix.values[:0]], [], []
    for h, is_int4 in enumerate(int4_heads):
        keys, values, _ = prefix.head(h)
        lengths.append(keys.shape[0])
        if not is_int4:
            plain_keys.append(keys)
            plain_values.append(values)
        elif keys.shape[0]:
            parts.append((*quantize_int4_channels(keys, key_group), *quantize_int4(values)))
    tensors = tuple(torch.cat(columns) for columns in zip(*parts, strict=True))
    heads = QuantizedHeads.build(tensors, list(int4_heads), key_group, lengths)
    return QuantizedPrefix(torch.cat(plain_keys), torch.cat(plain_values), prefix.bias, prefix.offsets, heads)


def problem(lengths, int4_heads, key_group=None, batch=2, q_len=1, dtype=torch.float32, d=8, pads=(0, 2), seed=0):
    """``(query, prefix, appended)`` with 3 query heads per KV head, ``q_len + 4`` appended tokens, batch row ``b``
    left-padded by ``pads[b]``, keys shifted off zero (as post-RoPE keys) and biases in about ``[-3, 3]``."""
    visible = causal_visible(batch, q_len, q_len + 4)
    for b, pad in enumerate(pads[:batch]):
        visible[b, 0, :, :pad] = False
    query, prefix, appended = random_problem(
        lengths, visible, n_q=3 * len(lengths), q_len=q_len, n_app=q_len + 4, batch=batch, d=d, dtype=dtype, seed=seed
    )
    prefix = prefix._replace(keys=prefix.keys * 2 + 1, bias=prefix.bias * 3)
    return query, quantized(prefix, int4_heads, key_group), appended


def test_reads_codes_of_int4_heads_with_one_row_of_key_scales_and_even_dims():
    _, prefix, _ = problem((5, 9, 0, 4, 3), (True, True, True, False, True), key_group=4)
    assert [reads_codes(prefix, h) for h in range(5)] == [False, False, False, False, True]  # 2 rows, 3, empty, dtype
    _, prefix, _ = problem((5, 9), (True, True))
    assert reads_codes(prefix, 0) and reads_codes(prefix, 1)
    _, odd, _ = problem((5, 9), (True, True), d=7)
    assert not reads_codes(odd, 0)
    _, plain, _ = random_problem((5, 9))
    assert not reads_codes(plain, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len", [1, 3])
def test_statistics_equal_those_of_the_dequantised_head(dtype, q_len):
    query, prefix, _ = problem((6, 40), (True, True), batch=2, q_len=q_len, dtype=dtype, d=16)
    query = query.float()
    for h in range(2):
        keys, values, bias = prefix.head(h)
        scores = query[:, 3 * h : 3 * h + 3] @ keys.T * 0.3 + bias
        want = partition_stats(scores, values)
        got = int4_head_stats(query[:, 3 * h : 3 * h + 3], prefix, h, 0.3)
        assert got.value_sum.shape == (2, 3, q_len, 16) and got.exp_sum.shape == (2, 3, q_len)
        for mine, theirs in zip(got, want, strict=True):
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("key_group", [None, 8])
def test_fused_path_equals_the_reference(dtype, q_len, key_group, refuse_int4_dequantisation, int4_path):
    """INT4 heads of one row of key scales beside an INT4 head of several (key_group 8: the head of 20 entries), a
    head in the dtype and an empty one; GQA, a left-padded batch of two. At one query per row the heads of one row
    of key scales are read from codes (never dequantised); at three, every INT4 head is dequantised."""
    query, prefix, appended = problem((5, 20, 7, 0), (True, True, False, True), key_group, q_len=q_len, dtype=dtype)
    assert reads_codes(prefix, 1) == (key_group is None)
    want = compacted_attention(query, prefix, appended, scaling=0.4)
    if q_len == 1:
        refuse_int4_dequantisation(read_from_codes=True)
    got = fused_compacted_attention(query, prefix, appended, scaling=0.4)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=TOLERANCES[dtype], rtol=TOLERANCES[dtype])


@pytest.mark.parametrize(("q_len", "read"), [(1, [[0, 1]]), (2, [])])
def test_codes_are_read_at_decode_steps_only(q_len, read, monkeypatch):
    calls = []

    def spy(query, prefix, heads, *rest):
        calls.append(heads)
        return int4_decode_attention(query, prefix, heads, *rest)

    monkeypatch.setattr(compacted_sdpa, "int4_decode_attention", spy)
    fused_compacted_attention(*problem((5, 6, 3), (True, True, False), q_len=q_len), scaling=0.4)
    assert calls == read


def test_odd_dims_are_dequantised_and_match():
    query, prefix, appended = problem((5, 6), (True, True), d=7)
    want = compacted_attention(query, prefix, appended, scaling=0.4)
    torch.testing.assert_close(fused_compacted_attention(query, prefix, appended, scaling=0.4), want)


def test_a_head_whose_biases_are_all_minus_inf_contributes_nothing(int4_path):
    """Row 1's first query is padded and sees no appended token: its output from head 0 is zero, as the reference's."""
    query, prefix, appended = problem((4, 6), (True, True), q_len=1, pads=(0, 5))
    prefix = prefix._replace(bias=torch.cat([torch.full((4,), float("-inf")), prefix.bias[4:]]))
    got = fused_compacted_attention(query, prefix, appended, scaling=0.4)
    want = compacted_attention(query, prefix, appended, scaling=0.4)
    assert torch.equal(got[1, :, :3], torch.zeros_like(got[1, :, :3])) and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_stored_codes_and_scales_are_what_is_read():
    """Changing one INT4 head's value scales or key offsets changes the output of its query heads only, as the
    reference's."""
    query, prefix, appended = problem((5, 6), (True, True))
    before = fused_compacted_attention(query, prefix, appended, scaling=0.4)
    quantized_heads = prefix.quantized
    for field in ("value_scales", "key_offsets"):
        tensor = getattr(quantized_heads, field).clone()
        tensor[: 1 if field == "key_offsets" else 5] *= 3  # head 0's rows
        changed = QuantizedPrefix(*prefix, quantized_heads._replace(**{field: tensor}))
        after = fused_compacted_attention(query, changed, appended, scaling=0.4)
        assert not torch.allclose(before[:, :, :3], after[:, :, :3]) and torch.equal(before[:, :, 3:], after[:, :, 3:])
        torch.testing.assert_close(after, compacted_attention(query, changed, appended, scaling=0.4))


def test_bad_heads_and_queries_are_named():
    query, prefix, _ = problem((5, 6, 3), (True, True, False))
    with pytest.raises(ValueError, match="KV head 2 is not an INT4 head"):
        int4_head_stats(query[:, 6:].float(), prefix, 2, 0.4)
    with pytest.raises(ValueError, match=r"query must be float32 \[B, g, q, 8\]"):
        int4_head_stats(query[:, :3].double(), prefix, 0, 0.4)
    with pytest.raises(ValueError, match=r"query must be float32 \[B, g, q, 8\]"):
        int4_head_stats(query[:, :3, :, :4], prefix, 0, 0.4)


def test_int4_cache_generates_as_the_reference_through_the_torch_path(
    monkeypatch, refuse_int4_dequantisation, int4_path
):
    """A cache of INT4 heads with one row of key scales each (``key_group`` None), a left-padded batch: the torch
    path generates the reference's tokens, its decode steps without dequantising them (the question but its last
    token is prefilled first: several queries per row dequantise)."""
    torch.manual_seed(0)
    model = tiny_model("qwen2")  # 4 query heads over 2 KV heads (GQA)
    cache, _ = int4_cache(model, context_ids(), key_group=None, plain_heads=())
    hf_structkv.enable(model)
    ids, mask = left_padded_batch()
    monkeypatch.setenv(BACKEND_ENV, "reference")
    want = generate(model, ids, mask, cache.copy())
    monkeypatch.setenv(BACKEND_ENV, "torch")
    served = cache.copy()
    generate(model, ids[:, :-1], mask[:, :-1], served, n=1)
    refuse_int4_dequantisation(read_from_codes=True)
    assert torch.equal(generate(model, ids, mask, served), want)
