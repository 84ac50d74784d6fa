"""The torch paths of compacted attention (the reference and the fused SDPA one) and the registered mask function
against brute force."""

import pytest
import torch
from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

from hf_structkv.attention.compacted_inputs import AppendedTokens, CompactedPrefix
from hf_structkv.attention.compacted_reference import compacted_attention
from hf_structkv.attention.compacted_sdpa import fused_compacted_attention
from hf_structkv.attention.masks import structkv_mask


def dense_reference(problem, visible, scaling, softcap=None):
    """float64 softmax over [prefix of head h ‖ appended], head by head, query head by query head."""
    query, (keys, values, bias, offsets), (app_k, app_v, _) = problem
    batch, n_q, q_len, _ = query.shape
    n_kv = len(offsets) - 1
    group = n_q // n_kv
    out = torch.zeros(batch, n_q, q_len, values.shape[-1], dtype=torch.float64)
    for b in range(batch):
        for hq in range(n_q):
            h = hq // group
            a, e = offsets[h], offsets[h + 1]
            k = torch.cat([keys[a:e], app_k[b, h]]).double()
            v = torch.cat([values[a:e], app_v[b, h]]).double()
            s = query[b, hq].double() @ k.T * scaling
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            s[:, : e - a] += bias[a:e].double()
            s[:, e - a :] = s[:, e - a :].masked_fill(~visible[b, 0], float("-inf"))
            out[b, hq] = torch.softmax(s, -1) @ v
    return out.transpose(1, 2)


TORCH_PATHS = pytest.mark.parametrize("attention", [compacted_attention, fused_compacted_attention])


def random_problem(lengths, mask=None, n_q=6, q_len=3, n_app=5, batch=2, d=8, dtype=torch.float32, seed=0):
    """``(query, CompactedPrefix, AppendedTokens with mask)`` of random tensors, ``lengths[h]`` entries for head h."""
    g = torch.Generator().manual_seed(seed)
    n_kv = len(lengths)
    offsets = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    total = offsets[-1]
    query = torch.randn(batch, n_q, q_len, d, generator=g).to(dtype)
    prefix = CompactedPrefix(
        torch.randn(total, d, generator=g).to(dtype),
        torch.randn(total, d, generator=g).to(dtype),
        torch.randn(total, generator=g),
        offsets,
    )
    appended = AppendedTokens(
        torch.randn(batch, n_kv, n_app, d, generator=g).to(dtype),
        torch.randn(batch, n_kv, n_app, d, generator=g).to(dtype),
        mask,
    )
    return query, prefix, appended


def causal_visible(batch, q_len, n_app):
    q = torch.arange(q_len)[:, None]
    k = torch.arange(n_app)[None]
    return (k <= q + n_app - q_len).expand(batch, 1, q_len, n_app).clone()


@pytest.mark.parametrize("lengths", [(4, 7), (1, 9, 3), (0, 5), (6,)])
@pytest.mark.parametrize("use_none_mask", [True, False])
@TORCH_PATHS
def test_matches_dense_softmax(attention, lengths, use_none_mask):
    visible = causal_visible(2, 3, 5)
    if not use_none_mask:
        visible[1, 0, :, :2] = False  # padding of row 1
    p = random_problem(lengths, mask=None if use_none_mask else visible, n_q=2 * len(lengths))
    got = attention(*p, scaling=0.3)
    expected = dense_reference(p, visible, 0.3)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


@TORCH_PATHS
def test_additive_mask_and_softcap(attention):
    visible = causal_visible(2, 3, 5)
    p = random_problem((3, 4), mask=torch.where(visible, 0.0, float("-inf")))
    got = attention(*p, scaling=0.5, softcap=2.0)
    expected = dense_reference(p, visible, 0.5, softcap=2.0)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@TORCH_PATHS
def test_low_precision_inputs_keep_fp32_statistics(attention, dtype):
    visible = causal_visible(2, 3, 5)
    p = random_problem((5, 2), mask=visible, dtype=dtype)
    got = attention(*p, scaling=0.35)
    assert got.dtype == dtype
    expected = dense_reference(p, visible, 0.35)
    # Only the final cast to the input dtype loses precision.
    torch.testing.assert_close(got.double(), expected.to(dtype).double(), atol=1e-2, rtol=1e-2)


@TORCH_PATHS
def test_bad_shapes_are_named(attention):
    with pytest.raises(ValueError, match="5 query heads cannot be grouped over 2 KV heads"):
        attention(*random_problem((3, 4), n_q=5), scaling=1.0)
    query, prefix, appended = random_problem((3, 4), mask=torch.ones(2, 1, 3, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="attention mask covers 4 keys but 5 tokens are appended"):
        attention(query, prefix, appended, scaling=1.0)
    appended = AppendedTokens(appended.keys[:, :1], appended.values[:, :1])
    with pytest.raises(ValueError, match="appended keys have 1 KV heads, the prefix has 2"):
        attention(query, prefix, appended, scaling=1.0)
    with pytest.raises(TypeError, match="prefix must be given as CompactedPrefix"):
        attention(query, tuple(prefix), appended, scaling=1.0)
    with pytest.raises(TypeError, match="appended must be given as AppendedTokens"):
        attention(query, prefix, tuple(appended), scaling=1.0)


def test_mask_equals_sdpa_mask_without_padding_or_window():
    mask_fn = sliding_window_causal_mask_function(4)
    for padding in (None, torch.ones(2, 12, dtype=torch.bool)):
        args = dict(batch_size=2, q_length=3, kv_length=9, q_offset=9, kv_offset=3, attention_mask=padding)
        assert _same(
            structkv_mask(**args, mask_function=mask_fn, local_size=4),
            sdpa_mask(**args, mask_function=mask_fn, local_size=4),
        )
        assert _same(structkv_mask(**args), sdpa_mask(**args))


def _same(a, b):
    return (a is None and b is None) or torch.equal(a, b)


def test_sliding_window_over_padding_counts_positions():
    """Row 0 has 3 pads between its context and question: its window holds 4 real tokens, as when run alone."""
    window, length = 4, 12
    padding = torch.ones(2, length, dtype=torch.bool)
    padding[0, 5:8] = False
    mask = structkv_mask(
        batch_size=2,
        q_length=4,
        kv_length=length,
        q_offset=length - 4,
        kv_offset=0,
        mask_function=sliding_window_causal_mask_function(window),
        attention_mask=padding,
        local_size=window,
    )
    positions = padding.long().cumsum(-1) - 1
    for b in range(2):
        for qi in range(4):
            q_slot = length - 4 + qi
            for k in range(length):
                distance = positions[b, q_slot] - positions[b, k]
                expected = bool(padding[b, k]) and 0 <= distance < window
                assert bool(mask[b, 0, qi, k]) == expected, (b, qi, k)
    assert mask[0, 0, 0].sum() == window  # four real tokens, pads skipped


@pytest.mark.parametrize(
    ("lengths", "n_q", "q_len", "batch"), [((5, 9), 14, 1, 3), ((17,), 7, 6, 2), ((1, 2, 3, 4), 8, 4, 1)]
)
def test_fused_path_equals_the_reference_with_left_padding(lengths, n_q, q_len, batch):
    visible = causal_visible(batch, q_len, q_len + 4)
    visible[0, 0, :, :3] = False  # row 0 left-padded by 3
    query, prefix, appended = random_problem(
        lengths, visible, n_q=n_q, q_len=q_len, n_app=q_len + 4, batch=batch, seed=3
    )
    prefix = prefix._replace(bias=prefix.bias * 3)  # multipliers in [e^-3, e^3] and beyond
    want = compacted_attention(query, prefix, appended, scaling=0.25)
    got = fused_compacted_attention(query, prefix, appended, scaling=0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fused_path_runs_sdpa_and_leaves_only_softcap_and_empty_heads_to_the_reference(monkeypatch):
    import hf_structkv.attention.compacted_sdpa as fused

    calls = []

    def reference(*args):
        calls.append(args)
        return compacted_attention(*args)

    monkeypatch.setattr(fused, "compacted_attention", reference)
    visible = causal_visible(2, 3, 5)
    out = fused_compacted_attention(*random_problem((3, 4), visible), scaling=0.5)
    assert out.shape == (2, 3, 6, 8) and not calls
    fused_compacted_attention(*random_problem((3, 4), visible), scaling=0.5, softcap=2.0)
    assert len(calls) == 1 and calls[0][0].shape[1] == 6  # every query head
    visible[1, 0, :, :2] = False  # row 1 padded: its first query sees no key of head 0
    p = random_problem((0, 4, 2), visible, n_q=6)
    got = fused_compacted_attention(*p, scaling=0.5)
    assert len(calls) == 2 and calls[1][0].shape[1] == 2  # the query heads of the empty KV head only
    torch.testing.assert_close(got, compacted_attention(*p, scaling=0.5), atol=1e-5, rtol=0)
