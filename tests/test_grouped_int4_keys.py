"""INT4 keys centred per group of 128 prompt tokens (``int4_keys="centred-g128"``, `hf_structkv.quant.int4_centred`):
the centres against `key_centre` of each group, the group of a position, the served keys against a loop over rows,
the cache keeping one low store per group (left padding, row selection, bytes), the teacher-forced replay equal to
forced step-by-step decoding, a decode step reading every group's store in one C call, and the policy files
recording the layout. (Runtime-D's round trip is `served_keys`.)"""

import dataclasses
import shutil

import pytest
import torch
from test_centred_int4_keys import lowered_prompt_layer, outlier_keys
from test_teacher_forced import HIT, STEPS, FixedTags, _replayed_logits, _stepwise_logits, _tags

from hf_structkv.attention import mixed_sdpa
from hf_structkv.attention.backend import BACKEND_ENV
from hf_structkv.attention.mixed_reference import DensePartition, Int4Partition, mixed_precision_attention
from hf_structkv.attention.registry import enable
from hf_structkv.cache.mixed_precision import StructuredMixedPrecisionCache
from hf_structkv.calibration.buckets import Bucket
from hf_structkv.calibration.interventions import BucketIntervention
from hf_structkv.models import tiny_model
from hf_structkv.policy.costs import Action, GroupCosts
from hf_structkv.policy.table import PolicyTable
from hf_structkv.quant import dequantize_int4, key_centre, key_centres, key_groups, quantize_int4, served_keys
from hf_structkv.quant.int4_centred import QUANTIZERS

LONG = 300  # three groups: 0..127, 128..255, 256..299


def drifting_keys(n=LONG, seed=0) -> torch.Tensor:
    """``[1, 2, n, 8]`` outlier keys whose channel offsets move by 25 every 128 tokens (as a long prompt's do)."""
    keys = outlier_keys(batch=1, heads=2, n=n, dim=8, seed=seed)
    keys[..., :, 2] += 25.0 * (torch.arange(n) // 128).float()
    return keys


def test_key_centres_are_each_groups_key_centre_then_the_whole_prompts():
    keys = outlier_keys(batch=2, heads=2, n=LONG, dim=8)
    real = torch.ones(2, LONG, dtype=torch.bool)
    real[1, :140] = False  # row 1 left-padded past its first group
    centres, spreads = key_centres(keys, real, "centred-g128")
    assert centres.shape == spreads.shape == (2, 2, 4, 8) and centres.dtype == torch.float16
    for group, (a, b) in enumerate([(0, 128), (128, 256), (256, LONG), (0, LONG)]):
        centre, spread = key_centre(keys[..., a:b, :], real[:, a:b])
        assert torch.equal(centres[:, :, group : group + 1], centre) and torch.equal(
            spreads[:, :, group : group + 1], spread
        )
    assert torch.equal(centres[1, :, 0], torch.zeros(2, 8, dtype=torch.float16))  # no real token: the row layout
    assert torch.equal(spreads[1, :, 0], torch.ones(2, 8, dtype=torch.float16))
    whole = key_centres(keys, real, "centred")
    assert all(torch.equal(got, want) for got, want in zip(whole, key_centre(keys, real)))
    with pytest.raises(ValueError, match="int4_keys='row' stores no centre"):
        key_centres(keys, real, "row")
    with pytest.raises(ValueError, match="int4_keys must be one of"):
        key_centres(keys, real, "centred-g64")


def test_a_prompt_token_takes_its_groups_centre_and_a_later_token_the_whole_prompts():
    positions = torch.tensor([0, 127, 128, 255, 256, 299, 300, 1000])
    assert key_groups(positions, LONG, "centred-g128").tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert key_groups(positions, 256, "centred-g128").tolist() == [0, 0, 1, 1, 2, 2, 2, 2]
    assert key_groups(positions[:2], 100, "centred-g128").tolist() == [0, 1]
    assert key_groups(positions, LONG, "centred").tolist() == [0] * 8


def test_served_keys_equal_a_loop_over_rows_and_follow_a_drifting_prompt():
    keys = drifting_keys(n=LONG + 30)
    real = torch.ones(1, LONG, dtype=torch.bool)
    got = served_keys(keys, real, "centred-g128")
    for j in range(keys.shape[-2]):
        a, b = ((j // 128) * 128, min((j // 128) * 128 + 128, LONG)) if j < LONG else (0, LONG)
        centre, spread = key_centre(keys[..., a:b, :], real[:, a:b])
        codes, scales = quantize_int4((keys[..., j : j + 1, :] - centre.float()) / spread.float())
        want = dequantize_int4(codes, scales, 8) * spread.float() + centre.float()
        torch.testing.assert_close(got[..., j : j + 1, :], want, rtol=0, atol=1e-6)
    codes, scales = quantize_int4(keys)
    assert torch.equal(served_keys(keys, real, "row"), dequantize_int4(codes, scales, 8))
    error = {layout: (served_keys(keys, real, layout) - keys).norm() for layout in ("centred", "centred-g128")}
    assert error["centred-g128"] < 0.8 * error["centred"]


def test_the_cache_keeps_one_low_store_per_group_and_serves_each_row_by_its_groups_centre():
    layer, prompt_keys, mask = lowered_prompt_layer(140, "centred-g128", LONG)  # row 1 padded past its first group
    assert len(layer.group_stores) == 3 and layer.key_centre.shape[2] == 4 and layer.prompt_length == LONG
    want = torch.cat([served_keys(prompt_keys[b : b + 1], mask[b : b + 1].bool(), "centred-g128") for b in (0, 1)])
    seen = 0
    for group, store in enumerate(layer.low_stores()):
        if not store.num_entries():
            continue
        fields, positions = store.view()
        assert bool((key_groups(positions[positions >= 0], LONG, "centred-g128") == group).all())
        centre, spread = layer.key_centre[:, :, group : group + 1], layer.key_spread[:, :, group : group + 1]
        keys = (
            dequantize_int4(fields["key_codes"], fields["key_scales"], prompt_keys.shape[-1]) * spread.float()
            + centre.float()
        )
        for b in (0, 1):
            for i, p in enumerate(positions[b].tolist()):
                if p >= 0:
                    torch.testing.assert_close(keys[b, :, i], want[b, :, p].float(), rtol=0, atol=1e-6)
                    seen += 1
    assert seen == layer.num_low_entries() == 2 * (LONG - 2)  # every prompt slot but the window, padding included
    assert [s.num_entries() for s in layer.low_stores()] == [256, 256, 2 * (LONG - 256 - 2), 0]
    stored, grouped = layer.nbytes(), sum(store.nbytes() for store in layer.group_stores)
    codes, centre = layer.group_stores[0].view()[0]["key_codes"].clone(), layer.key_centre.clone()
    layer.select_rows(torch.tensor([1, 0]))
    assert torch.equal(layer.group_stores[0].view()[0]["key_codes"], codes[[1, 0]])
    assert torch.equal(layer.key_centre, centre[[1, 0]])
    layer.group_stores = []  # every group store's bytes are counted
    assert stored - layer.nbytes() == grouped > 0
    layer.reset()
    assert layer.group_stores == [] and layer.key_centre is None and layer.int4_keys == "centred-g128"


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_replay_with_grouped_keys_equals_forced_stepwise_decoding(arch, monkeypatch):
    model = enable(tiny_model(arch, num_hidden_layers=3, dtype=torch.float64))
    tokens = torch.randint(3, 256, (1, LONG + STEPS - 1), generator=torch.Generator().manual_seed(0))
    tags, window = FixedTags(_tags(), LONG), 3
    monkeypatch.setenv(BACKEND_ENV, "torch")
    plan = torch.full((1, LONG, 3), int(Action.H))
    plan[0, 100:200, 0], plan[0, 120:290, 1], plan[0, 5:140, 2] = int(Action.L), int(Action.R), int(Action.L)
    costs = GroupCosts.from_config(model.config)
    policy = BucketIntervention(costs, Bucket("|".join(HIT), 0), Action.L, 2, window)  # decoded tokens in L too
    logits = {}
    for int4_keys in ("centred", "centred-g128"):
        logits[int4_keys] = _stepwise_logits(model, tokens, policy, tags, plan, int4_keys, prompt=LONG)
        replayed = _replayed_logits(model, tokens, policy, tags, plan, int4_keys=int4_keys, prompt=LONG)
        torch.testing.assert_close(replayed, logits[int4_keys], rtol=1e-4, atol=1e-4, msg=int4_keys)
    assert not torch.allclose(logits["centred"], logits["centred-g128"], atol=1e-6)


def test_the_grouped_layout_is_saved_as_its_own_quantizer(tmp_path):
    model = tiny_model("qwen2", num_hidden_layers=3)
    table = dataclasses.replace(PolicyTable.all_high(model.config), int4_keys="centred-g128")
    table.save_pretrained(tmp_path / "table")
    assert QUANTIZERS["centred-g128"] == "int4-centred-keys-g128-row-fp16-scale"
    assert QUANTIZERS["centred-g128"] in (tmp_path / "table" / "policy_table.json").read_text()
    loaded = PolicyTable.from_pretrained(tmp_path / "table")
    assert loaded == table and loaded.int4_keys == "centred-g128"
    assert StructuredMixedPrecisionCache(model, loaded).layers[0].int4_keys == "centred-g128"


def test_a_decode_step_reads_every_group_store_in_one_call_and_equals_the_reference(monkeypatch):
    layer, _, _ = lowered_prompt_layer(140, "centred-g128", LONG)
    parts = [
        dataclasses.replace(p, keys=p.keys.float(), values=p.values.float()) if isinstance(p, DensePartition) else p
        for p in layer.partitions(None, 1)
    ]
    assert sum(isinstance(p, Int4Partition) for p in parts) == 3  # one per prompt group
    query = torch.randn(2, 2 * layer.keys.shape[1], 1, layer.keys.shape[-1], generator=torch.Generator().manual_seed(3))
    calls = []
    real = mixed_sdpa.native_int4_rows_stats
    monkeypatch.setattr(mixed_sdpa, "native_int4_rows_stats", lambda *a: calls.append(len(a[1])) or real(*a))
    got = mixed_sdpa.fused_mixed_precision_attention(query, parts, 0.25)
    torch.testing.assert_close(got, mixed_precision_attention(query, parts, 0.25), atol=1e-5, rtol=1e-5)
    if shutil.which("cc") is not None:
        assert calls == [3]  # the three group stores in one C call
