"""Centred INT4 keys (`hf_structkv.quant.int4_centred`) in a mixed-precision cache: the centre and spread against a
brute-force loop, the round trip, every attention path that serves an INT4 store with centred keys (the reference
against dense attention over brute-force dequantised keys, the fused SDPA path, the C kernel reading the codes at a
decode step), the cache fitting the centre to each row's real prompt tokens under left padding, and the teacher-forced
replay equal to forced step-by-step decoding with centred keys."""

import shutil

import pytest
import torch
from test_fused_mixed_attention import case
from test_teacher_forced import PROMPT, STEPS, FixedTags, _policies, _replayed_logits, _stepwise_logits, _tags

from hf_structkv.attention import mixed_sdpa
from hf_structkv.attention.backend import BACKEND_ENV
from hf_structkv.attention.mixed_reference import DensePartition, Int4Partition, mixed_precision_attention
from hf_structkv.attention.registry import enable
from hf_structkv.cache.mixed_precision import StructuredMixedPrecisionCache
from hf_structkv.cache.mixed_precision_layer import MixedPrecisionLayer
from hf_structkv.cache.teacher_forced import TeacherForcedCache
from hf_structkv.models import tiny_byte_tokenizer, tiny_model
from hf_structkv.policy.costs import Action, GroupCosts
from hf_structkv.policy.table import PolicyTable
from hf_structkv.quant import (
    check_int4_keys,
    dequantize_int4,
    dequantize_int4_centred,
    key_centre,
    quantize_int4,
    quantize_int4_centred,
)
from hf_structkv.quant.int4_centred import SMALLEST_NORMAL_FP16, SPREAD_FLOOR


def brute_force_centre(keys: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The centre and spread by loops over rows, heads and channels."""
    batch, heads, _, dim = keys.shape
    centre, spread = torch.zeros(batch, heads, 1, dim), torch.ones(batch, heads, 1, dim)
    for b in range(batch):
        rows = [j for j in range(keys.shape[2]) if real[b, j]]
        if not rows:
            continue
        for h in range(heads):
            deviations = []
            for c in range(dim):
                mean = sum(float(keys[b, h, j, c]) for j in rows) / len(rows)
                centre[b, h, 0, c] = torch.tensor(mean).half().float()
                deviations.append(max(abs(float(keys[b, h, j, c]) - float(centre[b, h, 0, c])) for j in rows))
            floor = max(max(deviations) * SPREAD_FLOOR, SMALLEST_NORMAL_FP16)
            for c in range(dim):
                spread[b, h, 0, c] = torch.tensor(max(deviations[c], floor)).half().float()
    return centre, spread


def outlier_keys(batch=2, heads=2, n=12, dim=8, seed=0) -> torch.Tensor:
    """Keys with one channel offset by 40 and one of range 30, as a RoPE'd key's outlier channels."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, n, dim, generator=g)
    keys[..., 1] += 40.0
    keys[..., 3] *= 30.0
    keys[..., 5] = 0.25  # a constant channel: its spread is floored
    return keys


def test_centre_and_spread_equal_brute_force_over_the_real_tokens():
    keys = outlier_keys()
    real = torch.ones(2, 12, dtype=torch.bool)
    real[1, :5] = False  # row 1 left-padded by 5
    centre, spread = key_centre(keys, real)
    assert centre.dtype == spread.dtype == torch.float16 and centre.shape == (2, 2, 1, 8)
    want_centre, want_spread = brute_force_centre(keys, real)
    torch.testing.assert_close(centre.float(), want_centre, rtol=0, atol=0)
    torch.testing.assert_close(spread.float(), want_spread, rtol=0, atol=0)
    assert spread[..., 5].float().gt(0).all()  # the constant channel's spread is the floor, not 0
    padded = keys.clone()
    padded[1, :, :5] = 1e4  # what padded tokens hold does not matter
    for got, want in zip(key_centre(padded, real), (centre, spread)):
        assert torch.equal(got, want)


def test_a_row_without_real_tokens_gets_the_plain_row_layout():
    keys = outlier_keys()
    real = torch.zeros(2, 12, dtype=torch.bool)
    real[0] = True
    centre, spread = key_centre(keys, real)
    assert not centre[1].any() and spread[1].eq(1).all()
    codes, scales = quantize_int4_centred(keys, centre, spread)
    plain = quantize_int4(keys)
    assert torch.equal(codes[1], plain[0][1]) and torch.equal(scales[1], plain[1][1])


def test_centred_keys_round_trip_within_half_a_step_and_beat_plain_rows_on_outlier_channels():
    keys = outlier_keys(n=40)
    centre, spread = key_centre(keys, torch.ones(2, 40, dtype=torch.bool))
    codes, scales = quantize_int4_centred(keys, centre, spread)
    served = dequantize_int4_centred(codes, scales, centre, spread, 8)
    bound = scales.float() / 2 * spread.float() + 1e-5  # half a code step, scaled back
    assert (served - keys).abs().le(bound).all()
    by_hand = dequantize_int4(codes, scales, 8) * spread.float() + centre.float()
    assert torch.equal(served, by_hand)
    plain = dequantize_int4(*quantize_int4(keys), 8)
    ordinary = [0, 2, 4, 6, 7]  # plain rows spend their codes on channels 1 and 3 and round these to 0
    assert (served - keys)[..., ordinary].norm() < 0.5 * (plain - keys)[..., ordinary].norm()


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="int4_keys must be one of"):
        check_int4_keys("channel")
    with pytest.raises(TypeError, match="keys must be a floating-point tensor"):
        key_centre(torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="real must be a bool tensor"):
        key_centre(torch.zeros(1, 1, 3, 4), torch.ones(1, 4, dtype=torch.bool))
    model = tiny_model("qwen2")
    with pytest.raises(ValueError, match="int4_keys must be one of"):
        StructuredMixedPrecisionCache(model, PolicyTable.all_high(model.config), int4_keys="rows")
    with pytest.raises(ValueError, match="int4_keys must be one of"):
        TeacherForcedCache(model, PolicyTable.all_high(model.config), FixedTags(_tags(), PROMPT), int4_keys="")


def centred(parts: list, seed: int = 7) -> list:
    """``parts`` with the INT4 store's keys re-quantised centred on outlier-channel keys (and ``dense`` the same store
    served as brute-force dequantised dense keys and values)."""
    out = []
    for part in parts:
        if isinstance(part, Int4Partition):
            batch, heads, n = part.key_codes.shape[:3]
            keys = outlier_keys(batch, heads, n, part.head_dim, seed)
            centre, spread = key_centre(keys, torch.ones(batch, n, dtype=torch.bool))
            codes, scales = quantize_int4_centred(keys, centre, spread)
            part = Int4Partition(codes, scales, *[getattr(part, f) for f in ("value_codes", "value_scales")],
                                 part.head_dim, part.value_dim, part.visible, centre, spread)  # fmt: skip
        out.append(part)
    return out


def as_dense(parts: list) -> list:
    """Every INT4 store as a dense partition of its keys dequantised element by element."""
    out = []
    for part in parts:
        if isinstance(part, Int4Partition):
            codes = dequantize_int4(part.key_codes, torch.ones_like(part.key_scales), part.head_dim)
            keys = torch.empty_like(codes)
            for index in torch.cartesian_prod(*(torch.arange(s) for s in codes.shape)).tolist():
                b, h, j, c = index
                keys[b, h, j, c] = (
                    codes[b, h, j, c] * part.key_scales[b, h, j, 0].float() * part.key_spread[b, h, 0, c].float()
                    + part.key_centre[b, h, 0, c].float()
                )
            values = dequantize_int4(part.value_codes, part.value_scales, part.value_dim)
            part = DensePartition(keys, values, part.visible)
        out.append(part)
    return out


@pytest.mark.parametrize("prefix", ["no prefix", "INT4 prefix"])
@pytest.mark.parametrize("q_len", [1, 9])
@pytest.mark.parametrize("n_q_heads", [2, 6])
def test_reference_and_fused_paths_serve_centred_keys(prefix, q_len, n_q_heads, monkeypatch):
    query, parts = case(prefix, q_len, n_q_heads, torch.float32)
    parts = centred(parts)
    want = mixed_precision_attention(query, as_dense(parts), 0.3)
    torch.testing.assert_close(mixed_precision_attention(query, parts, 0.3), want, atol=1e-5, rtol=1e-5)
    calls = []
    real = mixed_sdpa.native_int4_rows_stats
    monkeypatch.setattr(mixed_sdpa, "native_int4_rows_stats", lambda *a: calls.append(1) or real(*a))
    torch.testing.assert_close(
        mixed_sdpa.fused_mixed_precision_attention(query, parts, 0.3), want, atol=1e-5, rtol=1e-5
    )
    if q_len == 1 and shutil.which("cc") is not None:
        assert calls == [1]  # the decode step read the centred store from its codes
    plain = mixed_precision_attention(query, as_dense([p for p in case(prefix, q_len, n_q_heads, torch.float32)[1]
                                                       if not isinstance(p, Int4Partition)]), 0.3)  # fmt: skip
    assert not torch.allclose(want, plain, atol=1e-3)  # the centred store takes part in the output


def prompt_with_padding(pad: int, length: int = PROMPT) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(1))
    batch = torch.cat([ids, torch.cat([torch.zeros(1, pad, dtype=torch.long), ids[:, : length - pad]], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :pad] = 0
    return batch, mask


def lowered_prompt_layer(pad: int, int4_keys: str, length: int = PROMPT):
    """A float64 tiny Qwen2's first mixed layer after a left-padded batch of 2 prompts (row 1 padded by ``pad``), all
    ``L`` with a window of 2, and one decode step (which commits). Returns ``(layer, prompt_keys [2, H_kv, P, D],
    mask [2, P])``."""
    model = enable(tiny_model("qwen2", num_hidden_layers=3, dtype=torch.float64))
    ids, mask = prompt_with_padding(pad, length)
    plan = torch.full((2, length, 3), int(Action.L))
    policy = PolicyTable.all_high(model.config, window=2, sink_tokens=0)
    cache = StructuredMixedPrecisionCache(model, policy, prefill_plan=plan, prompt_length=length, int4_keys=int4_keys)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
        layer = cache.mixed_layers()[0]
        prompt_keys = layer.keys.clone()
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        model(input_ids=nxt, attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1), cache=cache)
    return layer, prompt_keys, mask


def test_the_cache_fits_each_rows_centre_to_its_real_prompt_tokens():
    layer, prompt_keys, mask = lowered_prompt_layer(4, "centred")
    real = mask.bool()
    for b in range(2):
        want = key_centre(prompt_keys[b : b + 1], real[b : b + 1])
        assert torch.equal(layer.key_centre[b : b + 1], want[0]) and torch.equal(layer.key_spread[b : b + 1], want[1])
    assert layer.low.num_entries() == 2 * (PROMPT - 2) and layer.prompt_real is None
    stored = layer.nbytes()
    layer.key_centre = None  # the centre (and the spread) are counted: 2 bytes per element
    assert stored - layer.nbytes() == layer.key_spread.numel() * 2


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_replay_with_centred_keys_equals_forced_stepwise_decoding(arch, monkeypatch):
    model = enable(tiny_model(arch, num_hidden_layers=3, dtype=torch.float64))
    tokens = torch.randint(3, 256, (1, PROMPT + STEPS - 1), generator=torch.Generator().manual_seed(0))
    tags, window = FixedTags(_tags(), PROMPT), 3
    monkeypatch.setenv(BACKEND_ENV, "torch")
    differs = 0
    for name, policy, plan in _policies(model, window):
        logits = {}
        for int4_keys in ("row", "centred"):
            logits[int4_keys] = _stepwise_logits(model, tokens, policy, tags, plan, int4_keys=int4_keys)
            replayed = _replayed_logits(model, tokens, policy, tags, plan, int4_keys=int4_keys)
            torch.testing.assert_close(replayed, logits[int4_keys], rtol=1e-4, atol=1e-4, msg=f"{name} {int4_keys}")
        differs += not torch.allclose(logits["row"], logits["centred"], atol=1e-6)
    assert differs >= 3  # the schedules that lower keys serve them differently in the two layouts


def test_a_centred_layer_resets_and_selects_rows_with_its_centre():
    model = enable(tiny_model("qwen2", num_hidden_layers=3))
    ids, mask = prompt_with_padding(3)
    plan = torch.full((2, PROMPT, 3), int(Action.L))
    policy = PolicyTable.all_high(model.config, window=2, sink_tokens=0)
    cache = StructuredMixedPrecisionCache(model, policy, prefill_plan=plan, prompt_length=PROMPT, int4_keys="centred")
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
        model(input_ids=ids[:, :1], attention_mask=torch.cat([mask, mask[:, :1]], 1), cache=cache, use_cache=True)
    layer: MixedPrecisionLayer = cache.mixed_layers()[0]
    centre = layer.key_centre.clone()
    layer.select_rows(torch.tensor([1, 1, 0]))
    assert torch.equal(layer.key_centre, centre[[1, 1, 0]]) and layer.key_spread.shape[0] == 3
    layer.reset()
    assert layer.key_centre is None and layer.int4_keys == "centred"


def test_a_policys_key_layout_is_saved_as_its_quantizer_and_serves_its_caches(tmp_path):
    import dataclasses
    import json

    from hf_structkv.policy import illustrative_prefill_policy
    from hf_structkv.policy.prefill import PrefillPolicy
    from hf_structkv.quant.int4_centred import QUANTIZERS
    from hf_structkv.structured_generation import generate_calls

    model = tiny_model("qwen2", num_hidden_layers=3)
    table = dataclasses.replace(PolicyTable.all_high(model.config), int4_keys="centred")
    table.save_pretrained(tmp_path / "table")
    record = json.loads((tmp_path / "table" / "policy_table.json").read_text())
    assert record["conventions"]["quantizer"] == QUANTIZERS["centred"]
    assert "int4-centred-keys-row-fp16-scale" in (tmp_path / "table" / "README.md").read_text()
    loaded = PolicyTable.from_pretrained(tmp_path / "table")
    assert loaded == table and loaded.int4_keys == "centred"
    costs = GroupCosts.from_config(model.config)
    prefill = dataclasses.replace(illustrative_prefill_policy(), costs=costs, fingerprint=None, int4_keys="centred")
    prefill.save_pretrained(tmp_path / "prefill")
    assert PrefillPolicy.from_pretrained(tmp_path / "prefill").int4_keys == "centred"
    assert "INT4 keys (`L`): `centred`" in (tmp_path / "prefill" / "README.md").read_text()
    for name in ("table/policy_table.json", "prefill/prefill_policy.json"):
        path = tmp_path / name
        text = path.read_text()
        path.write_text(text.replace(QUANTIZERS["centred"], "int4-nf4"))
        with pytest.raises(ValueError, match="names the quantizer 'int4-nf4'"):
            (PolicyTable if "table" in name else PrefillPolicy).from_pretrained(path.parent)
        path.write_text(text.replace('"pask-b3"', '"other-cost"'))
        with pytest.raises(ValueError, match=r"conventions this hf_structkv does not implement: \['payload_cost'\]"):
            (PolicyTable if "table" in name else PrefillPolicy).from_pretrained(path.parent)
    with pytest.raises(ValueError, match="int4_keys must be one of"):
        dataclasses.replace(table, int4_keys="rows")
    cache = StructuredMixedPrecisionCache(model, table)
    assert {layer.int4_keys for layer in cache.mixed_layers()} == {"centred"}
    assert {
        layer.int4_keys for layer in StructuredMixedPrecisionCache(model, table, int4_keys="row").mixed_layers()
    } == {"row"}
    assert {layer.int4_keys for layer in TeacherForcedCache(model, table, FixedTags(_tags(), PROMPT)).layers} == {
        "centred"
    }
    row_prefill = dataclasses.replace(prefill, int4_keys="row")
    tokenizer = tiny_byte_tokenizer()
    tools = [{"name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}}]
    with pytest.raises(ValueError, match="one cache has one layout"):
        generate_calls(model, tokenizer, "q", tools, table, max_new_tokens=2, prefill_policy=row_prefill)
