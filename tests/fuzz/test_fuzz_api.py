"""Hostile API arguments (issue 34): each call returns a correct result or raises a ValueError / TypeError naming the
argument, never another exception, never NaN served. Hypothesis draws the arguments; the fixed catalogue of
`hostile_api` runs whole; the regressions are the defects the fuzzing found."""

from __future__ import annotations

import math

import pytest
import torch
from hostile_api import (
    api_cases,
    init_fields,
    judge_built_cache,
    judge_generation_inputs,
    judge_head,
    judge_quantized,
    judge_token_budgets,
    round_trip,
)
from hostile_outcomes import FUZZ, GOOD_OUTCOMES, Case, assert_good, run_case
from hypothesis import given
from hypothesis import strategies as st
from test_cli import ChatCharTokenizer
from test_hub import context_ids
from transformers import DynamicCache

from hf_structkv import CompactedCache
from hf_structkv.compaction import compact, compact_head
from hf_structkv.compaction.budgets import HeadBudgets, default_head_budgets
from hf_structkv.generation import generation_inputs
from hf_structkv.policy.table import PolicyTable, illustrative_policy
from hf_structkv.quant.int4 import quantize_int4
from hf_structkv.validation import is_number

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

FLOATS = st.floats(allow_nan=True, allow_infinity=True)
NUMBERS = st.one_of(
    FLOATS, st.integers(min_value=-(2**80), max_value=2**1400), st.booleans(), st.none(), st.text(max_size=3)
)


@FUZZ
@given(
    values=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1, max_size=33),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]),
    rows=st.integers(1, 3),
)
def test_quantize_int4_is_finite_within_its_bound_or_refuses(values, dtype, rows):
    x = torch.tensor(values, dtype=torch.float64).to(dtype).repeat(rows, 1)
    case = Case(
        "api", "quantize_int4", f"{values} {dtype}", lambda: judge_quantized(quantize_int4(x), {"x": x}), ("x",)
    )
    assert_good(case)


@FUZZ
@given(
    budget=st.one_of(st.integers(-3, 40), NUMBERS),
    scaling=st.one_of(st.none(), FLOATS.filter(lambda s: not is_number(s) or abs(s) < 1e6)),
    scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e3]),
    method=st.sampled_from(["kv_surgeon", "am_omp", "h2o", "key_norm", "random", "nope"]),
)
def test_compact_head_keeps_its_budget_with_finite_numbers_or_refuses(budget, scaling, scale, method):
    gen = torch.Generator().manual_seed(3)
    kwargs = {"keys": scale * torch.randn(24, 16, generator=gen), "values": torch.randn(24, 16, generator=gen)}
    kwargs |= {"queries": scale * torch.randn(40, 16, generator=gen), "budget": budget}

    def run():
        return judge_head(compact_head(**kwargs, method=method, scaling=scaling), kwargs)

    assert_good(
        Case("api", "compact_head", f"{budget} {scaling} {scale} {method}", run, ("budget", "scaling", "method"))
    )


@FUZZ
@given(
    rows=st.integers(0, 3),
    length=st.integers(0, 4),
    dims=st.sampled_from([1, 2, 3]),
    dtype=st.sampled_from([torch.long, torch.int32, torch.float32, torch.bool]),
    mask=st.sampled_from(["none", "same", "shorter", "float", "list"]),
    used=st.booleans(),
)
def test_generation_inputs_places_the_question_after_the_context_or_refuses(
    arts, rows, length, dims, dtype, mask, used
):
    ids = torch.arange(rows * length).reshape(rows, length).to(dtype)
    ids = {1: ids.flatten(), 2: ids, 3: ids[None]}[dims]
    masks = {"none": None, "same": torch.ones_like(ids), "shorter": torch.ones(rows, max(length - 1, 0))}
    masks |= {"float": torch.ones(ids.shape), "list": ids.tolist()}
    cache = arts.cache.copy()
    if used:
        with torch.no_grad():
            arts.model(torch.tensor([[5, 6]]), cache=cache, use_cache=True)

    def run():
        kwargs = {"cache": cache, "question_ids": ids, "attention_mask": masks[mask]}
        return judge_generation_inputs(generation_inputs(**kwargs), kwargs)

    words = ("question_ids", "attention_mask", "cache")
    assert_good(Case("api", "generation_inputs", f"{tuple(ids.shape)} {dtype} {mask} {used}", run, words))


@FUZZ
@given(
    bias=st.floats(allow_nan=True, allow_infinity=True, width=32),
    value=st.floats(allow_nan=True, allow_infinity=True, width=32),
    positions=st.lists(st.integers(-2, 26), min_size=0, max_size=6),
)
def test_from_selection_builds_a_servable_saveable_cache_or_refuses(arts, tmp_path_factory, bias, value, positions):
    cache = DynamicCache(config=arts.model.config)
    with torch.no_grad():
        arts.model(context_ids(), cache=cache)
    index = torch.tensor(positions, dtype=torch.long)
    n = index.numel()
    indices = [[index, torch.arange(3)]] * 2
    biases = [[torch.full((n,), bias), torch.zeros(3)]] * 2
    values = [[torch.full((n, 16), value), torch.zeros(3, 16)]] * 2
    work = tmp_path_factory.mktemp("selection")

    def run():
        built = CompactedCache.from_selection(cache, indices, biases, values, metadata=dict(arts.cache.metadata))
        return judge_built_cache(arts, work, built)

    words = ("indices", "biases", "values")
    assert_good(Case("api", "CompactedCache.from_selection", f"{positions} {bias} {value}", run, words))


@FUZZ
@given(ratio=NUMBERS, length=st.one_of(st.integers(-2, 2**70), NUMBERS))
def test_token_budgets_sum_to_the_promised_total_or_refuse(ratio, length):
    budgets = HeadBudgets({0: [1.0, 3.0], 1: [0.0, 2.0]}, default_fingerprint_of_two_layers())

    def run():
        return judge_token_budgets(budgets.token_budgets(ratio, length), {"ratio": ratio, "length": length})

    assert_good(Case("api", "HeadBudgets.token_budgets", f"{ratio!r} {length!r}", run, ("ratio", "length")))


def default_fingerprint_of_two_layers() -> dict:
    fingerprint = dict(default_head_budgets().fingerprint)
    return fingerprint | {"num_hidden_layers": 2, "layer_types": None}


@FUZZ
@given(
    field=st.sampled_from(["budget", "reserve_pooled", "sink_tokens", "window", "reserve_by_state", "thresholds"]),
    value=st.one_of(NUMBERS, st.dictionaries(st.sampled_from(["in_string", "x", "tau"]), NUMBERS, max_size=2)),
)
def test_a_policy_table_field_round_trips_or_is_refused_naming_it(tmp_path_factory, field, value):
    table = illustrative_policy()
    kwargs = init_fields(table)
    judge = round_trip(tmp_path_factory.mktemp("table"))
    words = (field, "bits", "state")

    def run():
        return judge(PolicyTable(**{**kwargs, field: value}), kwargs)

    assert_good(Case("api", "PolicyTable", f"{field}={value!r}", run, words))


def test_the_catalogue_of_api_arguments_has_no_bad_outcome(arts, tmp_path):
    results = [run_case(case) for case in api_cases(arts, tmp_path)]
    bad = {(r.case.target, r.case.name): f"{r.outcome}: {r.detail}" for r in results if r.outcome not in GOOD_OUTCOMES}
    assert not bad, "\n".join(f"{key}: {detail}" for key, detail in bad.items())  # 1e30 keys/queries/scaling too
    assert len(results) > 300


# ---------------------------------------------------------------------------------------------------- regressions
def test_from_selection_refuses_biases_and_values_a_load_would_refuse(arts):
    """Biases of 1e30 built a cache that could not be saved; values of 3e38 served NaN."""
    cache = DynamicCache(config=arts.model.config)
    with torch.no_grad():
        arts.model(context_ids(), cache=cache)
    indices = [[torch.arange(4), torch.arange(3)]] * 2
    with pytest.raises(ValueError, match=r"biases\[0\]\[0\] holds \|x\| = 1e\+30, above the 88\.7"):
        CompactedCache.from_selection(cache, indices, biases=[[torch.full((4,), 1e30), torch.zeros(3)]] * 2)
    with pytest.raises(ValueError, match=r"values\[0\]\[1\] holds \|x\| = 3e\+38"):
        CompactedCache.from_selection(cache, indices, values=[[torch.zeros(4, 16), torch.full((3, 16), 3e38)]] * 2)
    with pytest.raises(TypeError, match="indices must list one entry per layer"):
        CompactedCache.from_selection(cache, None)
    with pytest.raises(TypeError, match="metadata must be a dict"):
        CompactedCache.from_selection(cache, indices, metadata="x")


def test_generation_inputs_names_a_cache_or_mask_of_the_wrong_type(arts):
    with pytest.raises(TypeError, match="cache must be a transformers Cache"):
        generation_inputs(None, torch.tensor([[5]]))
    with pytest.raises(TypeError, match=r"attention_mask must be a tensor \[batch, length\] or None, got list"):
        generation_inputs(arts.cache.copy(), torch.tensor([[5]]), attention_mask=[[1]])


def test_compact_refuses_another_models_budgets_and_bad_ids_seeds_and_caps(arts):
    """Another model's HeadBudgets object compacted a smaller model with its first layers' counts (and recorded its
    provenance); float, negative or out-of-vocabulary ids, a text seed or a zero query cap raised from torch."""
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(4))
    base = {"model": arts.model, "tokenizer": ChatCharTokenizer(), "context": ids, "progress": False}
    cases = [
        ({"budgets": default_head_budgets()}, "budgets were computed for another model: .*model_type is 'qwen2'"),
        ({"context": ids.float()}, r"context must hold token ids: integers >= 0"),
        ({"context": -ids}, r"context must hold token ids: integers >= 0"),
        ({"context": ids + 1000}, r"context holds the token id \d+, beyond the model's 256 ids"),
        ({"seed": "x"}, r"seed must be an integer in \[0, "),
        ({"query_cap": 0}, r"query_cap must be an integer >= 1"),
        ({"heldout_fraction": "x"}, r"heldout_fraction must be in \[0, 1\)"),
        ({"ratio": 10**400}, "ratio must be a finite number >= 1"),
    ]
    for kwargs, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            compact(**{**base, **kwargs})


def test_is_number_is_false_for_integers_beyond_the_float_range():
    assert not is_number(10**400) and is_number(10**300) and not is_number(math.inf)
    with pytest.raises(ValueError, match="ratio must be a finite number > 0"):
        HeadBudgets.uniform(pytest.importorskip("test_hub").tiny_llama()).token_budgets(10**400, 100)


def test_an_unknown_lookup_key_names_entries():
    table = illustrative_policy()
    kwargs = init_fields(table)
    with pytest.raises(ValueError, match="unknown lookup key 'nope' .* a key of entries is"):
        PolicyTable(**{**kwargs, "entries": {"nope": next(iter(table.entries.values()))}})
