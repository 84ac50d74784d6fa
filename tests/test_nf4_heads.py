"""benchmarks/nf4_heads.py: bitsandbytes' NF4 against a brute-force nearest-level reference, the bytes of an NF4
head equal its stored tensors, the served keys and values are the dequantised stored ones, and
compaction_loss.py --storage nf4 compares NF4 with INT4 at equal bytes (issue 31)."""

import math

import pytest
import torch
from test_benchmark_scripts import BENCHMARKS, load_script

from hf_structkv.compaction import compact_head, relative_loss

pytest.importorskip("bitsandbytes", reason="scripts/setup.sh installs bitsandbytes==0.50.2")
nf4 = load_script(BENCHMARKS / "nf4_heads.py")

# The 16 NF4 levels (QLoRA, appendix E: quantiles of N(0, 1) scaled to [-1, 1], an exact 0), as bitsandbytes lists them.
NF4_LEVELS = torch.tensor(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635, -0.18477343022823334,
     -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
     0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]
)  # fmt: skip


def brute_force_nf4(x: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(absmax per block, dequantised x)``: each element replaced by the nearest level to ``x / absmax`` of its
    block of ``blocksize`` consecutive (row-major) elements, times that absmax."""
    flat = x.flatten().double()
    absmax = torch.stack([block.abs().max() for block in flat.split(blocksize)])
    scale = absmax.repeat_interleave(blocksize)[: flat.numel()]
    nearest = (flat[:, None] / scale[:, None] - NF4_LEVELS.double()[None, :]).abs().argmin(dim=1)
    return absmax.float(), (NF4_LEVELS.double()[nearest] * scale).float().view(x.shape)


@pytest.mark.parametrize(("shape", "blocksize"), [((7, 64), 64), ((5, 24), 32), ((33, 16), 128)])
def test_nf4_matches_the_nearest_level_reference(shape, blocksize):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * torch.logspace(-1, 1, shape[1])
    codes, absmax = nf4.quantize_nf4(x, blocksize)
    want_absmax, want = brute_force_nf4(x, blocksize)
    assert codes.dtype == torch.uint8 and codes.numel() == math.ceil(x.numel() / 2)
    assert torch.equal(absmax, want_absmax)
    torch.testing.assert_close(nf4.dequantize_nf4(codes, absmax, shape, blocksize), want, rtol=1e-6, atol=1e-6)
    assert codes.numel() + 4 * absmax.numel() == nf4.nf4_nbytes(x.numel(), blocksize)


def test_layout_counts_bytes_and_inverts_a_byte_budget():
    layout = nf4.NF4Layout(key_dim=24, value_dim=40, blocksize=32)
    # 10 entries: 240 key codes -> 120 bytes + 8 absmax (32 B), 400 value codes -> 200 + 13 absmax (52 B), biases 40
    assert layout.nbytes(10) == 120 + 32 + 200 + 52 + 40 + 8
    for budget in [0, 8, 50, 100, 1000, 4321]:
        entries = layout.entries_for(budget)
        best = max((t for t in range(200) if layout.nbytes(t) <= budget), default=0)
        assert entries == best, budget


def head_problem(seed: int = 0, length: int = 80, dim: int = 64):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(length, dim, generator=g) + 3 * torch.randn(dim, generator=g)  # channels far from zero
    return keys, torch.randn(length, dim, generator=g), torch.randn(200, dim, generator=g)


@pytest.mark.parametrize("key_layout", nf4.KEY_LAYOUTS)
def test_nf4_head_serves_its_dequantised_stored_tensors(key_layout):
    keys, values, queries = head_problem()
    head = nf4.compact_quantized(keys, values, queries, 32, nf4.NF4Storage(key_layout))
    stored_keys = (head.keys.T if key_layout == "channels" else head.keys).shape
    served_keys = nf4.dequantize_nf4(head.key_codes, head.key_absmax, stored_keys, 64)
    assert torch.equal(served_keys.T if key_layout == "channels" else served_keys, head.keys)
    assert torch.equal(nf4.dequantize_nf4(head.value_codes, head.value_absmax, (32, 64), 64), head.values)
    kept = keys[head.indices]
    if key_layout == "channels":  # 32 kept tokens per channel, two channels a block: absmax of their kept keys
        assert torch.equal(head.key_absmax, kept.T.reshape(-1, 64).abs().amax(dim=1))
    else:  # one key row a block
        assert torch.equal(head.key_absmax, kept.abs().amax(dim=1))
    assert head.nbytes() == nf4.NF4Layout(64, 64).nbytes(32)
    assert head.train_loss == pytest.approx(relative_loss(head, keys, queries, values))
    with pytest.raises(ValueError, match="key_layout"):
        nf4.NF4Storage(key_layout="rows")
    with pytest.raises(ValueError, match="blocksize"):
        nf4.NF4Storage(blocksize=48)
    with pytest.raises(ValueError, match="method"):
        nf4.compact_quantized(keys, values, queries, 32, nf4.NF4Storage(), method="kv_sugeon")


def test_refit_with_nf4_keys_beats_rounding_the_dtype_fit():
    """The refit against the served NF4 keys serves the calibration queries better than the same selection fitted
    with the exact keys and only then rounded to NF4 (quantizing after the fit)."""
    keys, values, queries = head_problem(seed=1)
    head = nf4.compact_quantized(keys, values, queries, 32, nf4.NF4Storage("tokens"))
    exact = compact_head(keys, values, queries, 32, "kv_surgeon")
    codes, absmax = nf4.quantize_nf4(keys[exact.indices], 64)
    rounded_keys = nf4.dequantize_nf4(codes, absmax, (32, 64), 64)
    value_codes, value_absmax = nf4.quantize_nf4(exact.values, 64)
    after = nf4.NF4Head(
        exact.indices, exact.bias, nf4.dequantize_nf4(value_codes, value_absmax, (32, 64), 64), keys=rounded_keys
    )
    assert torch.equal(head.indices, exact.indices)
    assert head.train_loss < relative_loss(after, keys, queries, values)


def test_compaction_loss_nf4_run_compares_with_int4_at_equal_bytes(tmp_path):
    benchmark = load_script(BENCHMARKS / "compaction_loss.py")
    argv = ["--tiny", "--min-tokens", "200", "--questions", "3", "--query-cap", "256", "--self-study-ratios"]
    argv += ["--storage", "bf16", "int4", "nf4", "--nf4-keys", "tokens", "channels", "--nf4-blocksize", "32"]
    argv += ["--key-groups", "4", "--methods", "kv_surgeon", "--ratios", "10"]
    argv += ["--threads", str(torch.get_num_threads()), "--out", str(tmp_path / "nf4.json")]
    payload = benchmark.main(argv)

    labels = ["kv_surgeon", "kv_surgeon+int4/g4", "kv_surgeon+int4/g4/unguarded"]
    labels += ["kv_surgeon+nf4/channels/b32", "kv_surgeon+nf4/tokens/b32"]
    assert sorted(payload["summary"]["repeat"]["10"]) == labels
    for record in payload["records"]:
        assert record["bytes"] <= record["byte_budget"]
        if record["method"].startswith("kv_surgeon+nf4"):
            assert record["storage_used"] == "nf4" and record["kept"] == record["budget"]
            assert record["budget"] == nf4.NF4Layout(16, 16, 32).entries_for(record["byte_budget"])
        if record["method"].endswith("/unguarded"):
            assert record["storage_used"] == "int4" and not record["storage_fallback"]
