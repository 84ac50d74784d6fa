"""The C kernel of a decode step over INT4 heads (`native_int4`, `int4_decode.c`) against a dense brute force: the
served (dequantised by `quant`) keys and values of each head followed by its appended tokens, softmax in float64;
over the dimensions its code paths split on. Then its build cache, its switch and its fallback."""

import shutil
import subprocess
import warnings

import pytest
import torch
from test_compacted_attention import causal_visible, dense_reference, random_problem
from test_int4_head_stats import quantized

from hf_structkv.attention import int4_decode
from hf_structkv.attention.compacted_reference import appended_scores_mask
from hf_structkv.attention.native_int4 import MAX_DIM, NATIVE_ENV, native_int4_decode, native_library, runs_natively

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler named cc on this machine")


def decode_problem(lengths, dim, group, batch=2, n_app=5, spread=1.0, seed=0):
    """``(query, prefix, appended, visible)`` of one query per row: every KV head in INT4 with one row of key scales
    but the second (in the dtype, where there are three heads), batch row 1 left-padded by 2 appended tokens."""
    visible = causal_visible(batch, 1, n_app)
    visible[1:, 0, :, :2] = False
    n_kv = len(lengths)
    query, prefix, appended = random_problem(
        lengths, visible, n_q=group * n_kv, q_len=1, n_app=n_app, batch=batch, d=dim, seed=seed
    )
    int4_heads = tuple(not (n_kv == 3 and h == 1) for h in range(n_kv))
    prefix = quantized(prefix._replace(keys=prefix.keys * 2 + 1, bias=prefix.bias * 3), int4_heads, None)
    return query * spread, prefix, appended, visible


def native_outputs(query, prefix, appended, visible, scaling):
    """``[B, 1, H_q, D_v]`` float32: the kernel's outputs for the INT4 heads, NaN for the others."""
    batch, n_q, _, dim = query.shape
    out = torch.full((batch, n_q, prefix.values.shape[-1]), float("nan"))
    heads = [h for h in range(prefix.num_kv_heads) if prefix.quantized.int4_heads[h]]
    mask = appended_scores_mask(appended.mask, 1, appended.keys.shape[2], query.device).reshape(batch, -1)
    native_int4_decode(query, scaling, heads, prefix, appended.keys, appended.values, mask, out)
    return out[:, None]


def assert_int4_heads_match(got, want, rtol=2e-6):
    """The query heads that are not NaN (the INT4 heads') against the brute force, relative to its largest value."""
    served = ~torch.isnan(got)
    assert served.any()
    scale = want.abs().max().item()
    torch.testing.assert_close(got[served].double(), want[served], rtol=rtol, atol=rtol * scale)


@needs_compiler
@pytest.mark.parametrize("dim", [2, 6, 8, 16, 34, 64, 128, MAX_DIM])
@pytest.mark.parametrize("length", [1, 15, 16, 17, 100])
@pytest.mark.parametrize("group", [1, 3, 7])
def test_a_decode_step_equals_the_brute_force(dim, length, group):
    """Dimensions: a code byte after the last 32-bit word (2, 6, 34), whole words (8, 16), a value chunk of fewer than
    16 bytes (every dim below 32, and 34), the constant-dimension copies (64, 128), the largest; lengths around one
    block of 16 entries; 2, 6 and 14 query rows per head (around the groups of 4 and 8 rows); GQA, a padded row."""
    lengths = (length, 9, length + 3)
    query, prefix, appended, visible = decode_problem(lengths, dim, group, seed=dim + length + group)
    scaling = dim**-0.5
    want = dense_reference((query, prefix.dense(torch.float32), appended), visible, scaling)
    assert_int4_heads_match(native_outputs(query, prefix, appended, visible, scaling), want)


@needs_compiler
@pytest.mark.parametrize("spread", [1e-3, 1.0, 30.0])
def test_the_exponential_holds_over_the_score_range(spread):
    """Scores within a few units of each other up to hundreds apart: weights down to exp(-87) count, those below it
    are 0 (exp underflows in float32 there anyway). A float32 score is off by about 2^-24 of the terms summed into
    it, and its weight by as much relatively: the tolerance grows with the scores' size."""
    query, prefix, appended, visible = decode_problem((300, 40), 32, 4, spread=spread, seed=1)
    dense = prefix.dense(torch.float32)
    want = dense_reference((query, dense, appended), visible, 0.2)
    scores = query[:, :4, 0].double() @ dense.keys[:300].double().T * 0.2 + dense.bias[:300].double()
    assert (scores.amax(-1) - scores.amin(-1) > 87).any() == (spread == 30.0)  # the largest spread reaches past it
    score_size = (query.abs().amax() * dense.keys.abs().sum(-1).amax()).item() * 0.2
    got = native_outputs(query, prefix, appended, visible, 0.2)
    assert_int4_heads_match(got, want, rtol=max(2e-6, 4 * score_size * 2**-24))


@needs_compiler
def test_minus_inf_biases_weigh_exactly_zero_and_a_row_that_sees_nothing_gets_zeros():
    """Head 0's biases -inf every third entry, head 1's all -inf; batch row 1's query sees no appended token: its
    output from head 1 is exactly zero, as the reference's, and nothing is NaN."""
    query, prefix, appended, visible = decode_problem((20, 12), 16, 3)
    bias = prefix.bias.clone()
    bias[0:20:3] = float("-inf")
    bias[20:] = float("-inf")
    prefix = type(prefix)(prefix.keys, prefix.values, bias, prefix.offsets, prefix.quantized)
    visible[1] = False
    mask = appended_scores_mask(visible, 1, 5, query.device).reshape(2, -1)
    out = torch.full((2, 6, 16), float("nan"))
    native_int4_decode(query, 0.25, [0, 1], prefix, appended.keys, appended.values, mask, out)
    assert torch.isfinite(out).all() and torch.equal(out[1, 3:], torch.zeros(3, 16))
    want = dense_reference((query, prefix.dense(torch.float32), appended._replace(mask=visible)), visible, 0.25)
    assert_int4_heads_match(out[:1, None], want[:1])
    assert_int4_heads_match(out[1:, None, :3], want[1:, :, :3])


@needs_compiler
@pytest.mark.parametrize("masked", [False, True])
def test_the_torch_path_agrees(masked, monkeypatch):
    """`int4_decode_attention` over KV heads 0 and 2 of three (head 1 in the dtype), 7 query heads each, a batch of
    3: one C call against the torch path, head by head (`int4_head_stats`, `partition_stats`, `merge_partitions`);
    the appended mask plain causal (one row for the batch) or per batch row with padding. The dtype head's query
    heads are left untouched."""
    query, prefix, appended, visible = decode_problem((40, 17, 23), 64, 7, batch=3, n_app=9, seed=2)
    mask = appended_scores_mask(appended.mask if masked else None, 1, 9, query.device)
    args = (query, prefix, [0, 2], appended.keys, appended.values, mask, 0.125)
    native, torch_path = torch.full((3, 21, 64), 5.0), torch.full((3, 21, 64), 5.0)
    int4_decode.int4_decode_attention(*args, out=native)
    assert torch.equal(native[:, 7:14], torch.full((3, 7, 64), 5.0))
    monkeypatch.setattr(int4_decode, "runs_natively", lambda *_: False)
    int4_decode.int4_decode_attention(*args, out=torch_path)
    torch.testing.assert_close(native, torch_path, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="read from codes"):
        int4_decode.int4_decode_attention(query, prefix, [0, 1], *args[3:], out=native)


@needs_compiler
def test_bad_tensors_are_named():
    query, prefix, appended, _ = decode_problem((5, 6), 8, 2)
    mask = torch.zeros(1, 5)
    out = torch.empty(2, 4, 8)
    with pytest.raises(TypeError, match="query must be float32"):
        native_int4_decode(query.double(), 0.3, [0], prefix, appended.keys, appended.values, mask, out)
    with pytest.raises(ValueError, match="out must be contiguous"):
        native_int4_decode(query, 0.3, [0], prefix, appended.keys, appended.values, mask, out.transpose(0, 1))


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """`native_library` rebuilt into an empty cache for the test, and forgotten after it."""
    monkeypatch.setenv("HF_STRUCTKV_CACHE", str(tmp_path))
    native_library.cache_clear()
    yield tmp_path
    native_library.cache_clear()


@needs_compiler
def test_the_library_is_built_once_then_loaded_from_the_cache(fresh_library, monkeypatch):
    assert native_library() is not None
    (built,) = (fresh_library / "native").glob("int4_decode-*.so")
    native_library.cache_clear()

    def no_compiler(*_, **__):
        raise AssertionError("compiled again")

    monkeypatch.setattr(subprocess, "run", no_compiler)
    assert native_library() is not None and list((fresh_library / "native").iterdir()) == [built]


@needs_compiler
def test_a_cache_folder_that_cannot_be_written_builds_into_a_private_one(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("HF_STRUCTKV_CACHE", str(blocker / "below-a-file"))
    native_library.cache_clear()
    try:
        assert native_library() is not None
    finally:
        native_library.cache_clear()
    assert not (blocker / "below-a-file").exists()


def test_a_failed_build_warns_once_and_the_torch_path_serves(fresh_library, monkeypatch):
    monkeypatch.setenv("CC", str(fresh_library / "no-such-compiler"))
    with pytest.warns(RuntimeWarning, match="could not be built.*torch path"):
        assert native_library() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not runs_natively(torch.device("cpu"), 64, 64)  # cached: no second warning
    assert list((fresh_library / "native").iterdir()) == []  # no partial file left
    query, prefix, appended, visible = decode_problem((5, 6), 8, 2)
    with pytest.raises(RuntimeError, match="not available"):
        native_outputs(query, prefix, appended, visible, 0.3)
    out = torch.empty(2, 4, 8)
    mask = appended_scores_mask(appended.mask, 1, 5, query.device)
    int4_decode.int4_decode_attention(query, prefix, [0, 1], appended.keys, appended.values, mask, 0.3, out=out)
    want = dense_reference((query, prefix.dense(torch.float32), appended), visible, 0.3)
    torch.testing.assert_close(out[:, None].double(), want, atol=1e-5, rtol=1e-5)


def test_the_switch_turns_it_off(fresh_library, monkeypatch):
    monkeypatch.setenv(NATIVE_ENV, "0")
    assert native_library() is None and not runs_natively(torch.device("cpu"), 64, 64)
    assert not (fresh_library / "native").exists()


@needs_compiler
def test_only_cpu_tensors_of_fitting_dimensions_run_natively():
    cpu = torch.device("cpu")
    assert runs_natively(cpu, 64, 64) and runs_natively(cpu, 2, MAX_DIM)
    assert not runs_natively(cpu, MAX_DIM + 2, 64) and not runs_natively(cpu, 64, 7)
    assert not runs_natively(cpu, 0, 64) and not runs_natively(torch.device("meta"), 64, 64)
