"""Issue 34: hostile edits of every saved format, served caches that cannot be corrupted after loading, and clear
local errors: each load either round-trips or raises a ValueError naming the field, never another exception, never
a silently wrong cache, never an allocation sized by an edited number."""

from __future__ import annotations

import copy
import json
import math
import re
import tracemalloc

import pytest
import torch
from test_hub import TOKENIZER, compacted_cache, context_ids, rewrite_config, rewrite_tensors, saved, tiny_llama
from transformers import DynamicCache

import hf_structkv
from hf_structkv import CompactedCache
from hf_structkv.cache.compacted_checks import BIAS_LIMIT, value_limit
from hf_structkv.compaction.budgets import HeadBudgets, default_head_budgets
from hf_structkv.models import tiny_model
from hf_structkv.persistence import model_fingerprint
from hf_structkv.policy.prefill import PrefillPolicy, illustrative_prefill_policy
from hf_structkv.policy.table import PolicyTable, illustrative_policy

__all__ = ["saved"]  # the fixture, shared with test_hub

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

ARTIFACTS = (CompactedCache, PolicyTable, PrefillPolicy, HeadBudgets)
JSON_FILES = {
    "table": (lambda: illustrative_policy().to_json_dict(), PolicyTable, "policy_table.json"),
    "prefill": (lambda: illustrative_prefill_policy().to_json_dict(), PrefillPolicy, "prefill_policy.json"),
    "budgets": (lambda: default_head_budgets().to_config(), HeadBudgets, "head_budgets.json"),
}


def json_paths(value, prefix=()):
    """Every key path of a parsed JSON value (lists: their first item)."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from json_paths(item, (*prefix, key))
    elif isinstance(value, list) and value:
        yield from json_paths(value[0], (*prefix, 0))


def set_path(record, path, value):
    for key in path[:-1]:
        record = record[key]
    record[path[-1]] = value


# ---------------------------------------------------------------------------------------------------- JSON files
@pytest.mark.parametrize("kind", sorted(JSON_FILES))
def test_every_json_field_of_the_wrong_type_loads_or_is_a_value_error(tmp_path, kind):
    build, cls, name = JSON_FILES[kind]
    base = json.loads(json.dumps(build()))
    outcomes = {"loads": 0, "refused": 0}
    for path in list(json_paths(base))[1:]:
        for value in (None, True, 1.5, [], {}, "x", [[]], 10**8, -1):
            record = copy.deepcopy(base)
            set_path(record, path, value)
            (tmp_path / name).write_text(json.dumps(record))
            try:
                cls.from_pretrained(tmp_path)
                outcomes["loads"] += 1
            except ValueError:
                outcomes["refused"] += 1
    assert outcomes["refused"] > 100  # and no other exception escaped


@pytest.mark.parametrize("kind", sorted(JSON_FILES))
def test_a_huge_layer_count_is_refused_before_anything_is_allocated(tmp_path, kind):
    build, cls, name = JSON_FILES[kind]
    record = build()
    record["fingerprint"]["num_hidden_layers"] = 10**8
    (tmp_path / name).write_text(json.dumps(record))
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"num_hidden_layers in .*must be an integer in \[1, 1024\]"):
            cls.from_pretrained(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20


@pytest.mark.parametrize("kind", sorted(JSON_FILES))
@pytest.mark.parametrize("version", [True, 1.0, "1"])
def test_format_version_must_be_the_integer_1(tmp_path, kind, version):
    build, cls, name = JSON_FILES[kind]
    (tmp_path / name).write_text(json.dumps({**build(), "format_version": version}))
    with pytest.raises(ValueError, match=f"unknown format_version {re.escape(repr(version))}"):
        cls.from_pretrained(tmp_path)


@pytest.mark.parametrize("kind", sorted(JSON_FILES))
def test_deep_nesting_repeated_keys_and_giant_integers_are_value_errors(tmp_path, kind):
    build, cls, name = JSON_FILES[kind]
    text = json.dumps(build())
    cases = {
        '{"calibration": ' + "[" * 100_000 + "]" * 100_000 + "}": "nests lists or objects too deeply",
        '{"x": ' + "[" * 100 + "]" * 100 + "}": "nests lists or objects more than 64 deep",
        text[:-1] + ', "format_version": 1}': r"repeats the keys \['format_version'\]",
        '{"x": ' + "9" * 5000 + "}": "is not valid JSON",
        "[1, 2]": "must hold a JSON object, got list",
    }
    for content, message in cases.items():
        (tmp_path / name).write_text(content)
        with pytest.raises(ValueError, match=message):
            cls.from_pretrained(tmp_path)


def test_a_weights_key_with_a_leading_zero_does_not_override_its_layer(tmp_path):
    config = default_head_budgets().to_config()
    config["weights"]["00"] = [5.0] * len(config["weights"]["0"])
    (tmp_path / "head_budgets.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"plain decimals \('0', '1', \.\.\., not '00'\)"):
        HeadBudgets.from_pretrained(tmp_path)


# ---------------------------------------------------------------------------------------------------- cache files
@pytest.mark.parametrize("length", [25, 1000, 10**6, 10**30])
def test_an_edited_original_length_is_refused(saved, length):
    _, _, folder = saved
    rewrite_config(folder, lambda c: c.update(original_length=length))
    with pytest.raises(ValueError, match=r"full_kv_nbytes in config.json is \d+ but the tensors and original_length"):
        CompactedCache.load(folder)


def test_an_edited_size_record_is_refused(saved):
    _, _, folder = saved
    rewrite_config(folder, lambda c: c.update(context_nbytes=c["context_nbytes"] + 4))
    with pytest.raises(ValueError, match="context_nbytes in config.json is"):
        CompactedCache.load(folder)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("layers.0.keys", 3e38, r"layers\.0\.keys holds \|x\| = 3e\+38, above the 9\.2\d+e\+18"),
        ("layers.1.values", -1e20, r"layers\.1\.values holds \|x\| = 1e\+20"),
        ("layers.0.bias", 89.0, r"layers\.0\.bias holds \|x\| = 89, above the 88\.72"),
    ],
)
def test_finite_values_the_model_cannot_serve_are_refused(saved, name, value, message):
    _, _, folder = saved

    def inject(tensors):
        tensors[name][0] = value

    rewrite_tensors(folder, inject)
    with pytest.raises(ValueError, match=message):
        CompactedCache.load(folder)


def test_the_magnitude_bound_is_where_float32_scores_overflow():
    """Closed form: a key and a query with every element at the bound score exactly FP32_MAX; 1% above, inf."""
    for head_dim in (16, 64, 128):
        bound = value_limit(head_dim)
        for factor, finite in ((0.99, True), (1.01, False)):
            q = torch.full((head_dim,), factor * bound, dtype=torch.float32)
            score = (q * head_dim**-0.25) @ (q * head_dim**-0.25)
            assert bool(torch.isfinite(score)) is finite, (head_dim, factor)
    assert math.isfinite(math.exp(BIAS_LIMIT * 0.999999)) and torch.tensor(BIAS_LIMIT + 0.01).exp().isinf()


def test_a_loaded_cache_owns_its_tensors(saved):
    """Rewriting or truncating cache.safetensors after loading changes nothing served (no memory map: no SIGBUS,
    no NaN past the check at load)."""
    model, cache, folder = saved
    loaded = CompactedCache.load(folder, model=model)
    path = folder / "cache.safetensors"
    size = path.stat().st_size
    header = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    with open(path, "r+b") as file:  # the same inode, rewritten in place: NaN everywhere
        file.seek(header)
        file.write(b"\xff" * (size - header))
    assert all(torch.equal(a, b) for a, b in zip(context_ids_of(cache), context_ids_of(loaded), strict=True))
    with open(path, "r+b") as file:
        file.truncate(16)
    ids = torch.cat([context_ids(), torch.tensor([[5, 6, 7]])], dim=1)
    outputs = [
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=c.copy(), max_new_tokens=3)
        for c in (cache, loaded)
    ]
    assert torch.equal(*outputs)


def context_ids_of(cache: CompactedCache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in layer.context_tensors()]


def test_a_mix_of_two_saves_is_refused_by_the_content_hash(tmp_path):
    model = tiny_llama()
    first, second = tmp_path / "first", tmp_path / "second"
    compacted_cache(model, quality={"mean_kl": 1.0}).save_pretrained(first)
    other = compacted_cache(model)
    other.layers[0].prefix_values = other.layers[0].prefix_values + 1  # same structure, other numbers
    other.save_pretrained(second)
    (first / "cache.safetensors").write_bytes((second / "cache.safetensors").read_bytes())
    with pytest.raises(ValueError, match="cache.safetensors is not the file config.json was saved with"):
        CompactedCache.load(first)


# ---------------------------------------------------------------------------------------------------- serving
def served(model, cache: CompactedCache):
    ids = torch.tensor([[5, 6, 7]])
    hf_structkv.enable(model)
    with torch.no_grad():
        return model(ids, past_key_values=cache.copy(), use_cache=True).logits


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (lambda: tiny_llama(num_hidden_layers=1), "num_hidden_layers is 2 in the cache's fingerprint but 1"),
        (lambda: tiny_llama(num_hidden_layers=3), "num_hidden_layers is 2 in the cache's fingerprint but 3"),
        (lambda: tiny_model("qwen3"), "model_type is 'llama' in the cache's fingerprint but 'qwen3'"),
        (lambda: tiny_llama(num_key_value_heads=4), "num_key_value_heads is 2 in the cache but 4"),
        (lambda: tiny_llama(head_dim=8), "head_dim is 16 in the cache but 8"),
        (
            lambda: tiny_llama(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
            r"rope_parameters is .*10000\.0.* but .*500000\.0",
        ),
    ],
    ids=["fewer-layers", "more-layers", "qwen3", "kv-heads", "head-dim", "rope"],
)
def test_a_cache_loaded_without_model_checks_the_model_serving_it(saved, other, message):
    _, _, folder = saved
    loaded = CompactedCache.load(folder)
    with pytest.raises(ValueError, match="this cache was built for another model: " + message):
        served(other(), loaded)


def test_a_cache_without_fingerprint_checks_the_structure_it_holds():
    cache = compacted_cache(tiny_llama())
    del cache.metadata["fingerprint"]
    with pytest.raises(ValueError, match="num_hidden_layers is 2 in the cache but 1 in the given model"):
        served(tiny_llama(num_hidden_layers=1), cache)
    assert torch.isfinite(served(tiny_llama(), cache)).all()  # its own model is served as before


def test_debug_mode_checks_served_outputs_for_non_finite_values(monkeypatch):
    model = tiny_llama()
    cache = compacted_cache(model)  # from_selection: not validated like a load
    cache.layers[0].prefix_keys = torch.full_like(cache.layers[0].prefix_keys, math.inf)  # past every check
    assert not torch.isfinite(served(model, cache)).all()  # what the debug mode is for
    monkeypatch.setenv("HF_STRUCTKV_DEBUG", "1")
    with pytest.raises(ValueError, match=r"attention output of layer 0 over the compacted cache holds NaN or inf"):
        served(model, cache)


def test_from_selection_needs_biases_and_values_for_every_layer_and_head():
    model = tiny_llama()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(context_ids(), cache=cache)
    indices = [[torch.arange(4), torch.arange(3)]] * 2
    one_layer = [[torch.zeros(4), torch.zeros(3)]]
    with pytest.raises(ValueError, match="biases has 1 layers, the cache has 2"):
        CompactedCache.from_selection(cache, indices, biases=one_layer)
    with pytest.raises(ValueError, match=r"biases\[0\] must list one tensor per KV head \(2\), got 1"):
        CompactedCache.from_selection(cache, indices, biases=[[torch.zeros(4)], one_layer[0]])


# ---------------------------------------------------------------------------------------------------- folders
def test_one_artifact_is_never_saved_over_another(tmp_path):
    model = tiny_llama()
    cache, budgets = compacted_cache(model, TOKENIZER), HeadBudgets.uniform(model)
    table = PolicyTable.all_high(model)
    cache_folder, table_folder, model_folder = tmp_path / "cache", tmp_path / "table", tmp_path / "model"
    cache.save_pretrained(cache_folder)
    table.save_pretrained(table_folder)
    model.config.save_pretrained(model_folder)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for artifact, folder, message in [
        (budgets, cache_folder, r"holds a saved CompactedCache \(cache\.safetensors\)"),
        (table, cache_folder, r"holds a saved CompactedCache"),
        (cache, table_folder, r"holds a saved PolicyTable \(policy_table\.json\)"),
        (illustrative_prefill_policy(), table_folder, r"holds a saved PolicyTable"),
        (cache, model_folder, r"config\.json is not a compacted cache's configuration"),
    ]:
        with pytest.raises(ValueError, match=message):
            artifact.save_pretrained(folder)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    cache.save_pretrained(cache_folder)  # saving an artifact over its own kind still works
    assert CompactedCache.load(cache_folder).head_lengths() == cache.head_lengths()


def test_a_save_removes_what_a_killed_save_left_and_a_refused_save_leaves_nothing(tmp_path):
    model = tiny_llama()
    folder = tmp_path / "cache"
    compacted_cache(model).save_pretrained(folder)
    stale = [folder / ".config.json.abc123.tmp", folder / ".cache.safetensors.x_y.tmp"]
    for path in stale:
        path.write_text("half a file")
    (folder / "notes.txt").write_text("mine")  # the user's own files stay
    compacted_cache(model).save_pretrained(folder)
    assert {p.name for p in folder.iterdir()} == {"config.json", "cache.safetensors", "README.md", "notes.txt"}
    refused = compacted_cache(model)
    del refused.metadata["fingerprint"]
    with pytest.raises(ValueError, match="no model fingerprint"):
        refused.save_pretrained(tmp_path / "new")
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize(
    "typo",
    [
        "base_llama/config.json",
        "base_llama/cache",
        "./nope",
        "../nope/cache",
        "/nonexistent/cache",
        "~/nope-hf-structkv-cache",
        "nope",
        "a/b/c",
        "cache.safetensors",
        "nope\\cache",
    ],
)
def test_a_local_typo_is_a_local_error_and_never_reaches_the_hub(tmp_path, monkeypatch, fake_hub, typo):
    calls = fake_hub(served=tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "base_llama").mkdir()
    (tmp_path / "base_llama" / "cache.safetensors").write_bytes(b"")
    for cls in ARTIFACTS:
        with pytest.raises(ValueError, match=re.escape(repr(typo)) + " is neither an existing folder nor a Hub"):
            cls.from_pretrained(typo)
    assert calls["downloads"] == []


def test_a_typo_names_what_exists_of_the_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "base_llama").mkdir()
    (tmp_path / "base_llama" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"base_llama exists and holds \['config.json'\]"):
        CompactedCache.from_pretrained("base_llama/cache")


def test_a_repository_that_cannot_be_fetched_is_a_value_error_naming_both_readings(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        ValueError, match=r"'nope/cache' is not a local folder and could not be downloaded from the Hub"
    ):
        CompactedCache.from_pretrained("nope/cache")


@pytest.mark.parametrize(("value", "error"), [(None, TypeError), (3, TypeError), ("", ValueError)])
def test_the_path_argument_is_checked(value, error):
    with pytest.raises(error, match="path_or_repo_id"):
        PolicyTable.from_pretrained(value)
    with pytest.raises(error, match="save_directory"):
        illustrative_policy().save_pretrained(value)


def test_layer_types_must_list_one_type_per_layer():
    fingerprint = model_fingerprint(tiny_llama())
    fingerprint["layer_types"] = ["full_attention"]  # one type for two layers
    with pytest.raises(ValueError, match="layer_types in the head budgets' fingerprint must be null or list one"):
        HeadBudgets({0: [1.0, 1.0], 1: [1.0, 1.0]}, fingerprint)
