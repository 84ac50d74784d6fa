"""Hostile edits of every saved format (issue 34): each loads and round-trips or is refused with a ValueError /
TypeError naming the field, never another exception, never NaN served, within bounded memory and time. Hypothesis
draws the edits (JSON values, types, nesting and sizes; safetensors header fields; raw bytes; stored numbers); the
fixed catalogue of `hostile_formats` runs whole; the regressions are the defects the fuzzing found."""

from __future__ import annotations

import json
import os

import pytest
from hostile_artifacts import (
    KINDS,
    edited,
    json_paths,
    judge_cache,
    judge_json_artifact,
    path_words,
    rehash,
    safetensors_parts,
    write_json,
    write_safetensors,
)
from hostile_formats import (
    HEAD_STORAGE_EDITS,
    INT4_TENSORS,
    KEY_GROUP_EDITS,
    TENSOR_NAMES,
    format_cases,
    int4_cases,
)
from hostile_outcomes import FUZZ, GOOD_OUTCOMES, Case, assert_good, run_case
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from hf_structkv import CompactedCache
from hf_structkv.compaction.budgets import HeadBudgets
from hf_structkv.policy.prefill import PrefillPolicy

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=16,
)


def value_at(record, path):
    for key in path:
        record = record[key]
    return record


def judge(arts, kind, folder, record=None):
    return judge_cache(arts, folder) if kind == "cache" else judge_json_artifact(kind, folder, record)


@pytest.mark.parametrize("kind", sorted(KINDS))
@FUZZ
@given(data=st.data())
def test_an_edited_json_field_loads_as_written_or_is_refused_naming_it(arts, fresh, kind, data):
    record, name = arts.record(kind), KINDS[kind][1]
    action = data.draw(st.sampled_from(["set", "remove", "add"]), label="action")
    if action == "add":  # a new key in the file's object or one of its nested objects
        objects = [()] + [p for p in json_paths(record) if isinstance(value_at(record, p), dict)]
        path = (*data.draw(st.sampled_from(objects), label="object"), data.draw(st.text(min_size=1, max_size=8)))
    else:
        path = data.draw(st.sampled_from(json_paths(record)), label="path")
    value = None if action == "remove" else data.draw(JSON_VALUES, label="value")
    mutated = edited(record, path, value, delete=action == "remove")

    def run():
        folder = arts.copy(kind, fresh(kind))
        write_json(folder / name, mutated)
        return judge(arts, kind, folder, mutated)

    assert_good(Case("formats", name, f"{action} {path}", run, path_words(path)))


@FUZZ
@given(
    tensor=st.sampled_from(TENSOR_NAMES),
    field=st.sampled_from(["dtype", "shape", "data_offsets"]),
    value=st.one_of(
        st.sampled_from(["F16", "BF16", "F32", "F64", "I64", "I8", "U8", "BOOL", "F8_E5M2"]),
        st.lists(st.integers(min_value=-(2**65), max_value=2**65), max_size=4),
        SCALARS,
    ),
    fresh_hash=st.booleans(),
)
def test_an_edited_safetensors_header_is_refused_or_loads_the_same_cache(arts, fresh, tensor, field, value, fresh_hash):
    header, data = safetensors_parts(arts.root / "cache" / "cache.safetensors")

    def run():
        folder = arts.copy("cache", fresh("header"))
        header[tensor] = {**header[tensor], field: value}
        write_safetensors(folder / "cache.safetensors", header, data)
        if fresh_hash:
            rehash(folder)
        return judge_cache(arts, folder)

    words = ("cache.safetensors", "tensors_sha256", tensor)
    assert_good(Case("formats", "cache.safetensors header", f"{tensor}.{field} = {value!r}", run, words))


@FUZZ
@given(data=st.data())
def test_raw_bytes_of_the_tensors_file_are_refused_or_serve_finite_logits(arts, fresh, data):
    raw = (arts.root / "cache" / "cache.safetensors").read_bytes()
    edit = data.draw(st.sampled_from(["truncate", "flip", "append"]), label="edit")
    if edit == "truncate":
        changed = raw[: data.draw(st.integers(0, len(raw) - 1), label="size")]
    elif edit == "append":
        changed = raw + data.draw(st.binary(min_size=1, max_size=64), label="tail")
    else:
        flips = data.draw(
            st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(1, 255)), min_size=1, max_size=8)
        )
        buffer = bytearray(raw)
        for position, mask in flips:
            buffer[position] ^= mask
        changed = bytes(buffer)
    fresh_hash = data.draw(st.booleans(), label="hash recomputed")

    def run():
        folder = arts.copy("cache", fresh("bytes"))
        (folder / "cache.safetensors").write_bytes(changed)
        if fresh_hash:
            rehash(folder)
        return judge_cache(arts, folder, same_tensors=False)

    words = ("cache.safetensors", "tensors_sha256", "tensor")
    assert_good(Case("formats", "cache.safetensors bytes", edit, run, words))


@FUZZ
@given(
    tensor=st.sampled_from(["layers.0.keys", "layers.1.values", "layers.0.bias", "layers.1.bias"]),
    value=st.floats(allow_nan=True, allow_infinity=True, width=32),
)
def test_a_stored_number_the_model_cannot_serve_is_refused(arts, fresh, tensor, value):
    def run():
        folder = arts.copy("cache", fresh("value"))
        tensors = load_file(folder / "cache.safetensors")
        tensors[tensor].view(-1)[-1] = value
        save_file(tensors, folder / "cache.safetensors", metadata={"format": "pt"})
        rehash(folder)
        return judge_cache(arts, folder, same_tensors=False)

    assert_good(Case("formats", "cache.safetensors values", f"{tensor} = {value}", run, (tensor,)))


def test_the_catalogue_of_format_edits_has_no_bad_outcome(arts, tmp_path):
    results = [run_case(case) for case in format_cases(arts, tmp_path)]
    bad = [
        f"{r.case.target} | {r.case.name}: {r.outcome}: {r.detail}" for r in results if r.outcome not in GOOD_OUTCOMES
    ]
    assert not bad, "\n".join(bad)
    assert len(results) > 800 and sum(r.outcome == "refused" for r in results) > 600


def test_the_int4_fields_of_a_format_2_cache_are_refused_naming_them(arts, tmp_path):
    """``head_storage``, ``key_group`` and the five INT4 tensors edited: every edit refused with a ValueError naming
    the field or tensor, a valid storage list or key group the tensors do not match included."""
    cases = int4_cases(arts, tmp_path)
    results = [run_case(case) for case in cases]
    wrong = [f"{r.case.name}: {r.outcome}: {r.detail}" for r in results if r.outcome != "refused"]
    assert not wrong, "\n".join(wrong)
    assert all(r.detail.startswith("ValueError") for r in results)
    assert {suffix for suffix in INT4_TENSORS if any(f"layers.0.{suffix}" in c.name for c in cases)} == set(
        INT4_TENSORS
    )
    assert sum("head_storage" in c.name for c in cases) == len(HEAD_STORAGE_EDITS) + 1
    assert sum("key_group" in c.name for c in cases) == len(KEY_GROUP_EDITS) + 1


# ---------------------------------------------------------------------------------------------------- regressions
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_json_file_linked_to_an_endless_device_is_refused_before_reading(arts, tmp_path, kind):
    """It was read until MemoryError (a pipe: forever)."""
    name = KINDS[kind][1]
    folder = arts.copy(kind, tmp_path / kind)
    (folder / name).unlink()
    (folder / name).symlink_to("/dev/zero")
    with pytest.raises(ValueError, match=f"{name} is not a regular file"):
        KINDS[kind][0].from_pretrained(folder)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (folder / name).unlink()
    (folder / name).symlink_to(fifo)
    with pytest.raises(ValueError, match=f"{name} is not a regular file"):
        KINDS[kind][0].from_pretrained(folder)


def test_a_tensors_file_linked_to_an_endless_device_or_larger_than_recorded_is_refused(arts, tmp_path):
    folder = arts.copy("cache", tmp_path / "cache")
    path = folder / "cache.safetensors"
    path.unlink()
    path.symlink_to("/dev/zero")
    with pytest.raises(ValueError, match="cache.safetensors is not a regular file"):
        CompactedCache.load(folder)
    path.unlink()
    path.write_bytes((arts.root / "cache" / "cache.safetensors").read_bytes())
    os.truncate(path, 200_000_000)
    with pytest.raises(ValueError, match=r"cache.safetensors is 200,000,000 bytes, more than a compacted cache"):
        CompactedCache.load(folder)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_symbolic_link_loop_and_nan_literals_are_value_errors(arts, tmp_path, kind):
    name = KINDS[kind][1]
    folder = arts.copy(kind, tmp_path / kind)
    text = (folder / name).read_text()
    (folder / name).write_text(text.rstrip()[:-1] + ', "x": NaN}')  # loaded, then unsavable (allow_nan=False)
    with pytest.raises(ValueError, match="NaN is not a JSON number"):
        KINDS[kind][0].from_pretrained(folder)
    (folder / name).unlink()
    (folder / name).symlink_to(name)
    with pytest.raises(ValueError, match=f"{name} cannot be read"):
        KINDS[kind][0].from_pretrained(folder)


def test_prefill_costs_must_be_integers_even_without_a_fingerprint(arts, tmp_path):
    """A fingerprint-free prefill policy with ``"elements": ["x", [], 1.5]`` loaded (planning then failed)."""
    record = edited(arts.record("prefill"), ("fingerprint",), None)
    record["provenance"] = "illustrative"
    folder = arts.copy("prefill", tmp_path / "prefill")
    for bad in (["x", [], 1.5], [-1, 0, 0], [1, 2]):
        write_json(folder / "prefill_policy.json", edited(record, ("group_costs", "elements"), bad))
        with pytest.raises(ValueError, match=r"group_costs\.elements"):
            PrefillPolicy.from_pretrained(folder)


def test_head_budgets_refuse_fields_a_save_would_drop(arts, tmp_path):
    folder = arts.copy("budgets", tmp_path / "budgets")
    write_json(folder / "head_budgets.json", {**arts.record("budgets"), "weigths": {}})
    with pytest.raises(ValueError, match=r"unknown fields \['weigths'\]"):
        HeadBudgets.from_pretrained(folder)


@pytest.mark.parametrize(
    ("kind", "path", "value", "words"),
    [
        ("table", ("group_costs", "rows", 2), 1, "group_costs"),
        ("prefill", ("prefill_budget",), True, "prefill_budget"),
        ("table", ("decode_budget",), 2, "decode_budget"),
        ("prefill", ("group_costs", "layer_groups", 0, 0), 1, "group_costs.layer_groups"),
        ("budgets", ("fingerprint", "num_key_value_heads"), 1, "fingerprint"),
    ],
)
def test_refusals_name_the_field_of_the_file(arts, tmp_path, kind, path, value, words):
    folder = arts.copy(kind, tmp_path / kind)
    write_json(folder / KINDS[kind][1], edited(arts.record(kind), path, value))
    with pytest.raises(ValueError, match=words):
        KINDS[kind][0].from_pretrained(folder)


def test_json_paths_cover_first_and_last_list_items():
    assert json_paths({"a": [1, {"b": 2}], "c": {}}) == [("a",), ("a", 0), ("a", 1), ("a", 1, "b"), ("c",)]
    assert json.loads(json.dumps(edited({"a": [1, 2]}, ("a", 1), None, delete=True))) == {"a": [1]}


def test_head_budgets_without_an_architecture_save_again(arts, tmp_path):
    """The fingerprint's ``architecture`` is descriptive (not checked against a model): a file without it loaded but
    its save raised KeyError in the card."""
    record = arts.record("budgets")
    del record["fingerprint"]["architecture"]
    folder = arts.copy("budgets", tmp_path / "budgets")
    write_json(folder / "head_budgets.json", record)
    assert judge_json_artifact("budgets", folder, record) is None
