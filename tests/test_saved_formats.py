"""One persistence convention for every saved artifact, and files saved by hf_structkv 0.1.0 before the re-layering
(``tests/data/saved_v0_1``: a compacted cache, head budgets in the old ``config.json``, two policy tables and a
prefill policy) still load, and survive a save / load round trip unchanged."""

from __future__ import annotations

import hashlib
import inspect
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_structkv import CompactedCache
from hf_structkv.compaction.budgets import HeadBudgets
from hf_structkv.models import tiny_model
from hf_structkv.persistence.folders import ARTIFACT_MARKERS
from hf_structkv.policy import PolicyTable, PrefillPolicy
from hf_structkv.policy.table import illustrative_policy

SAVED = Path(__file__).parent / "data" / "saved_v0_1"
ARTIFACTS = (CompactedCache, HeadBudgets, PolicyTable, PrefillPolicy)


def fixture_model():
    """The model the fixtures were saved for (only its configuration matters to the fingerprints)."""
    torch.manual_seed(0)
    return tiny_model("llama", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)


@pytest.mark.parametrize("cls", ARTIFACTS, ids=lambda cls: cls.__name__)
def test_every_artifact_has_the_same_keyword_only_signatures(cls):
    load = inspect.signature(cls.from_pretrained).parameters
    assert list(load) == ["path_or_repo_id", "model", "tokenizer", "revision", "token"]
    assert all(load[name].kind is inspect.Parameter.KEYWORD_ONLY for name in list(load)[1:])
    push = inspect.signature(cls.push_to_hub).parameters
    assert list(push) == ["self", "repo_id", "private", "token", "revision", "commit_message"]
    assert all(push[name].kind is inspect.Parameter.KEYWORD_ONLY for name in list(push)[2:])
    assert list(inspect.signature(cls.save_pretrained).parameters) == ["self", "save_directory"]


@pytest.mark.parametrize("cls", ARTIFACTS, ids=lambda cls: cls.__name__)
def test_every_artifact_has_the_marker_file_that_keeps_other_saves_out_of_its_folder(cls):
    assert ARTIFACT_MARKERS[cls.__name__] in cls.SAVED_FILES
    others = {marker for name, marker in ARTIFACT_MARKERS.items() if name != cls.__name__}
    assert not others & set(cls.SAVED_FILES)


def test_no_two_artifacts_write_a_file_of_the_same_name_except_the_card(tmp_path):
    model = fixture_model()
    written = {}
    for name, artifact in {
        "cache": CompactedCache.from_pretrained(SAVED / "compacted_cache"),
        "budgets": HeadBudgets.uniform(model),
        "table": PolicyTable.all_high(model),
        "prefill": PrefillPolicy.from_pretrained(SAVED / "prefill_policy"),
    }.items():
        artifact.save_pretrained(tmp_path / name)
        written[name] = {p.name for p in (tmp_path / name).iterdir()} - {"README.md"}
    names = [file for files in written.values() for file in files]
    assert len(names) == len(set(names)), written
    assert all((tmp_path / name / "README.md").is_file() for name in written)


def test_a_compacted_cache_saved_by_0_1_loads_and_round_trips_bit_for_bit(tmp_path):
    folder = SAVED / "compacted_cache"
    cache = CompactedCache.from_pretrained(folder, model=fixture_model())
    assert CompactedCache.load(folder).head_lengths() == cache.head_lengths()  # the 0.1 name still works
    cache.save_pretrained(tmp_path)
    old, new = load_file(folder / "cache.safetensors"), load_file(tmp_path / "cache.safetensors")
    assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old)
    old_config = json.loads((folder / "config.json").read_text())
    new_config = json.loads((tmp_path / "config.json").read_text())
    assert {k: v for k, v in old_config.items() if k != "hf_structkv_version"} == {
        k: v for k, v in new_config.items() if k not in ("hf_structkv_version", "tensors_sha256")
    }
    # 0.1 recorded no hash; a save now binds config.json to its tensors file
    assert "tensors_sha256" not in old_config
    assert new_config["tensors_sha256"] == hashlib.sha256((tmp_path / "cache.safetensors").read_bytes()).hexdigest()


def test_head_budgets_saved_by_0_1_in_config_json_load_and_resave_under_their_own_name(tmp_path):
    budgets = HeadBudgets.from_pretrained(SAVED / "head_budgets", model=fixture_model())
    assert budgets.provenance == {"kind": "fixture"}
    assert budgets.weights == {0: [0.1, 0.2], 1: [0.3, 0.4]}
    budgets.save_pretrained(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"head_budgets.json", "README.md"}
    assert HeadBudgets.from_pretrained(tmp_path) == budgets


@pytest.mark.parametrize("name", ["policy_table", "policy_table_illustrative"])
def test_policy_tables_saved_by_0_1_load_and_round_trip(tmp_path, name):
    table = PolicyTable.from_pretrained(SAVED / name)
    table.save_pretrained(tmp_path)
    assert PolicyTable.from_pretrained(tmp_path) == table
    if name == "policy_table_illustrative":
        assert table == illustrative_policy()


def test_a_prefill_policy_saved_by_0_1_loads_round_trips_and_now_gets_a_card(tmp_path):
    policy = PrefillPolicy.from_pretrained(SAVED / "prefill_policy")
    policy.save_pretrained(tmp_path)
    assert PrefillPolicy.from_pretrained(tmp_path) == policy
    card = (tmp_path / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: hf_structkv\n") and f"`B_P`: {policy.budget}" in card
