"""The GPU benchmark script `benchmarks/attention_kernels.py`: its cache-mix helpers against closed forms and stored
bytes, its embedded-model architecture against the real model, and its ``--smoke`` run (CPU, Triton interpreter)."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_structkv.policy.costs import Action
from hf_structkv.quant.int4 import quantize_int4

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCHMARKS / "attention_kernels.py"


def load_script(path: Path):
    """Import a benchmark script (not a package) as a module named after its file."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module


ak = load_script(SCRIPT)


@pytest.mark.parametrize("history", [160, 4096, 131072])
@pytest.mark.parametrize("payload_ratio", ak.PAYLOAD_RATIOS)
@pytest.mark.parametrize("head_dim", [64, 128, 65])
def test_mixed_entry_counts_hit_the_payload_ratio(history, payload_ratio, head_dim):
    window = 8 if history == 160 else 32
    counts = ak.mixed_entry_counts(history, payload_ratio, window, head_dim)
    older = history - window
    assert counts.recent == window
    assert counts.released == round(ak.RELEASED_FRACTION * older)
    assert counts.high + counts.low + counts.recent + counts.released == history
    assert min(counts.high, counts.low) >= 0
    # Stored bytes of one KV head's K and V rows: BF16 rows 2 * D bytes, INT4 rows ceil(D / 2) code bytes + a 2-byte
    # FP16 scale (quantize_int4's own output), the B.3 cost convention in bytes.
    codes, scales = quantize_int4(torch.randn(1, head_dim))
    int4_row = codes.numel() * codes.element_size() + scales.numel() * scales.element_size()
    bf16_row = 2 * head_dim
    stored = (counts.high + counts.recent) * bf16_row + counts.low * int4_row
    measured = stored / (history * bf16_row)
    assert measured == pytest.approx(counts.payload_ratio(ak.GroupCosts.from_dims([1], [head_dim])), rel=1e-12)
    assert abs(measured - payload_ratio) <= 1 / history  # rounding to whole tokens


def test_mixed_entry_counts_reject_unreachable_ratios():
    with pytest.raises(ValueError, match="payload_ratio 0.1 is outside"):
        ak.mixed_entry_counts(4096, 0.1, 32, 64)  # below all-INT4 with 20% released
    with pytest.raises(ValueError, match="payload_ratio 0.95 is outside"):
        ak.mixed_entry_counts(4096, 0.95, 32, 64)  # above all-BF16 with 20% released


def test_prefill_plan_permutes_the_counts_per_group():
    counts = ak.EntryCounts(high=5, low=7, recent=3, released=4)
    plan = ak.prefill_plan(counts, batch=2, generator=torch.Generator().manual_seed(0))
    assert plan.shape == (2, 19, 3)
    assert torch.equal(plan[0], plan[1])
    for group in range(3):
        column = plan[0, :, group]
        assert [int((column == int(a)).sum()) for a in (Action.H, Action.L, Action.R)] == [5 + 3, 7, 4]
        assert bool((column[-3:] == int(Action.H)).all())
    assert not torch.equal(plan[0, :, 0], plan[0, :, 1])  # each group its own permutation


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_ragged_head_lengths_spread_around_the_mean(kv_heads):
    lengths = ak.ragged_head_lengths(409.6, kv_heads)
    assert len(lengths) == kv_heads
    if kv_heads > 1:
        assert lengths[0] == round(0.5 * 409.6) and lengths[-1] == round(1.5 * 409.6)
    assert abs(sum(lengths) - kv_heads * 409.6) <= kv_heads / 2
    assert ak.ragged_head_lengths(0.2, 2) == [1, 1]
    with pytest.raises(ValueError, match="kv_heads"):
        ak.ragged_head_lengths(10.0, 0)


@pytest.mark.slow
def test_embedded_model_config_matches_the_embedded_model(default_model):
    config = default_model[0].config
    for name, value in ak.EMBEDDED_MODEL_CONFIG.items():
        actual = getattr(config, name)
        if isinstance(value, float):
            assert actual == pytest.approx(value, rel=1e-6), name
        else:
            assert actual == value, name
    assert config.model_type == "qwen2"


def test_attention_kernels_smoke(tmp_path):
    out = tmp_path / "attention_kernels.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--out", str(out)],
        check=True,
        env=env,
        timeout=120,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    assert result["smoke"] is True and result["copy_bytes_per_s"] > 0
    rows = result["kernels"]
    grid = len(ak.SHAPES) * len(ak.SMOKE.lengths) * len(ak.SMOKE.batches)
    assert len(rows) == grid * (1 + len(ak.COMPACTION_RATIOS) + len(ak.PAYLOAD_RATIOS))
    assert {row["kernel"] for row in rows} == {"sdpa", "compacted", "mixed"}
    for row in rows:
        assert math.isfinite(row["seconds"]) and row["seconds"] > 0
        assert row["bytes_read"] > 0 and row["speedup_vs_sdpa"] > 0
        if row["kernel"] != "sdpa":  # the smoke grid is one point: every kernel row is checked
            assert row["reference_rel_error"] < ak.REFERENCE_TOLERANCE
        if row["kernel"] == "mixed":
            assert abs(row["payload_ratio"] - float(row["variant"].removeprefix("B="))) <= 1 / row["history"]
    e2e = result["end_to_end"]
    assert e2e["weights"] == "random" and e2e["context_tokens"] == ak.SMOKE.e2e_context
    caches = {row["cache"].split()[0]: row for row in e2e["rows"]}
    assert set(caches) == {"DynamicCache", "CompactedCache", "StructuredMixedPrecisionCache"}
    assert all(row["tpot_s"] > 0 for row in e2e["rows"])
    assert caches["CompactedCache"]["stored_bytes"] < caches["DynamicCache"]["stored_bytes"]
    assert 0.4 < caches["StructuredMixedPrecisionCache"]["payload_ratio"] < 0.65
