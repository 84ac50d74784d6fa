"""The Triton biased varlen attention kernel against the torch reference, under the Triton interpreter on CPU.

Tolerances (max abs / rel difference to ``compacted_attention`` on the same inputs, outputs of magnitude <~ 3):
fp32 1e-5 (IEEE FP32 dot products, only the summation order differs); fp16 2e-3 and bf16 1.6e-2 (about two
output ulps: both sides round the output to the input dtype and the kernel rounds the softmax weights to the value
dtype for the value product, as FlashAttention does).
"""

import os

# Triton reads this when it decorates kernels, triton.language's own included, so it must be set before triton is
# first imported (hf_structkv and transformers import it): this line covers a run of this file alone, a session-wide
# setting (tests/conftest.py) a whole suite.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from hf_structkv.attention.compacted_inputs import (  # noqa: E402
    AppendedTokens,
    CompactedPrefix,
    QuantizedHeads,
    QuantizedPrefix,
)
from hf_structkv.attention.compacted_reference import compacted_attention  # noqa: E402
from hf_structkv.quant import quantize_int4, quantize_int4_channels  # noqa: E402

try:
    import triton.language as tl

    from hf_structkv.attention.kernels import runtime
    from hf_structkv.attention.kernels.biased_attention import triton_compacted_attention
    from hf_structkv.attention.kernels.softmax_stats import BLOCK_N
except ImportError as error:  # only where triton cannot be installed
    pytest.skip(f"triton cannot be imported ({error}); pip install 'hf-structkv[triton]'", allow_module_level=True)

if not runtime.interpreter_ready():  # triton was imported before TRITON_INTERPRET=1 was set (by another test module)
    pytest.fail(
        "TRITON_INTERPRET=1 must be set before triton is first imported: set it in tests/conftest.py", pytrace=False
    )

TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make_inputs(
    lengths,
    group=2,
    batch=2,
    q_len=1,
    n_appended=None,
    mask=None,
    dtype=torch.float32,
    head_dim=16,
    value_dim=16,
    seed=0,
):
    """Arguments of ``compacted_attention`` with a ragged prefix of ``lengths[h]`` entries per KV head.

    The query is a transposed view (``[B, q, H, D]`` storage), as transformers' attention modules pass it.
    """
    g = torch.Generator().manual_seed(seed)
    n_kv = len(lengths)
    n_appended = q_len + 3 if n_appended is None else n_appended
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    n = offsets[-1]

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    query = rand(batch, q_len, n_kv * group, head_dim).transpose(1, 2)
    appended_mask = None
    if mask == "bool":
        appended_mask = torch.rand(batch, 1, q_len, n_appended, generator=g) > 0.3
        appended_mask[0, 0, -1] = False  # a row that sees no appended token
    elif mask == "float":
        appended_mask = torch.randn(batch, 1, q_len, n_appended, generator=g).to(dtype)
        appended_mask[-1, 0, 0, :2] = float("-inf")
    return dict(
        query=query,
        prefix=CompactedPrefix(rand(n, head_dim), rand(n, value_dim), torch.randn(n, generator=g), offsets),
        appended=AppendedTokens(
            rand(batch, n_kv, n_appended, head_dim), rand(batch, n_kv, n_appended, value_dim), appended_mask
        ),
        scaling=head_dim**-0.5,
    )


def quantized(prefix, int4_heads, key_group):
    """``prefix`` with the KV heads flagged in ``int4_heads`` (at least one non-empty) stored in INT4
    (`QuantizedPrefix`: keys per channel in groups of ``key_group`` kept entries, values per row), the other heads'
    rows left in ``keys`` / ``values``."""
    plain_keys, plain_values, int4_tensors = [prefix.keys[:0]], [prefix.values[:0]], []
    for h, is_int4 in enumerate(int4_heads):
        keys, values, _ = prefix.head(h)
        if not is_int4:
            plain_keys.append(keys)
            plain_values.append(values)
        elif keys.shape[0]:
            int4_tensors.append((*quantize_int4_channels(keys, key_group), *quantize_int4(values)))
    tensors = tuple(torch.cat(parts) for parts in zip(*int4_tensors))
    lengths = [end - start for start, end in zip(prefix.offsets[:-1], prefix.offsets[1:])]
    int4 = QuantizedHeads.build(tensors, list(int4_heads), key_group, lengths)
    return QuantizedPrefix(torch.cat(plain_keys), torch.cat(plain_values), prefix.bias, prefix.offsets, int4)


def changed(inputs, name, **fields):
    """Replace ``fields`` of the tuple ``inputs[name]`` (``prefix`` or ``appended``) in place."""
    inputs[name] = inputs[name]._replace(**fields)


def assert_matches_reference(inputs, softcap=None, num_splits=None):
    expected = compacted_attention(**inputs, softcap=softcap)
    got = triton_compacted_attention(**inputs, softcap=softcap, num_splits=num_splits)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    tol = TOLERANCES[inputs["query"].dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_dtypes_queries_and_masks(dtype, q_len, mask):
    lengths = (0, 1, BLOCK_N, BLOCK_N + 3)  # empty head, one entry, block boundary, odd past a boundary
    assert_matches_reference(make_inputs(lengths, q_len=q_len, mask=mask, dtype=dtype))


@pytest.mark.parametrize("group", [1, 2, 4, 7])
@pytest.mark.parametrize("lengths", [(1,), (0, 0), (BLOCK_N - 1, 0, 2 * BLOCK_N + 1)])
@pytest.mark.parametrize("q_len", [1, 3])
def test_gqa_ratios_and_ragged_heads(group, lengths, q_len):
    assert_matches_reference(make_inputs(lengths, group=group, q_len=q_len, batch=1))


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize(("q_len", "mask"), [(1, None), (4, "bool")])
def test_split_kv_matches_reference(num_splits, q_len, mask):
    """Split-KV (partial statistics merged by the second kernel), splits also straddling prefix and appended."""
    inputs = make_inputs((2 * BLOCK_N + 5, 0, 40), group=4, q_len=q_len, n_appended=BLOCK_N + 2, mask=mask)
    assert_matches_reference(inputs, num_splits=num_splits)


def test_bigger_chunk_uses_several_row_blocks():
    """q x group rows beyond one 64-row block, non-power-of-two head and value dims."""
    inputs = make_inputs((30, 70), group=7, q_len=11, batch=1, head_dim=24, value_dim=40, mask="float")
    assert_matches_reference(inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap(dtype):
    inputs = make_inputs((9, 65), q_len=4, dtype=dtype)
    inputs["query"] = inputs["query"] * 4  # logits large enough for the cap to matter
    assert_matches_reference(inputs, softcap=3.0)


def left_padded(inputs, pads):
    """Give ``inputs`` the boolean mask of left-padded batch rows: row ``b``'s first ``pads[b]`` appended tokens are
    padding, the rest causal (bottom-right aligned)."""
    batch, _, q_len, _ = inputs["query"].shape
    n_appended = inputs["appended"].keys.shape[-2]
    key = torch.arange(n_appended)
    causal = key[None, :] <= torch.arange(q_len)[:, None] + n_appended - q_len  # [q, n]
    not_padding = key[None, :] >= torch.tensor(pads)[:, None]  # [B, n]
    changed(inputs, "appended", mask=(causal[None] & not_padding[:, None])[:, None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("key_group", [None, 4])
def test_int4_heads_are_read_natively(dtype, key_group, refuse_int4_dequantisation):
    """INT4 heads (key_group None: one row of key scales per head; 4: several, the last one short) among heads in
    the query dtype and an empty head, GQA, a left-padded batch of two: the kernel reads the codes and scales (no
    torch dequantisation happens) and matches the reference over the same served entries."""
    inputs = make_inputs((5, 9, 0, 3), group=2, batch=2, q_len=3, n_appended=6, dtype=dtype)
    inputs["prefix"] = quantized(inputs["prefix"], (True, False, True, True), key_group)
    left_padded(inputs, pads=(0, 2))
    expected = compacted_attention(**inputs)
    refuse_int4_dequantisation()
    got = triton_compacted_attention(**inputs)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_int4_heads_split_kv_and_odd_dims(num_splits, refuse_int4_dequantisation):
    """INT4 heads past a key block, read in splits that straddle groups of key scales; odd head and value dims
    (a padded nibble per row)."""
    inputs = make_inputs((BLOCK_N + 3, 2, 7), group=1, batch=1, q_len=2, head_dim=15, value_dim=9, mask="float")
    inputs["prefix"] = quantized(inputs["prefix"], (True, True, False), 5)
    expected = compacted_attention(**inputs)
    refuse_int4_dequantisation()
    got = triton_compacted_attention(**inputs, num_splits=num_splits)
    torch.testing.assert_close(got, expected, atol=TOLERANCES[torch.float32], rtol=TOLERANCES[torch.float32])


def test_int4_codes_are_what_is_read():
    """The kernel reads the stored codes and scales: doubling one INT4 head's value scales changes its output."""
    inputs = make_inputs((4, 6), group=2, batch=1, q_len=1)
    inputs["prefix"] = quantized(inputs["prefix"], (True, False), None)
    before = triton_compacted_attention(**inputs)
    inputs["prefix"].quantized.value_scales.mul_(2)
    after = triton_compacted_attention(**inputs)
    assert not torch.allclose(before[:, :, :2], after[:, :, :2])  # the query heads of the INT4 KV head
    assert torch.equal(before[:, :, 2:], after[:, :, 2:])  # those of the head in the query dtype
    torch.testing.assert_close(after, compacted_attention(**inputs), atol=1e-5, rtol=1e-5)


def changed_int4(inputs, **fields):
    """Replace ``fields`` of the INT4 heads of ``inputs["prefix"]`` in place."""
    prefix = inputs["prefix"]
    inputs["prefix"] = QuantizedPrefix(*prefix, prefix.quantized._replace(**fields))


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda a: changed_int4(a, row_starts=(0, 4)), ValueError, "KV head 1 .* past its storage"),
        (lambda a: changed_int4(a, group_starts=(2, 2)), ValueError, "KV head 0 .* past its storage"),
        (lambda a: changed_int4(a, row_starts=(0, 0, 0)), ValueError, "row_starts must have one entry per KV head"),
        (lambda a: changed_int4(a, key_codes=a["prefix"].quantized.key_codes.int()), TypeError, "key_codes must"),
        (lambda a: changed_int4(a, key_scales=a["prefix"].quantized.key_scales.t()), ValueError, "contiguous"),
        (lambda a: changed_int4(a, value_scales=a["prefix"].quantized.value_scales[:2]), ValueError, "value_scales"),
    ],
)
def test_bad_int4_heads_are_rejected(change, error, match):
    inputs = make_inputs((3, 2), q_len=1, n_appended=4)
    inputs["prefix"] = quantized(inputs["prefix"], (True, True), 2)
    change(inputs)
    with pytest.raises(error, match=match):
        triton_compacted_attention(**inputs)


def test_rows_that_see_nothing_are_zero():
    """Empty prefix and a fully masked row: the reference's convention (zeros), not NaN."""
    inputs = make_inputs((0, 0), q_len=2, mask="bool")
    inputs["appended"].mask[:, :, 0] = False
    got = triton_compacted_attention(**inputs)
    assert torch.equal(got[:, 0], torch.zeros_like(got[:, 0]))
    torch.testing.assert_close(got, compacted_attention(**inputs), atol=1e-5, rtol=1e-5)


def test_causal_mask_with_fewer_appended_than_queries():
    """Bottom-right aligned causal mask when n < q: the first queries see only the prefix."""
    assert_matches_reference(make_inputs((5, 3), q_len=4, n_appended=2))


def test_mask_broadcast_over_batch_and_queries():
    inputs = make_inputs((4, 6), q_len=3, batch=2)
    changed(inputs, "appended", mask=torch.tensor([True, False, True, True, False, True]))  # [n], for every row
    assert_matches_reference(inputs)


def test_empty_batch_and_no_queries():
    inputs = make_inputs((3, 2), q_len=1)
    inputs["query"] = inputs["query"][:, :, :0]
    assert triton_compacted_attention(**inputs).shape == (2, 0, 4, 16)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda a: changed(a, "prefix", keys=a["prefix"].keys.half()), TypeError, "prefix.keys has dtype"),
        (lambda a: a.update(prefix=tuple(a["prefix"])), TypeError, "prefix must be given as CompactedPrefix"),
        (lambda a: a.update(appended=tuple(a["appended"])), TypeError, "appended must be given as AppendedTokens"),
        (lambda a: a.update(query=a["query"].double()), TypeError, "query must have dtype"),
        (lambda a: changed(a, "prefix", offsets=[0, 5, 3]), ValueError, "non-decreasing"),
        (lambda a: changed(a, "prefix", offsets=[0, 3, 99]), ValueError, "non-decreasing"),
        (lambda a: changed(a, "prefix", offsets=torch.tensor([0, 3, 5])), ValueError, "Python ints"),
        (lambda a: a.update(query=a["query"][:, :3]), ValueError, "cannot be grouped"),
        (lambda a: changed(a, "appended", mask=torch.ones(2, 1, 1, 7, dtype=torch.bool)), ValueError, "covers 7 keys"),
        (lambda a: changed(a, "appended", mask=torch.ones(2, 4, 1, 4, dtype=torch.bool)), ValueError, "broadcast"),
        (lambda a: changed(a, "appended", mask=torch.ones(2, 1, 1, 4, dtype=torch.long)), TypeError, "boolean"),
        (lambda a: changed(a, "appended", values=a["appended"].values[..., :8]), ValueError, "appended.values must"),
        (lambda a: changed(a, "prefix", bias=a["prefix"].bias[:4]), ValueError, "same number of rows"),
    ],
)
def test_bad_inputs_are_rejected(change, error, match):
    inputs = make_inputs((3, 2), q_len=1, n_appended=4)
    change(inputs)
    with pytest.raises(error, match=match):
        triton_compacted_attention(**inputs)


def test_num_splits_must_be_positive():
    with pytest.raises(ValueError, match="num_splits"):
        triton_compacted_attention(**make_inputs((3, 2)), num_splits=0)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setattr(runtime, "INTERPRETED", tl.constexpr(False))
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        triton_compacted_attention(**make_inputs((3, 2)))
