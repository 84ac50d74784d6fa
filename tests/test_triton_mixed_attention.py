"""The Triton mixed-precision attention kernel (dense + packed INT4 partitions, eq. 15 merge) against the torch
reference ``mixed_precision_attention``, under the Triton interpreter on CPU.

Tolerances (max abs / rel difference, outputs of magnitude <~ 3): fp32 1e-5; fp16 2e-3; bf16 1.6e-2 (about two
output ulps: the kernel rounds the softmax weights, times the INT4 value scales, to the value dtype for the value
product). INT4 partitions hold the codes of ``hf_structkv.quant.quantize_int4``; both sides dequantise the same codes.
"""

import os

# Triton reads this when it decorates kernels, triton.language's own included, so it must be set before triton is
# first imported (hf_structkv and transformers import it): this line covers a run of this file alone, a session-wide
# setting (tests/conftest.py) a whole suite.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from hf_structkv.attention.mixed_reference import (  # noqa: E402
    DensePartition,
    Int4Partition,
    mixed_precision_attention,
)
from hf_structkv.quant import key_centre, quantize_int4, quantize_int4_centred  # noqa: E402

try:
    from hf_structkv.attention.kernels import runtime
    from hf_structkv.attention.kernels.mixed_attention import triton_mixed_precision_attention
    from hf_structkv.attention.kernels.softmax_stats import BLOCK_N
except ImportError as error:  # only where triton cannot be installed
    pytest.skip(f"triton cannot be imported ({error}); pip install 'hf-structkv[triton]'", allow_module_level=True)

if not runtime.interpreter_ready():  # triton was imported before TRITON_INTERPRET=1 was set (by another test module)
    pytest.fail(
        "TRITON_INTERPRET=1 must be set before triton is first imported: set it in tests/conftest.py", pytrace=False
    )

TOLERANCES = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make_partitions(kinds, lengths, batch=2, n_kv=2, q_len=1, dtype=torch.float32, head_dim=16, value_dim=16, seed=0):
    """One partition per ``kinds`` letter (``d`` dense, ``i`` INT4) with ``lengths`` keys, random visibility."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for kind, n in zip(kinds, lengths):
        keys = torch.randn(batch, n_kv, n, head_dim, generator=g)
        values = torch.randn(batch, n_kv, n, value_dim, generator=g)
        visible = torch.rand(batch, q_len, n, generator=g) > 0.2
        if kind == "d":
            parts.append(DensePartition(keys.to(dtype), values.to(dtype), visible))
        else:
            key_codes, key_scales = quantize_int4(keys)
            value_codes, value_scales = quantize_int4(values)
            parts.append(Int4Partition(key_codes, key_scales, value_codes, value_scales, head_dim, value_dim, visible))
    query = torch.randn(batch, q_len, n_kv, head_dim, generator=g).to(dtype)
    return query, parts


def assert_matches_reference(query, parts, softcap=None, num_splits=None):
    scaling = query.shape[-1] ** -0.5
    expected = mixed_precision_attention(query, parts, scaling, softcap)
    got = triton_mixed_precision_attention(query, parts, scaling, softcap, num_splits=num_splits)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    tol = TOLERANCES[query.dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


def grouped_query(batch, group, n_kv, q_len, dtype, head_dim=16, seed=1):
    """``[B, H_q, q, D]`` as a transposed view, as transformers' attention modules pass it."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, q_len, n_kv * group, head_dim, generator=g).to(dtype).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 4, 7])
def test_dense_int4_and_recent_partitions(dtype, group):
    """High store, INT4 store, recent region; lengths odd and past a block boundary."""
    _, parts = make_partitions("did", (7, BLOCK_N + 1, 3), dtype=dtype)
    assert_matches_reference(grouped_query(2, group, 2, 1, dtype), parts)


@pytest.mark.parametrize(
    ("kinds", "lengths"),
    [("did", (0, 0, 1)), ("did", (0, 5, 2)), ("di", (BLOCK_N, 0)), ("i", (1,))],
)
def test_empty_partitions_and_single_tokens(kinds, lengths):
    _, parts = make_partitions(kinds, lengths)
    assert_matches_reference(grouped_query(2, 2, 2, 1, torch.float32), parts)


def test_all_history_released_and_nothing_visible():
    """No partition holds a key: zeros, like the reference; a row that sees none of its keys: zeros too."""
    query, parts = make_partitions("did", (0, 0, 0))
    assert torch.equal(triton_mixed_precision_attention(query.transpose(1, 2), parts, 0.25), torch.zeros(2, 1, 2, 16))
    query, parts = make_partitions("di", (4, 6))
    for part in parts:
        part.visible[0] = False
    got = triton_mixed_precision_attention(query.transpose(1, 2), parts, 0.25)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    assert_matches_reference(query.transpose(1, 2), parts)


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("q_len", [1, 3])
def test_split_kv_over_long_histories(num_splits, q_len):
    _, parts = make_partitions("did", (BLOCK_N + 9, 2 * BLOCK_N + 3, 4), q_len=q_len, batch=1)
    assert_matches_reference(grouped_query(1, 4, 2, q_len, torch.float32), parts, num_splits=num_splits)


def test_odd_head_and_value_dims_and_softcap():
    _, parts = make_partitions("id", (9, 4), q_len=2, head_dim=15, value_dim=21)
    query = grouped_query(2, 2, 2, 2, torch.float32, head_dim=15) * 4  # logits large enough for the cap to matter
    assert_matches_reference(query, parts, softcap=3.0)


def centred(part, seed=5):
    """``part`` with keys re-drawn around large per-channel offsets and stored centred (codes, centre, spread)."""
    batch, n_kv, n, _ = part.key_codes.shape
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, n_kv, n, part.head_dim, generator=g) + torch.linspace(-20, 20, part.head_dim)
    centre, spread = key_centre(keys, torch.ones(batch, n, dtype=torch.bool))
    codes, scales = quantize_int4_centred(keys, centre, spread)
    return int4_with(part, key_codes=codes, key_scales=scales, key_centre=centre, key_spread=spread)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("kinds", "lengths", "q_len", "num_splits"),
    [
        ("did", (5, BLOCK_N + 3, 2), 1, None),  # three launches: the shift enters the merged statistics
        ("did", (5, 2 * BLOCK_N + 3, 2), 3, 5),  # the centred store split in several pieces
        ("i", (BLOCK_N - 3,), 2, 1),  # one launch, one split: the output needs no shift
    ],
)
def test_centred_int4_keys_are_read_as_codes(dtype, kinds, lengths, q_len, num_splits, monkeypatch):
    """An INT4 store with centred keys (`hf_structkv.quant.int4_centred`) is read as codes: its launch reads
    ``q ⊙ s`` and its statistics get ``q · μ``; the result is the reference's over the same codes, centre and spread
    (nothing dequantised: `Int4Partition.float_keys_values` is not called)."""
    _, parts = make_partitions(kinds, lengths, q_len=q_len, dtype=dtype)
    index = kinds.index("i")
    parts[index] = centred(parts[index])
    query = grouped_query(2, 2, 2, q_len, dtype) * 0.2
    scaling = query.shape[-1] ** -0.5
    expected = mixed_precision_attention(query, parts, scaling)

    def refuse(self):
        raise AssertionError("a centred store was dequantised for a launch")

    monkeypatch.setattr(Int4Partition, "float_keys_values", refuse)
    got = triton_mixed_precision_attention(query, parts, scaling, num_splits=num_splits)
    monkeypatch.undo()
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
    plain = int4_with(parts[index], key_centre=None, key_spread=None)
    assert not torch.allclose(
        expected.float(),
        mixed_precision_attention(query, [*parts[:index], plain, *parts[index + 1 :]], scaling).float(),
    )


def test_centred_int4_keys_with_softcap_are_dequantised():
    """No logit shift commutes with soft-capping: a centred store is dequantised first, the reference's result."""
    _, parts = make_partitions("id", (9, 4), q_len=2)
    parts[0] = centred(parts[0])
    assert_matches_reference(grouped_query(2, 2, 2, 2, torch.float32) * 4, parts, softcap=3.0)


def int4_with(part, **changes):
    fields = ("key_codes", "key_scales", "value_codes", "value_scales", "head_dim", "value_dim", "visible")
    fields += ("key_centre", "key_spread")
    return Int4Partition(**{**{f: getattr(part, f) for f in fields}, **changes})


BAD_INPUTS = {
    "no partitions": (lambda q, p: (q, []), ValueError, "non-empty"),
    "not a partition": (lambda q, p: (q, [p[0], "x"]), TypeError, "DensePartition or an Int4Partition"),
    "dtype mismatch": (lambda q, p: (q.half(), p), TypeError, "has dtype"),
    "heads not grouped": (lambda q, p: (q[:, :1], p), ValueError, "cannot be grouped"),
    "visibility shape": (
        lambda q, p: (q, [DensePartition(p[0].keys, p[0].values, p[0].visible[:, :, :2])]),
        ValueError,
        "visible",
    ),
    "fp32 scales": (
        lambda q, p: (q, [p[0], int4_with(p[1], value_scales=p[1].value_scales.float())]),
        TypeError,
        "value_scales",
    ),
    "value dims differ": (lambda q, p: (q, [p[0], int4_with(p[1], value_dim=12)]), ValueError, "value_dim"),
    "centre without spread": (
        lambda q, p: (q, [p[0], int4_with(p[1], key_centre=torch.zeros(2, 2, 1, 16, dtype=torch.float16))]),
        ValueError,
        "come together",
    ),
    "centre of another head dim": (
        lambda q, p: (q, [p[0], int4_with(centred(p[1]), key_spread=torch.ones(2, 2, 1, 8, dtype=torch.float16))]),
        ValueError,
        "key_spread must be",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_inputs_are_rejected(case):
    change, error, match = BAD_INPUTS[case]
    query, parts = make_partitions("di", (3, 4))
    query, parts = change(query.transpose(1, 2), parts)
    with pytest.raises(error, match=match):
        triton_mixed_precision_attention(query, parts, 0.25)
