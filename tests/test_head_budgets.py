"""Per-head budgets (hf_structkv.compaction.budgets): allocation arithmetic against brute force, the solver against an
exhaustive search, persistence, the sensitivity measurement on tiny models, the shipped allocation, the CLI."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math
from pathlib import Path

import pytest
import torch

from hf_structkv.cli import main
from hf_structkv.compaction.budget_sensitivity import (
    allocate_shares,
    compute_head_budgets,
    influence_curve,
    quote_references,
)
from hf_structkv.compaction.budgets import CAP_FRACTION, HeadBudgets, default_head_budgets
from hf_structkv.models import tiny_byte_tokenizer, tiny_model
from hf_structkv.persistence import STRUCTURE_FIELDS, model_fingerprint

TEXT = (
    "Ada Lovelace wrote the first published program in 1843. She worked with Charles Babbage on the Analytical "
    "Engine, a mechanical computer that was never finished. "
)
QUESTIONS = ("Who wrote the first program?", "When?")


# ---------------------------------------------------------------------------------------------------- helpers
def tiny(arch: str = "qwen2", **overrides):
    return tiny_model(arch, vocab_size=300, **overrides)


def budgets_of(shares: list[float], heads_per_layer: int = 2) -> HeadBudgets:
    """Budgets over ``len(shares) / heads_per_layer`` global layers of a fake fingerprint."""
    layers = len(shares) // heads_per_layer
    fingerprint = model_fingerprint(tiny(num_hidden_layers=layers))
    weights = {layer: shares[layer * heads_per_layer : (layer + 1) * heads_per_layer] for layer in range(layers)}
    return HeadBudgets(weights, fingerprint)


def flat(counts: dict[int, list[int]]) -> list[int]:
    return [n for layer in sorted(counts) for n in counts[layer]]


def iterative_redistribution(weights: list[float], mean_fraction: float, cap: float) -> list[float]:
    """The literal rule: fractions proportional to the weights; cap every head above ``cap``, share the excess among
    the uncapped heads in proportion to their weights; repeat until no head is above the cap."""
    total, capped = mean_fraction * len(weights), set()
    while True:
        free = [i for i in range(len(weights)) if i not in capped]
        scale = (total - cap * len(capped)) / sum(weights[i] for i in free)
        over = {i for i in free if weights[i] * scale > cap}
        if not over:
            return [cap if i in capped else weights[i] * scale for i in range(len(weights))]
        capped |= over


def bisection_fill(weights: list[float], total: float, lower: float, upper: float) -> list[float]:
    """``clip(c w, lower, upper)`` summing to ``total``, with ``c`` found by bisection."""
    lo, hi = 0.0, 1e12
    for _ in range(400):
        mid = (lo + hi) / 2
        if sum(min(upper, max(lower, mid * w)) for w in weights) < total:
            lo = mid
        else:
            hi = mid
    return [min(upper, max(lower, hi * w)) for w in weights]


# ---------------------------------------------------------------------------------------------------- token_budgets
@pytest.mark.parametrize("ratio, length", [(5.0, 1000), (10, 937), (20.0, 3387), (50.0, 4096), (100.0, 777), (7.3, 61)])
def test_token_budgets_total_bounds_and_mean_fraction(ratio, length):
    shares = torch.rand(12, generator=torch.Generator().manual_seed(int(ratio * 10) + length)).tolist()
    counts = flat(budgets_of(shares).token_budgets(ratio, length))
    assert sum(counts) == round(12 * length / ratio)
    assert abs(sum(counts) / (12 * length) - 1 / ratio) <= 0.5 / (12 * length)
    assert min(counts) >= 1 and max(counts) <= math.floor(CAP_FRACTION * length)


@pytest.mark.parametrize("seed", range(5))
def test_cap_and_proportional_redistribution_match_the_iterative_rule(seed):
    gen = torch.Generator().manual_seed(seed)
    shares = (torch.rand(8, generator=gen) ** 4).tolist()  # skewed: several heads hit the cap
    shares[0] = 10.0
    length, ratio = 1_000_000, 2.5
    counts = flat(budgets_of(shares).token_budgets(ratio, length))
    expected = iterative_redistribution(shares, 1 / ratio, CAP_FRACTION)
    assert sum(f == CAP_FRACTION for f in expected) >= 1
    assert counts == pytest.approx([f * length for f in expected], abs=1.0)


@pytest.mark.parametrize("seed", range(6))
def test_integer_budgets_are_the_closest_allocation_by_brute_force(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    shares = (torch.rand(4, generator=gen) ** 3).tolist()
    shares[seed % 4] = 0.0  # a zero share still keeps one entry
    length = int(torch.randint(4, 13, (1,), generator=gen))
    cap = math.floor(CAP_FRACTION * length)
    total = int(torch.randint(4, 4 * cap + 1, (1,), generator=gen))
    ratio = 4 * length / total
    counts = flat(budgets_of(shares).token_budgets(ratio, length))
    target = bisection_fill(shares, total, 1.0, float(cap))
    candidates = [c for c in itertools.product(range(1, cap + 1), repeat=4) if sum(c) == total]

    def distance(c):
        return sum((a - b) ** 2 for a, b in zip(c, target))

    best = min(distance(c) for c in candidates)
    assert sum(counts) == total and distance(counts) == pytest.approx(best, abs=1e-9)


def test_zero_shares_keep_one_entry_and_uniform_is_even():
    assert flat(budgets_of([1.0, 0.0, 0.0, 0.0]).token_budgets(10.0, 100)) == [37, 1, 1, 1]
    # the only positive head is capped at 0.75 * 100: the rest is split evenly among the zero-share heads
    assert flat(budgets_of([1.0, 0.0, 0.0, 0.0]).token_budgets(4.0, 100)) == [75, 9, 8, 8]
    even = HeadBudgets.uniform(tiny()).token_budgets(10.0, 1000)
    assert even == {0: [100, 100], 1: [100, 100]}
    uneven = flat(HeadBudgets.uniform(tiny()).token_budgets(3.0, 100))
    assert sum(uneven) == 133 and max(uneven) - min(uneven) <= 1


@pytest.mark.parametrize(
    "ratio, length, message",
    [
        (0.0, 100, "ratio must be a finite number > 0"),
        (math.nan, 100, "ratio must be a finite number > 0"),
        (True, 100, "ratio must be a finite number > 0"),
        ("10", 100, "ratio must be a finite number > 0"),
        (10.0, 0, r"length must be an integer in \[1, 1099511627776\] \(context tokens\), got 0"),
        (200.0, 100, r"each head keeps at least one: use ratio <= 100"),
        (1.0, 100, r"above the cap of 75 .* use ratio >= 1.333"),
        (1.0, 1, r"above the cap of 0 .* a 1-token context cannot be compacted"),
    ],
)
def test_token_budgets_rejects_bad_input(ratio, length, message):
    with pytest.raises(ValueError, match=message):
        HeadBudgets.uniform(tiny()).token_budgets(ratio, length)
    with pytest.raises(
        TypeError, match=r"length must be an integer in \[1, 1099511627776\] \(context tokens\), got 10.5"
    ):
        HeadBudgets.uniform(tiny()).token_budgets(10.0, 10.5)


# ---------------------------------------------------------------------------------------------------- HeadBudgets
def test_shares_are_normalised_and_validated():
    budgets = budgets_of([2.0, 2.0, 4.0, 0.0])
    assert budgets.weights == {0: [0.25, 0.25], 1: [0.5, 0.0]} and budgets.n_heads == 4
    fingerprint = budgets.fingerprint
    cases = [
        ({0: [1.0, 1.0]}, "one entry per global layer of the model, \\[0, 1\\]"),
        ({0: [1.0, 1.0], 1: [1.0]}, r"weights\[1\] must list 2 finite shares"),
        ({0: [1.0, -1.0], 1: [1.0, 1.0]}, r"weights\[0\] must list 2 finite shares >= 0"),
        ({0: [1.0, math.nan], 1: [1.0, 1.0]}, r"weights\[0\] must list 2 finite shares"),
        ({0: [0.0, 0.0], 1: [0.0, 0.0]}, "weights are all zero"),
    ]
    for weights, message in cases:
        with pytest.raises(ValueError, match=message):
            HeadBudgets(weights, fingerprint)
    with pytest.raises(ValueError, match=r"fingerprint lacks the fields \[.num_hidden_layers.,"):
        HeadBudgets({0: [1.0, 1.0]}, {"model_type": "llama"})


def test_sliding_layers_get_no_budget():
    model = tiny("gemma3")  # layers 1 and 3 are global
    assert sorted(HeadBudgets.uniform(model).weights) == [1, 3]


# ---------------------------------------------------------------------------------------------------- persistence
@pytest.fixture
def saved(tmp_path):
    model = tiny()
    budgets = budgets_of([0.1, 0.2, 0.3, 0.4])
    budgets = HeadBudgets(budgets.weights, budgets.fingerprint, {"kind": "test", "seconds": 1.5})
    folder = tmp_path / "budgets"
    budgets.save_pretrained(folder)
    return model, budgets, folder


def test_save_load_round_trip(saved):
    model, budgets, folder = saved
    assert {p.name for p in folder.iterdir()} == {"head_budgets.json", "README.md"}
    for source in (folder, folder / "head_budgets.json", str(folder)):
        loaded = HeadBudgets.from_pretrained(source, model=model)
        assert loaded == budgets
        assert loaded.token_budgets(10.0, 500) == budgets.token_budgets(10.0, 500)
    card = (folder / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: hf_structkv\ntags:\n") and "HeadBudgets.from_pretrained(" in card


def edit_config(folder: Path, change) -> None:
    config = json.loads((folder / "head_budgets.json").read_text())
    change(config)
    (folder / "head_budgets.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c.update(format="hf_structkv_cache"), "is not a head-budget file"),
        (lambda c: c.update(format_version=2), "unknown format_version 2"),
        (lambda c: c.update(cap_fraction=0.5), "cap_fraction .* must be 0.75"),
        (lambda c: c.update(weights={"first": [1, 1]}), "must map global layer indices"),
        (lambda c: c["weights"].pop("1"), "one entry per global layer"),
        (lambda c: c["weights"].update({"0": [1.0, "x"]}), r"weights\[0\] must list 2 finite shares"),
        (lambda c: c["fingerprint"].pop("head_dim"), r"fingerprint lacks the fields \['head_dim'\]"),
        (lambda c: c.update(provenance=[1]), "provenance in .* must be a JSON object"),
        # issue 34: sizes bounded before anything is allocated, wrong JSON types named, no silent override
        (lambda c: c["fingerprint"].update(num_hidden_layers=10**8), r"num_hidden_layers in .* \[1, 1024\]"),
        (lambda c: c["fingerprint"].update(num_key_value_heads=[2]), r"num_key_value_heads in .* got \[2\]"),
        (lambda c: c["fingerprint"].update(layer_types="x"), "layer_types in .* one type name per layer"),
        (lambda c: c["fingerprint"].update(layer_types=[]), "layer_types in .* one type name per layer"),
        (lambda c: c.update(fingerprint=[]), "fingerprint must be a JSON object"),
        (lambda c: c["weights"].update({"00": [5.0, 5.0]}), r"plain decimals .*'00'"),
        (lambda c: c["weights"].update({"0": [1e308, 1e308]}), "weights sum beyond the float range"),
        (lambda c: c.update(format_version=True), "unknown format_version True"),
        (lambda c: c.update(format_version=1.0), "unknown format_version 1.0"),
        (lambda c: c.update(cap_fraction=[0.75]), r"cap_fraction .* must be 0.75, got \[0.75\]"),
    ],
)
def test_load_rejects_invalid_files(saved, change, message):
    _, _, folder = saved
    edit_config(folder, change)
    with pytest.raises(ValueError, match=message):
        HeadBudgets.load(folder)


def test_load_errors_name_the_problem(saved, tmp_path):
    _, _, folder = saved
    with pytest.raises(ValueError, match="head-budget allocation was built for another model: num_hidden_layers"):
        HeadBudgets.load(folder, model=tiny(num_hidden_layers=3))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="head_budgets.json is missing"):
        HeadBudgets.load(tmp_path / "empty")
    (folder / "head_budgets.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        HeadBudgets.load(folder)


def test_load_from_repo_id_downloads_only_the_budget_files(saved, tmp_path, monkeypatch, fake_hub):
    _, budgets, folder = saved
    calls = fake_hub(served=folder)
    monkeypatch.chdir(tmp_path)
    assert HeadBudgets.from_pretrained("someone/budgets", revision="v1", token="hf_test") == budgets
    [(repo_id, kwargs)] = calls["downloads"]
    assert repo_id == "someone/budgets" and kwargs["revision"] == "v1" and kwargs["token"] == "hf_test"
    # head_budgets.json, or the config.json of a repository pushed before the rename, and the card
    assert set(kwargs["allow_patterns"]) == {"head_budgets.json", "config.json", "README.md"}


def test_push_to_hub_uploads_the_config_and_card(saved, fake_hub):
    _, budgets, _ = saved
    calls = fake_hub(load=HeadBudgets.from_pretrained)
    url = budgets.push_to_hub("someone/budgets", private=True, token="hf_test", revision="v1", commit_message="m1")
    assert url == "https://huggingface.co/someone/budgets/commit/abc123"
    assert calls["create_repo"] == ("someone/budgets", {"private": True, "exist_ok": True})
    assert calls["create_branch"] == ("someone/budgets", {"branch": "v1", "exist_ok": True})
    assert calls["files"] == {"head_budgets.json", "README.md"} and calls["loaded"] == budgets
    assert calls["upload_folder"]["commit_message"] == "m1"
    assert 'HeadBudgets.from_pretrained("someone/budgets", model=model)' in calls["readme"]


# ---------------------------------------------------------------------------------------------------- the solver
def test_influence_curve_envelope_and_hull():
    # noise (a larger fraction hurting more) is raised away; the hull drops the non-convex knot at 0.1
    assert influence_curve([0.0, 0.02, 0.1], [2.0, 0.5, 0.6]) == [(0.0, 2.0), (0.02, 0.6), (1.0, 0.0)]
    assert influence_curve([0.0, 0.5], [-1.0, -2.0]) == [(0.0, 0.0), (1.0, 0.0)]
    # without a measurement at 0, the first segment is extended down to r = 0
    assert influence_curve([0.25, 0.5], [3.0, 1.0]) == [(0.0, 5.0), (0.25, 3.0), (0.5, 1.0), (1.0, 0.0)]


def predicted_loss(curves, shares, ratios, cap=CAP_FRACTION):
    """J(p) with the curves interpolated through their knots (convex, non-increasing inputs)."""
    xs = [0.0, 0.1, 0.3, 1.0]
    total = 0.0
    for curve, share in zip(curves, shares):
        for ratio in ratios:
            r = min(cap, len(curves) * share / ratio)
            k = max(i for i in range(3) if xs[i] <= r)
            total += curve[k] + (curve[k + 1] - curve[k]) * (r - xs[k]) / (xs[k + 1] - xs[k])
    return total


@pytest.mark.parametrize("seed, floor", [(0, 0.0), (1, 0.0), (2, 0.3), (3, 0.6)])
def test_greedy_shares_minimise_the_predicted_loss_by_exhaustive_search(seed, floor):
    gen = torch.Generator().manual_seed(seed)
    curves = []
    for _ in range(3):  # convex, non-increasing on the knots 0, 0.1, 0.3, 1 (ending at 0)
        slopes = torch.sort(torch.rand(3, generator=gen) * 10, descending=True).values  # decreasing steepness
        drops = slopes * torch.tensor([0.1, 0.2, 0.7])
        curves.append(torch.cat([drops.flip(0).cumsum(0).flip(0), torch.zeros(1)]).tolist())
    fractions, ratios, steps = [0.0, 0.1, 0.3], [2.0, 5.0, 10.0], 20
    increases = torch.tensor([c[:3] for c in curves])
    shares = allocate_shares(fractions, increases, ratios, steps=steps, floor=floor).tolist()
    grid = [(a, b, steps - a - b) for a in range(steps + 1) for b in range(steps + 1 - a)]
    best = min(predicted_loss(curves, [floor / 3 + n * (1 - floor) / steps for n in p], ratios) for p in grid)
    assert sum(shares) == pytest.approx(1.0) and min(shares) >= floor / 3 - 1e-15
    assert predicted_loss(curves, shares, ratios) == pytest.approx(best, abs=1e-12)


def test_a_head_that_hurts_more_gets_more_and_flat_curves_are_uniform():
    increases = torch.tensor([[1.0, 0.3, 0.1], [3.0, 0.9, 0.3], [0.0, 0.0, 0.0]])
    for floor in (0.0, 0.125):
        shares = allocate_shares([0.0, 0.02, 0.1], increases, floor=floor).tolist()
        assert shares[1] > shares[0] > shares[2] == pytest.approx(floor / 3)
    assert allocate_shares([0.0, 0.1], torch.zeros(4, 2)).tolist() == [0.25] * 4
    assert allocate_shares([0.0, 0.1], increases[:, :2], floor=1.0).tolist() == pytest.approx([1 / 3] * 3)
    for kwargs, message in [
        (dict(increases=torch.zeros(4, 3)), r"increases must be a finite \[heads, 2\]"),
        (dict(steps=0), "steps must be an integer >= 1"),
        (dict(target_ratios=[0.0]), "target_ratios must be finite numbers > 0"),
        (dict(floor=1.5), r"floor must be in \[0, 1\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            allocate_shares([0.0, 0.1], **{"increases": torch.zeros(4, 2), **kwargs})


# ---------------------------------------------------------------------------------------------------- measurement
@pytest.fixture(scope="module")
def tokenizer():
    return tiny_byte_tokenizer()


def measure(model, tokenizer, **kwargs):
    settings = dict(questions=QUESTIONS, fractions=(0.0, 0.1), method="key_norm", max_answer_tokens=6, progress=False)
    return compute_head_budgets(model, tokenizer, [TEXT], **{**settings, **kwargs})


def test_compute_shapes_provenance_and_determinism(tokenizer):
    model = tiny()
    budgets = measure(model, tokenizer)
    assert sorted(budgets.weights) == [0, 1] and all(len(s) == 2 for s in budgets.weights.values())
    assert sum(sum(s) for s in budgets.weights.values()) == pytest.approx(1.0)
    provenance = budgets.provenance
    assert provenance["kind"] == "sensitivity" and provenance["fractions"] == [0.0, 0.1]
    assert provenance["calibration"] == "none (query-free)" and provenance["seconds"] >= 0
    assert {k: [len(row) for row in v] for k, v in provenance["nll_increase"].items()} == {"0": [2, 2], "1": [2, 2]}
    [text] = provenance["texts"]
    assert text["tokens"] > 150 and len(text["answer_tokens"]) == 2
    budgets.check_model(model)
    again = measure(model, tokenizer)
    assert again.weights == budgets.weights and again.provenance["nll_increase"] == provenance["nll_increase"]


def test_quote_references_copy_the_rest_of_a_sentence_verbatim():
    text = TEXT + "Short one. It had   a store, a mill and\na card reader for programs! Why? "
    pairs = quote_references(text, 10, seed=0, prefix_words=3)
    prefixes = [q.split('begins "')[1].removesuffix('".') for q, _ in pairs]
    assert prefixes == ["Ada Lovelace wrote", "She worked with", "It had a"]  # every eligible one, in text order
    assert [a for _, a in pairs][2] == "store, a mill and\na card reader for programs!"  # white space as written
    for prefix, (_, answer) in zip(prefixes, pairs):
        assert " ".join(f"{prefix} {answer}".split()) in " ".join(text.split())
    one = quote_references(text, 1, seed=5, prefix_words=3)
    assert one == quote_references(text, 1, seed=5, prefix_words=3) and one[0] in pairs
    assert {quote_references(text, 1, seed=k, prefix_words=3)[0] for k in range(20)} == set(pairs)  # seeded draws
    assert quote_references(text, 0) == [] and quote_references("Too short.", 3) == []
    for kwargs, message in [(dict(count=-1), "count must be an integer >= 0"), (dict(prefix_words=0), "prefix_words")]:
        with pytest.raises(ValueError, match=message):
            quote_references(text, **{"count": 1, **kwargs})


def test_quotes_add_teacher_forced_lookups_to_the_reference_answers(tokenizer):
    model = tiny()
    plain, quoted = measure(model, tokenizer), measure(model, tokenizer, quotes=2, max_answer_tokens=40)
    [text] = quoted.provenance["texts"]
    assert quoted.provenance["quotes_per_text"] == 2 and text["quotes"] == [q for q, _ in quote_references(TEXT, 2)]
    rests = [tokenizer(a, add_special_tokens=False).input_ids for _, a in quote_references(TEXT, 2)]
    assert text["answer_tokens"][2:] == [min(40, len(r)) for r in rests] and len(text["answers"]) == 2
    assert quoted.provenance["nll_increase"] != plain.provenance["nll_increase"]
    with pytest.raises(ValueError, match="quotes must be an integer >= 0"):
        measure(model, tokenizer, quotes=-1)


def test_a_head_whose_compression_changes_nothing_gets_no_budget(tokenizer):
    """KV head 1 of layer 0 has zero values (v_proj rows and bias zeroed): removing it changes no output, so its
    NLL increase is exactly 0 and it gets the least share (the floor); heads that matter get more."""
    model = tiny()
    head_dim = model.config.head_dim
    v_proj = model.model.layers[0].self_attn.v_proj
    with torch.no_grad():
        v_proj.weight[head_dim : 2 * head_dim] = 0
        v_proj.bias[head_dim : 2 * head_dim] = 0
    budgets = measure(model, tokenizer)
    assert budgets.provenance["nll_increase"]["0"][1] == [0.0, 0.0]
    assert budgets.provenance["nll_increase"]["0"][0][0] != 0.0
    shares = [share for layer in budgets.weights.values() for share in layer]
    assert budgets.weights[0][1] == min(shares) < budgets.weights[0][0]


def test_calibrated_method_on_a_model_with_sliding_layers(tokenizer):
    model = tiny("gemma3")
    budgets = measure(model, tokenizer, method="kv_surgeon", fractions=(0.05, 0.3), query_cap=256)
    assert sorted(budgets.weights) == [1, 3] and budgets.provenance["calibration"] == "repeat-pass queries"
    assert all(math.isfinite(x) for row in budgets.provenance["nll_increase"]["3"] for x in row)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(texts="one text"), "texts must be a non-empty sequence"),
        (dict(questions=[]), "questions must be a non-empty sequence"),
        (dict(fractions=(0.1, 0.05)), "fractions must be strictly increasing numbers in \\[0, 1\\)"),
        (dict(fractions=(0.0, 1.0)), "fractions must be strictly increasing"),
        (dict(method="best"), "method must be one of"),
        (dict(method="kv_surgeon", pool_factor=0.5), "pool_factor must be >= 1"),
        (dict(max_answer_tokens=0), "max_answer_tokens must be an integer >= 1"),
        (dict(text_names=["a", "b"]), "text_names must name each of the 1 texts"),
    ],
)
def test_compute_rejects_bad_arguments(tokenizer, kwargs, message):
    texts = kwargs.pop("texts", [TEXT])
    with pytest.raises(ValueError, match=message):
        compute_head_budgets(tiny(), tokenizer, texts, **{"questions": QUESTIONS, **kwargs})


def test_compute_rejects_a_bool_query_cap(tokenizer):
    with pytest.raises(TypeError, match="query_cap must be an integer >= 1, got True"):
        compute_head_budgets(tiny(), tokenizer, [TEXT], questions=QUESTIONS, query_cap=True)


# ---------------------------------------------------------------------------------------------------- shipped file, CLI
def test_shipped_allocation_loads_without_a_model():
    budgets = default_head_budgets()
    assert budgets.provenance["kind"] == "sensitivity" and budgets.fingerprint["model_type"] == "qwen2"
    counts = flat(budgets.token_budgets(10.0, 1000))
    assert len(counts) == 48 and sum(counts) == 4800


@pytest.mark.slow
def test_shipped_allocation_matches_the_embedded_model(default_model):
    model, tokenizer = default_model
    budgets = default_head_budgets(model=model)  # checks the model-structure fields
    current = model_fingerprint(model, tokenizer)
    assert {k: budgets.fingerprint[k] for k in STRUCTURE_FIELDS} == {k: current[k] for k in STRUCTURE_FIELDS}
    assert budgets.fingerprint["tokenizer_hash"] == current["tokenizer_hash"]


@pytest.mark.slow
def test_compact_uses_the_shipped_allocation_by_default_on_the_embedded_model(default_model):
    from hf_structkv import compact

    model, tokenizer = default_model
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 20, return_tensors="pt").input_ids
    cache = compact(model, tokenizer, ids, ratio=10, method="streaming_llm", progress=False)
    expected = default_head_budgets(model).token_budgets(10.0, ids.shape[1])
    assert cache.metadata["budgets"]["source"] == "shipped" and cache.metadata["budgets"]["requested"] == "auto"
    assert [cache.head_lengths()[i] for i in sorted(expected)] == [
        [max(1, c) for c in expected[i]] for i in sorted(expected)
    ]
    uniform = compact(model, tokenizer, ids, ratio=10, method="streaming_llm", budgets="uniform", progress=False)
    assert uniform.metadata["budgets"]["source"] == "uniform"
    assert {n for layer in uniform.head_lengths() if layer for n in layer} == {ids.shape[1] // 10}


def test_cli_head_budgets_on_a_tiny_model(tmp_path, tokenizer):
    model_dir, out = tmp_path / "tiny", tmp_path / "budgets"
    tiny().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    text_file = tmp_path / "doc.txt"
    text_file.write_text(TEXT, encoding="utf-8")
    argv = ["head-budgets", "--model", str(model_dir), "--text-file", str(text_file), "--fractions", "0,0.1"]
    argv += ["--method", "key_norm", "--max-answer-tokens", "4", "--quotes", "1", "--out", str(out)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    assert "head budgets of 4 KV heads from 1 text(s)" in printed.getvalue()
    budgets = HeadBudgets.load(out, model=tiny())
    assert budgets.provenance["fractions"] == [0.0, 0.1] and budgets.provenance["texts"][0]["name"] == str(text_file)
    assert budgets.provenance["quotes_per_text"] == 1 and len(budgets.provenance["texts"][0]["quotes"]) == 1


def test_token_budgets_refuse_a_length_past_the_exact_float_range():
    # found by the API fuzzer in CI: at 2^51 tokens the float64 water fill no longer sums exactly; such a length is
    # refused naming it (2^40 is accepted and sums exactly)
    budgets = budgets_of([0.1, 0.2, 0.3, 0.4])
    with pytest.raises(ValueError, match="length"):
        budgets.token_budgets(2.0, 2**51)
    counts = flat(budgets.token_budgets(2.0, 2**40))
    assert sum(counts) == round(4 * 2**40 / 2.0)
