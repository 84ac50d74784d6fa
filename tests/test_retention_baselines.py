"""Decode-time baselines (StreamingLLM, H2O, SnapKV, MiKV, CriticalKV) on the mixed-precision cache: decisions
against brute-force references on hand-made attention statistics, attention statistics against a dense softmax
reference, stored tensors that really shrink, budgets measured by the ledger against the knob arithmetic, and clear
errors."""

import math

import pytest
import torch
from transformers import DynamicCache

from hf_structkv.attention.attention_mass import AttentionMass, TokenStatistics
from hf_structkv.attention.mixed_reference import (
    DensePartition,
    Int4Partition,
    attention_mass,
    attention_probabilities,
    head_output_projections,
    projected_value_norms,
    summed_mass,
)
from hf_structkv.cache.mixed_precision import StructuredMixedPrecisionCache
from hf_structkv.models import tiny_model
from hf_structkv.policy import H2O, Action, CriticalKV, GroupCosts, MiKV, PolicyTable, SnapKV, StreamingLLM
from hf_structkv.policy.baselines.base import solve_knob
from hf_structkv.policy.baselines.snapkv import pool_scores
from hf_structkv.quant import dequantize_int4, quantize_int4

R, L, H = int(Action.R), int(Action.L), int(Action.H)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", num_hidden_layers=3)  # one layer per group


def costs_of(model):
    return GroupCosts.from_config(model.config)


def run(model, policy, prompt_len=20, new_tokens=10, seed=0, batch=1):
    """Greedy generation from a random prompt on a cache under ``policy``; returns (sequences, cache)."""
    torch.manual_seed(seed)
    ids = torch.randint(3, 256, (batch, prompt_len))
    cache = StructuredMixedPrecisionCache(model, policy)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        past_key_values=cache,
    )
    return out, cache


# ----------------------------------------------------------------------------------------- attention statistics
def random_partitions(seed=0, batch=2, kv_heads=2, dim=8, sizes=(5, 4, 3), q_len=3):
    generator = torch.Generator().manual_seed(seed)
    high = DensePartition(
        torch.randn(batch, kv_heads, sizes[0], dim, generator=generator),
        torch.randn(batch, kv_heads, sizes[0], dim, generator=generator),
        torch.rand(batch, q_len, sizes[0], generator=generator) > 0.3,
    )
    k_codes, k_scales = quantize_int4(torch.randn(batch, kv_heads, sizes[1], dim, generator=generator))
    v_codes, v_scales = quantize_int4(torch.randn(batch, kv_heads, sizes[1], dim, generator=generator))
    low_visible = torch.rand(batch, q_len, sizes[1], generator=generator) > 0.3
    low = Int4Partition(k_codes, k_scales, v_codes, v_scales, dim, dim, low_visible)
    recent_visible = torch.ones(batch, q_len, sizes[2], dtype=torch.bool)
    recent_visible[1, 0] = False  # a row that sees nothing in this partition
    recent = DensePartition(
        torch.randn(batch, kv_heads, sizes[2], dim, generator=generator),
        torch.randn(batch, kv_heads, sizes[2], dim, generator=generator),
        recent_visible,
    )
    query = torch.randn(batch, 2 * kv_heads, q_len, dim, generator=generator)
    return query, [high, low, recent]


def dense_probabilities(query, parts, scaling, softcap=None):
    """Softmax over the concatenated keys of every query head, ``[B, H_q, q, n]`` (zeros for a row seeing nothing)."""
    keys = torch.cat(
        [
            p.keys.float() if isinstance(p, DensePartition) else dequantize_int4(p.key_codes, p.key_scales, p.head_dim)
            for p in parts
        ],
        dim=2,
    )
    visible = torch.cat([p.visible for p in parts], dim=-1)  # [B, q, n]
    keys = keys.repeat_interleave(query.shape[1] // keys.shape[1], dim=1)  # [B, H_q, n, D]
    scores = (query @ keys.transpose(-1, -2)) * scaling
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    return torch.softmax(scores.masked_fill(~visible[:, None], -torch.inf), dim=-1).nan_to_num(0.0)


def dense_mass(query, parts, scaling, softcap=None, value_norms=None):
    """`dense_probabilities` summed over heads and rows (each head's probability times its ``value_norms`` entry,
    one ``[B, H_kv, g, n]`` per partition, when given), split back per partition."""
    probs = dense_probabilities(query, parts, scaling, softcap)
    if value_norms is not None:
        probs = probs * torch.cat(value_norms, dim=-1).flatten(1, 2).unsqueeze(2)  # query head h = kv * g + j
    total = probs.sum(dim=(1, 2))  # [B, n]
    return list(total.split([p.visible.shape[-1] for p in parts], dim=-1))


def test_attention_mass_equals_dense_softmax_reference():
    query, parts = random_partitions()
    got, weighted = attention_mass(query, parts, scaling=0.35)
    assert weighted is None
    for g, w in zip(got, dense_mass(query, parts, 0.35), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    rows_seeing = torch.cat([p.visible for p in parts], dim=-1).any(-1).sum()  # each (row, head) sums to 1
    per_row = sum(p.sum(dim=-1) for p in attention_probabilities(query, parts, scaling=0.35))  # [B, H_kv, g, q]
    seeing = torch.cat([p.visible for p in parts], dim=-1).any(-1)[:, None, None].expand_as(per_row)
    torch.testing.assert_close(per_row, seeing.float())
    assert float(sum(g.sum() for g in got)) == pytest.approx(float(rows_seeing) * query.shape[1], rel=1e-5)


def test_attention_mass_with_an_empty_partition_and_softcap():
    query, parts = random_partitions(seed=1, sizes=(5, 0, 3))
    got = attention_mass(query, parts, scaling=0.5, softcap=2.0)[0]
    assert got[1].shape == (2, 0)
    for g, w in zip(got, dense_mass(query, parts, 0.5, softcap=2.0), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_value_weighted_mass_equals_a_per_head_brute_force():
    """CriticalKV's score sum_h a_hj ||v_j W_o^h||_1, partition by partition (dense, INT4, dense)."""
    query, parts = random_partitions(seed=2)
    n_q_heads, dim, d_model = query.shape[1], query.shape[-1], 5
    o_proj = torch.nn.Linear(n_q_heads * dim, d_model, bias=False)
    module = type("Attention", (torch.nn.Module,), {})()
    module.o_proj = o_proj
    projections = head_output_projections(module, n_q_heads, dim)
    norms = [projected_value_norms(part, projections) for part in parts]
    mass, got = attention_mass(query, parts, 0.35, value_norms=norms)
    probabilities = attention_probabilities(query, parts, 0.35)  # computed once, summed both ways
    for g, w in zip(summed_mass(probabilities, norms), got, strict=True):
        torch.testing.assert_close(g, w)
    for g, w in zip(summed_mass(probabilities), mass, strict=True):
        torch.testing.assert_close(g, w)
    values = torch.cat([part.float_keys_values()[1] for part in parts], dim=2)  # [B, H_kv, n, D]
    keys = torch.cat([part.float_keys_values()[0] for part in parts], dim=2)
    visible = torch.cat([part.visible for part in parts], dim=-1)
    group = n_q_heads // keys.shape[1]
    want = torch.zeros(query.shape[0], keys.shape[2])
    for b in range(query.shape[0]):
        for h in range(n_q_heads):
            k, v = keys[b, h // group], values[b, h // group]
            weight = o_proj.weight[:, h * dim : (h + 1) * dim].detach()
            norm = (v @ weight.T).abs().sum(dim=-1)  # [n]
            for row in range(query.shape[2]):
                if visible[b, row].any():
                    scores = (k @ query[b, h, row]) * 0.35
                    probs = torch.softmax(scores.masked_fill(~visible[b, row], -torch.inf), dim=-1)
                    want[b] += probs * norm
    torch.testing.assert_close(torch.cat(got, dim=-1), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one tensor per partition"):
        attention_mass(query, parts, 0.35, value_norms=norms[:2])
    with pytest.raises(ValueError, match="o_proj"):
        head_output_projections(torch.nn.Module(), n_q_heads, dim)
    with pytest.raises(ValueError, match="o_proj"):
        head_output_projections(module, n_q_heads, dim + 1)


def test_statistics_on_equals_off_and_mass_matches_closed_form(model):
    torch.manual_seed(0)
    ids = torch.randint(3, 256, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    # the same decisions without statistics: the prompt's real tokens H, its padding R (as H2O at ratio 1 plans it)
    plan = torch.where(mask.bool(), H, R).unsqueeze(-1).expand(-1, -1, 3)
    off = StructuredMixedPrecisionCache(model, PolicyTable.all_high(model.config, window=8), prefill_plan=plan)
    # heavy ratio 1 keeps the whole prompt; window 8 > 6 new tokens: no generated token is decided during generation
    on = StructuredMixedPrecisionCache(model, H2O(model, sink_tokens=2, window=8, heavy_ratio=1.0))
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    want = model.generate(**kwargs, past_key_values=off, output_scores=True, return_dict_in_generate=True)
    got = model.generate(**kwargs, past_key_values=on, output_scores=True, return_dict_in_generate=True)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores, strict=True):
        assert torch.equal(a, b)  # statistics on: outputs identical bit for bit
    # every (query row, query head) of every layer spreads exactly 1 over the slots it sees
    heads = model.config.num_attention_heads
    rows = torch.tensor([12 + 5, 9 + 5])  # real prompt rows + 5 fed-back generated tokens per sequence
    for group in range(3):
        mass = on.statistics.mass[group]
        torch.testing.assert_close(mass.sum(dim=1), rows.float() * heads, rtol=1e-5, atol=1e-4)
        assert bool((mass[1, :3] == 0).all())  # padding receives nothing
    assert torch.equal(on.statistics.prompt_real, mask.bool())


def test_layer_records_the_dense_reference_mass_per_slot(model):
    out, cache = run(model, H2O(model, sink_tokens=1, window=3, heavy_ratio=0.5), prompt_len=10, new_tokens=4)
    layer = cache.mixed_layers()[2]
    before = cache.statistics.mass[2].clone()
    query = torch.randn(1, model.config.num_attention_heads, 1, layer.keys.shape[-1])
    parts = layer.partitions(None, 1)
    layer.record_attention(query, parts, scaling=0.25)
    added = cache.statistics.mass[2] - before
    seen = layer.get_seq_length()
    want = torch.zeros(1, seen)
    slots = []
    if layer.high.num_entries():
        slots.append(layer.high.view()[1])
    if layer.low.num_entries():
        slots.append(layer.low.view()[1])
    slots.append(torch.arange(layer.first_recent, seen).unsqueeze(0))
    for mass, positions in zip(dense_mass(query, parts, 0.25), slots, strict=True):
        for j, p in enumerate(positions[0].tolist()):
            if p >= 0:
                want[0, p] += mass[0, j]
    torch.testing.assert_close(added[:, :seen], want, rtol=1e-5, atol=1e-6)


def test_statistics_refuse_the_triton_backend(model, monkeypatch):
    monkeypatch.setenv("HF_STRUCTKV_ATTENTION_BACKEND", "triton")
    pytest.importorskip("triton")
    with pytest.raises(ValueError, match="torch reference only"):
        run(model, H2O(model, window=4), prompt_len=8, new_tokens=2)


def test_attention_mass_accumulator_rows_and_validation():
    stats = AttentionMass(observation_window=4)
    assert stats.counted_rows(0, 10) == slice(6, 10) and stats.counted_rows(10, 1) is None
    assert AttentionMass().counted_rows(10, 1) == slice(0, 1)
    assert AttentionMass(observation_window=0).counted_rows(0, 10) is None
    stats.add(0, torch.ones(2, 3))
    stats.add(0, torch.ones(2, 5))
    assert stats.row_mass(1, 6)[0].tolist() == [2, 2, 2, 1, 1, 0]
    stats.select_rows(torch.tensor([1, 1, 0]))
    assert stats.mass[0].shape == (3, 5)
    with pytest.raises(ValueError, match="observation_window"):
        AttentionMass(observation_window=-1)
    with pytest.raises(ValueError, match="num_groups"):
        AttentionMass(num_groups=0)
    with pytest.raises(ValueError, match="weighted mass must be given exactly"):
        stats.add(0, torch.ones(3, 5), torch.ones(3, 5))
    with pytest.raises(ValueError, match="no value-weighted mass"):
        stats.weighted_row_mass(0, 5)
    with pytest.raises(TypeError, match="value_weighted must be True or False"):
        AttentionMass(value_weighted=1)
    weighted = AttentionMass(value_weighted=True)
    weighted.add(1, torch.ones(2, 3), torch.full((2, 3), 2.0))
    weighted.add(1, torch.ones(2, 4), torch.full((2, 4), 3.0))
    assert weighted.row_mass(0, 4)[1].tolist() == [2, 2, 2, 1]
    assert weighted.weighted_row_mass(0, 5)[1].tolist() == [5, 5, 5, 3, 0]
    weighted.select_rows(torch.tensor([1]))
    assert weighted.weighted[1].shape == (1, 4)
    with pytest.raises(ValueError, match="weighted mass must be given exactly"):
        weighted.add(0, torch.ones(1, 2))


# ----------------------------------------------------------------------------------------- decisions vs brute force
def brute_heavy_prompt(mass, real, sinks, ratio, low):
    plan = [[R] * mass.shape[0] for _ in range(real.shape[0])]
    real_positions = [p for p in range(real.shape[0]) if real[p]]
    sink_set = set(real_positions[:sinks])
    others = [p for p in real_positions if p not in sink_set]
    keep = math.floor(ratio * len(others) + 1e-9)
    for g in range(mass.shape[0]):
        ranked = sorted(others, key=lambda p: (-float(mass[g, p]), p))[:keep]
        for p in real_positions:
            plan[p][g] = H if p in sink_set or p in ranked else low
    return torch.tensor(plan)


def brute_heavy_decode(prompt_plan, prompt_real, sinks, ratio, low, steps):
    """Replay the documented rule with plain lists: ``steps`` = (position, mass [G, n] or None for a stop token)."""
    groups = prompt_plan.shape[1]
    real = [p for p in range(len(prompt_real)) if prompt_real[p]]
    sink_set = set(real[:sinks])
    kept = [[p for p in real if p not in sink_set and prompt_plan[p, g] == H] for g in range(groups)]
    n = len(real) - len(sink_set)
    out = []
    for position, mass in steps:
        if mass is None:
            out.append(None)
            continue
        if position < sinks:
            out.append((H,) * groups)
            continue
        n += 1
        budget = math.floor(ratio * n + 1e-9)
        actions = []
        for g in range(groups):
            scores = [float(mass[g, p]) for p in kept[g]]
            room = budget - len(kept[g])
            keep = room >= 2 or (room == 1 and (not scores or float(mass[g, position]) >= min(scores)))
            actions.append(H if keep else low)
        for g in range(groups):
            if actions[g] == H:
                kept[g].append(position)
        out.append(tuple(actions))
    return out


@pytest.mark.parametrize("policy_cls", [H2O, MiKV])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_heavy_hitter_decisions_match_brute_force(model, policy_cls, seed):
    generator = torch.Generator().manual_seed(seed)
    prompt = 17
    real = torch.ones(prompt, dtype=torch.bool)
    real[:3] = False  # left padding
    mass = torch.rand(3, prompt, generator=generator).round(decimals=1)  # ties on purpose
    mass[:, ~real] = 0
    policy = policy_cls(model, sink_tokens=2, window=4, heavy_ratio=0.35)
    controller = policy.controller(costs_of(model))
    plan = controller.plan_prompt(mass, real)
    assert torch.equal(plan, brute_heavy_prompt(mass, real, 2, 0.35, int(policy.LOW)))
    steps, history = [], mass
    for i in range(12):
        grown = torch.cat([history, torch.rand(3, 1, generator=generator)], dim=1)
        history = grown + torch.rand(grown.shape, generator=generator) * 0.3  # attention keeps accumulating
        steps.append((prompt + i, None if i == 5 else history.clone()))
    want = brute_heavy_decode(plan, real, 2, 0.35, int(policy.LOW), steps)
    got = []
    for position, step_mass in steps:
        candidates = None if step_mass is None else ()
        stats = None if step_mass is None else TokenStatistics(position, step_mass)
        actions = controller.step(candidates, stats)
        got.append(None if actions is None else tuple(int(a) for a in actions))
    assert got == want
    assert controller.scheduled_bits == sum(costs_of(model).total(a) for a in want if a is not None)
    controller.rollback(4)
    assert controller.num_steps == 4 and controller.scheduled_bits == sum(
        costs_of(model).total(a) for a in want[:4] if a is not None
    )


def brute_pool(values, pooling, kernel):
    half, out = kernel // 2, []
    for i in range(len(values)):
        window = [values[j] if 0 <= j < len(values) else 0.0 for j in range(i - half, i + half + 1)]
        out.append(sum(window) / kernel if pooling == "avg" else max(v for j, v in enumerate(window)))
    return out


@pytest.mark.parametrize("pooling", ["avg", "max"])
@pytest.mark.parametrize("kernel", [1, 3, 5])
def test_snapkv_prompt_plan_matches_brute_force(model, pooling, kernel):
    generator = torch.Generator().manual_seed(kernel)
    prompt = 20
    real = torch.ones(prompt, dtype=torch.bool)
    real[:2] = False
    mass = torch.rand(3, prompt, generator=generator)
    mass[:, ~real] = 0
    policy = SnapKV(model, observation_window=4, pooling=pooling, kernel=kernel, prompt_ratio=0.4, window=4)
    plan = policy.controller(costs_of(model)).plan_prompt(mass, real)
    slots = [p for p in range(prompt) if real[p]]
    prefix = slots[:-4]
    keep = math.floor(0.4 * len(prefix))
    for g in range(3):
        pooled = brute_pool([float(mass[g, p]) for p in slots], pooling, kernel)
        ranked = sorted(range(len(prefix)), key=lambda i: (-pooled[i], i))[:keep]
        want = [R] * prompt
        for i in ranked:
            want[prefix[i]] = H
        for p in slots[-4:]:
            want[p] = H
        assert plan[:, g].tolist() == want
    assert torch.allclose(
        pool_scores(mass[0, slots], pooling, kernel), torch.tensor(brute_pool(mass[0, slots].tolist(), pooling, kernel))
    )


@pytest.mark.parametrize("first_stage_ratio", [0.0, 0.5, 1.0])
def test_criticalkv_prompt_plan_matches_brute_force(model, first_stage_ratio):
    """Two stages per group: floor(eps * k) by pooled attention, the rest by pooled value-weighted attention."""
    generator = torch.Generator().manual_seed(7)
    prompt, pooling, kernel = 24, "max", 3
    real = torch.ones(prompt, dtype=torch.bool)
    real[:3] = False
    mass, weighted = torch.rand(3, prompt, generator=generator), torch.rand(3, prompt, generator=generator)
    policy = CriticalKV(
        model, observation_window=4, kernel=kernel, prompt_ratio=0.5, first_stage_ratio=first_stage_ratio
    )
    plan = policy.controller(costs_of(model)).plan_prompt(mass, real, weighted)
    slots = [p for p in range(prompt) if real[p]]
    prefix = slots[:-4]
    keep = math.floor(0.5 * len(prefix))
    first = math.floor(first_stage_ratio * keep + 1e-9)
    for g in range(3):
        pooled = brute_pool([float(mass[g, p]) for p in slots], pooling, kernel)[: len(prefix)]
        pooled_w = brute_pool([float(weighted[g, p]) for p in slots], pooling, kernel)[: len(prefix)]
        stage1 = sorted(range(len(prefix)), key=lambda i: (-pooled[i], i))[:first]
        rest = [i for i in range(len(prefix)) if i not in stage1]
        stage2 = sorted(rest, key=lambda i: (-pooled_w[i], i))[: keep - first]
        want = [R] * prompt
        for i in stage1 + stage2:
            want[prefix[i]] = H
        for p in slots[-4:]:
            want[p] = H
        assert plan[:, g].tolist() == want
    snap = SnapKV(model, observation_window=4, kernel=kernel, prompt_ratio=0.5).controller(costs_of(model))
    assert torch.equal(plan, snap.plan_prompt(mass, real)) == (first_stage_ratio == 1.0)
    with pytest.raises(ValueError, match="value-weighted"):
        policy.controller(costs_of(model)).plan_prompt(mass, real)


def test_criticalkv_in_a_cache_plans_from_the_recorded_value_weighted_mass(model):
    """On a tiny model: the cache records both statistics in the prompt forward, the plan is the brute-force two-stage
    selection of them, eps = 1 generates what SnapKV generates, and the stored tensors shrink like SnapKV's."""
    knobs = dict(observation_window=4, prompt_ratio=0.4, window=3)
    out, cache = run(model, CriticalKV(model, first_stage_ratio=0.0, **knobs), prompt_len=20, new_tokens=6)
    stats = cache.statistics
    weighted, mass = stats.weighted_row_mass(0, 20), stats.row_mass(0, 20)
    assert not torch.allclose(weighted, mass) and (weighted > 0).all()
    replanned = CriticalKV(model, first_stage_ratio=0.0, **knobs).controller(cache.costs)
    assert torch.equal(
        cache.schedule.prefill_plan[0], replanned.plan_prompt(mass, torch.ones(20, dtype=torch.bool), weighted)
    )
    snap_out, snap_cache = run(model, SnapKV(model, **knobs), prompt_len=20, new_tokens=6)
    eps_one_out, eps_one_cache = run(
        model, CriticalKV(model, first_stage_ratio=1.0, **knobs), prompt_len=20, new_tokens=6
    )
    assert torch.equal(eps_one_out, snap_out) and torch.equal(
        eps_one_cache.schedule.prefill_plan, snap_cache.schedule.prefill_plan
    )
    assert cache.nbytes() == snap_cache.nbytes() and cache.scheduled_payload() == snap_cache.scheduled_payload()


def test_streaming_llm_plan_keeps_the_first_real_tokens_and_the_recent_ones(model):
    real = torch.tensor([False, False, True, True, True, True, True, True])
    plan = StreamingLLM(model, sink_tokens=3, window=2).controller(costs_of(model)).plan_prompt(torch.zeros(3, 8), real)
    assert plan[:, 0].tolist() == [R, R, H, H, H, R, R, R] and torch.equal(plan[:, 0], plan[:, 2])
    recent = StreamingLLM(model, sink_tokens=2, window=2, recent_tokens=2).controller(costs_of(model))
    assert recent.plan_prompt(torch.zeros(3, 8), real)[:, 1].tolist() == [R, R, H, H, R, R, H, H]
    short = torch.tensor([False, False, False, False, False, False, True, True])  # recent window over padding only
    assert recent.plan_prompt(torch.zeros(3, 8), short)[:, 1].tolist() == [R, R, R, R, R, R, H, H]


# ----------------------------------------------------------------------------------------- on a tiny model
def test_streaming_llm_stores_exactly_sinks_and_window(model):
    sinks, window = 3, 5
    out, cache = run(model, StreamingLLM(model, sink_tokens=sinks, window=window), prompt_len=16, new_tokens=12)
    for layer in cache.mixed_layers():
        seen = layer.get_seq_length()
        assert layer.high.view()[1][0].tolist() == list(range(sinks))
        assert layer.low.num_entries() == 0
        assert layer.keys.shape[-2] == window + 1  # the window and the last forward's token
        assert layer.first_recent == seen - window - 1
    assert cache.nbytes() < cache.full_nbytes()
    assert cache.scheduled_payload() == sinks * cache.costs.full / 8


@pytest.mark.parametrize(
    "policy",
    [
        lambda m: StreamingLLM(m, sink_tokens=4, window=3),
        lambda m: SnapKV(m, observation_window=5, prompt_ratio=0.3, window=3),
        lambda m: H2O(m, sink_tokens=2, window=3, heavy_ratio=0.3),
        lambda m: MiKV(m, sink_tokens=2, window=3, heavy_ratio=0.3),
        lambda m: CriticalKV(m, observation_window=5, prompt_ratio=0.3, window=3),
    ],
    ids=["streaming_llm", "snapkv", "h2o", "mikv", "criticalkv"],
)
def test_measured_budget_matches_the_knob_arithmetic(model, policy):
    policy = policy(model)
    out, cache = run(model, policy, prompt_len=24, new_tokens=14)
    prompt, decoded = 24, cache.get_seq_length() - 24
    cache.schedule.scheduled_bits(cache.get_seq_length())  # decide every token, as bytes_report does
    measured = cache.scheduled_payload() / cache.full_payload()
    expected = policy.expected_budget([(prompt, decoded)])
    prompt_bits, _, _ = cache.schedule.scheduled_bits_by_stage(cache.get_seq_length())
    if isinstance(policy, H2O | MiKV):  # prompt exact, decode short of the arithmetic by at most one token
        full, low = cache.costs.full, cache.costs.total((policy.LOW,) * 3)
        high = 2 + math.floor(0.3 * 22 + 1e-9)
        assert prompt_bits == high * full + (prompt - high) * low
        one_token = (full - low) / (full * cache.get_seq_length())
        assert expected - one_token - 1e-12 <= measured <= expected + 1e-12
    else:
        assert measured == pytest.approx(expected, abs=1e-12)
    assert cache.nbytes() < cache.full_nbytes() or isinstance(policy, SnapKV)


def test_mikv_quantises_instead_of_releasing(model):
    out, cache = run(model, MiKV(model, sink_tokens=2, window=3, heavy_ratio=0.25), prompt_len=20, new_tokens=8)
    layer = cache.mixed_layers()[0]
    stored = layer.high.num_entries() + layer.low.num_entries() + layer.keys.shape[-2]
    assert stored == layer.get_seq_length() and layer.low.num_entries() > 0


def test_full_heavy_ratio_generates_what_dynamic_cache_generates(model):
    torch.manual_seed(3)
    ids = torch.randint(3, 256, (1, 15))
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
    want = model.generate(**kwargs, past_key_values=DynamicCache(config=model.config))
    # heavy ratio 1 keeps the prompt (its generated tokens stay in the 9-token window); SnapKV keeps generated tokens
    for policy in (H2O(model, window=9, heavy_ratio=1.0), SnapKV(model, window=2, prompt_ratio=1.0)):
        assert torch.equal(model.generate(**kwargs, past_key_values=StructuredMixedPrecisionCache(model, policy)), want)


# ----------------------------------------------------------------------------------------- budgets and errors
LENGTHS = [(400, 90), (350, 60), (520, 120)]


@pytest.mark.parametrize("target", [0.25, 0.33, 0.5])
@pytest.mark.parametrize("policy_cls", [StreamingLLM, SnapKV, H2O, MiKV, CriticalKV])
def test_for_budget_is_the_closest_knob_from_below(model, policy_cls, target):
    policy = policy_cls.for_budget(model, target, LENGTHS, window=32)
    budget = policy.expected_budget(LENGTHS)
    knob = getattr(policy, policy_cls.BUDGET_KNOB)
    lowest = policy_cls(model, window=32, **{policy_cls.BUDGET_KNOB: 0}).expected_budget(LENGTHS)
    if lowest > target:  # MiKV's all-INT4 floor above 0.25: the lowest knob, reported as such
        assert knob == 0 and policy_cls is MiKV and target == 0.25
        return
    assert budget <= target + 1e-12
    step = 1 if policy_cls is StreamingLLM else 0.002
    above = policy_cls(model, window=32, **{policy_cls.BUDGET_KNOB: knob + step}).expected_budget(LENGTHS)
    assert above >= budget and target - budget < 0.01


def test_solve_knob_bisection():
    assert solve_knob(lambda x: x / 2, 0.3, 0, 1) == pytest.approx(0.6, abs=1e-9)
    assert solve_knob(lambda x: 0.5 + x, 0.3, 0, 1) == 0
    assert solve_knob(lambda x: x / 10, 0.3, 0, 1) == 1


def test_clear_errors(model):
    with pytest.raises(ValueError, match="low_bits"):
        MiKV(model, low_bits=2)
    with pytest.raises(ValueError, match="kernel must be odd"):
        SnapKV(model, kernel=4)
    with pytest.raises(ValueError, match="pooling"):
        SnapKV(model, pooling="mean")
    with pytest.raises(ValueError, match="first_stage_ratio"):
        CriticalKV(model, first_stage_ratio=1.5)
    with pytest.raises(ValueError, match="heavy_ratio"):
        H2O(model, heavy_ratio=1.5)
    with pytest.raises(ValueError, match="window"):
        StreamingLLM(model, window=0)
    with pytest.raises(ValueError, match="target"):
        H2O.for_budget(model, 0.0, LENGTHS)
    with pytest.raises(ValueError, match="chooses heavy_ratio"):
        H2O.for_budget(model, 0.3, LENGTHS, heavy_ratio=0.2)
    with pytest.raises(ValueError, match="lengths"):
        SnapKV.for_budget(model, 0.3, [(0, 5)])
    with pytest.raises(TypeError, match="GroupCosts"):
        H2O("not a model")
    other = GroupCosts.from_dims([1, 1, 1], [8, 8, 8])
    with pytest.raises(ValueError, match="group costs"):
        H2O(model).controller(other)
    with pytest.raises(ValueError, match="prefill_plan"):
        StructuredMixedPrecisionCache(model, H2O(model), prefill_plan=torch.full((1, 4, 3), H))
    out, cache = run(model, H2O(model, window=2), prompt_len=6, new_tokens=3)
    with pytest.raises(NotImplementedError, match="crop"):
        cache.crop(4)


@pytest.mark.parametrize("max_score_elements", [1, 80, 120, 2**20])
def test_attention_mass_in_row_blocks_equals_the_dense_reference(max_score_elements):
    # 2 x 4 query heads x 5 entries = 40 logits a row: blocks of 1, 2 and 3 of the 7 rows (3 does not divide 7) and
    # one block, the same sums as the dense softmax, with and without value weights (the memory of a long prompt's
    # statistics grows as block x entries)
    query, parts = random_partitions(seed=3, q_len=7)
    for g, w in zip(
        attention_mass(query, parts, 0.35, max_score_elements=max_score_elements)[0], dense_mass(query, parts, 0.35)
    ):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    norms = [torch.rand(*p.visible.shape[:1], 2, query.shape[1] // 2, p.visible.shape[-1]) for p in parts]
    whole = attention_mass(query, parts, 0.35, value_norms=norms, max_score_elements=2**30)[1]
    blocked = attention_mass(query, parts, 0.35, value_norms=norms, max_score_elements=max_score_elements)[1]
    for g, w in zip(blocked, whole, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("max_score_elements", [1, 2**20])
def test_one_pass_returns_the_mass_and_the_value_weighted_mass_of_two_separate_computations(max_score_elements):
    # one call with value norms (the recorder's single pass) against the two computations it replaces: the
    # unweighted call, and brute-force dense softmaxes summed with and without the weights; in row blocks of 1 and whole
    query, parts = random_partitions(seed=4, q_len=5)
    generator = torch.Generator().manual_seed(5)
    norms = [
        torch.rand(query.shape[0], 2, query.shape[1] // 2, p.visible.shape[-1], generator=generator) for p in parts
    ]
    mass, weighted = attention_mass(query, parts, 0.35, value_norms=norms, max_score_elements=max_score_elements)
    alone, no_weighted = attention_mass(query, parts, 0.35, max_score_elements=max_score_elements)
    assert no_weighted is None
    for got, separate, dense in zip(mass, alone, dense_mass(query, parts, 0.35), strict=True):
        torch.testing.assert_close(got, separate, rtol=0, atol=0)
        torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-6)
    for got, dense in zip(weighted, dense_mass(query, parts, 0.35, value_norms=norms), strict=True):
        torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-6)
    assert not torch.equal(torch.cat(mass, -1), torch.cat(weighted, -1))  # the weights change the sums


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_attention_mass_refuses_a_bad_block_size(bad):
    query, parts = random_partitions()
    with pytest.raises(ValueError, match="max_score_elements must be a positive int"):
        attention_mass(query, parts, 0.35, max_score_elements=bad)
