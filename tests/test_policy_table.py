"""`PolicyTable`: fallback chain and conservative resolution against a brute-force lookup, the all-high reference,
the shipped illustrative table, exact save / load round trips, validation errors, Hub calls mocked."""

from __future__ import annotations

import copy
import dataclasses
import json
from itertools import product
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_structkv.models import tiny_model
from hf_structkv.persistence import model_fingerprint
from hf_structkv.policy import Action, GroupCosts, PolicyEntry, PolicyLookup, PolicyTable, illustrative_policy
from hf_structkv.policy.shipped import SHIPPED_PAIRS, shipped_pair_folders
from hf_structkv.structure.tags import NEXT, ROLES, STATES, TAG_CLASSES, TAG_VIEWS, StructuralTag, position_tag

R, L, H = Action.R, Action.L, Action.H
COSTS = GroupCosts.from_dims([2] * 6, [16] * 6)  # groups [0, 2), [2, 4), [4, 6)
POLICY_FILES = {"policy_table.json", "README.md"}
POLICIES = Path(__file__).parents[1] / "hf_structkv/data/policies"


def entry(action: str, floor: str, r_to_l=(1.0, 2.0, 3.0), l_to_h=(0.5, 1.0, 1.5)) -> PolicyEntry:
    """``entry("RLH", "RRL")``: actions and floors per group as letters, priorities per group."""
    return PolicyEntry(tuple(Action[a] for a in action), tuple(Action[a] for a in floor), tuple(zip(r_to_l, l_to_h)))


def tag(key: str) -> StructuralTag:
    return StructuralTag.from_key(key)


def all_tags(family: str = "function_calling") -> list[StructuralTag]:
    return [StructuralTag(*f) for f in product(TAG_CLASSES, ROLES[family], STATES[family], NEXT)]


def all_keys(family: str = "function_calling") -> list[str]:
    return sorted({key for t in all_tags(family) for key in t.fallback_keys()})


# ---------------------------------------------------------------------------------------------------- brute force
def brute_lookup(table: PolicyTable, candidates) -> PolicyLookup:
    """Lookup straight from the definition (B.1, eq. 12), walking the fallback chain of every candidate."""
    groups = len(table.costs.groups)
    high = PolicyLookup((H,) * groups, (H,) * groups, ((None, None),) * groups)
    keys = []
    for candidate in candidates:
        found = [k for k in candidate.fallback_keys() if k in table.entries]
        if not found:
            return high
        keys.append(found[0])
    if not keys:
        return high
    chosen = [table.entries[k] for k in dict.fromkeys(keys)]
    if len(chosen) == 1:
        return chosen[0].lookup()
    top = tuple(max(max(e.action[c], e.floor[c]) for e in chosen) for c in range(groups))
    priorities = []
    for c in range(groups):
        pair = []
        for step in range(2):
            scores = {e.priorities[c][step] for e in chosen}
            pair.append(scores.pop() if len(scores) == 1 else None)
        priorities.append(tuple(pair))
    return PolicyLookup(top, top, tuple(priorities))


@st.composite
def tables(draw, family: str = "function_calling") -> PolicyTable:
    """Random tables: random layer dimensions (odd head dims too), entries on random keys of every level, small
    integer priorities (ties), any budget in [0, 1], random reserves; three layer groups, or one (the
    no-layer-groups ablation) in a quarter of the draws."""
    num_layers = draw(st.integers(1, 9))
    kv_heads = draw(st.lists(st.integers(1, 3), min_size=num_layers, max_size=num_layers))
    head_dims = draw(st.lists(st.integers(1, 9), min_size=num_layers, max_size=num_layers))
    groups = draw(st.sampled_from((3, 3, 3, 1)))
    costs = GroupCosts.from_dims(kv_heads, head_dims, groups)
    actions = st.tuples(*[st.sampled_from([R, L, H])] * groups)
    scores = st.tuples(*[st.tuples(*[st.integers(0, 3).map(float)] * 2)] * groups)
    keys = draw(st.lists(st.sampled_from(all_keys(family)), max_size=12, unique=True))
    entries = {key: PolicyEntry(draw(actions), draw(actions), draw(scores)) for key in keys}
    reserve_bits = st.floats(0, 2 * costs.full, allow_nan=False)
    by_state = draw(st.dictionaries(st.sampled_from(STATES[family]), reserve_bits))
    return PolicyTable(
        family=family,
        costs=costs,
        entries=entries,
        budget=draw(st.floats(0, 1)),
        reserve_by_state=by_state,
        reserve_pooled=draw(reserve_bits),
        tag_view=draw(st.sampled_from([v for v in TAG_VIEWS if v != "position_bins"])),  # full-vocabulary keys
        provenance="illustrative",
    )


@st.composite
def candidate_sets(draw, family: str = "function_calling") -> tuple[StructuralTag, ...]:
    return tuple(draw(st.lists(st.sampled_from(all_tags(family)), max_size=3)))


# ---------------------------------------------------------------------------------------------------- lookup
GOLDEN = PolicyTable(
    family="function_calling",
    costs=COSTS,
    entries={
        "pure_scaffold": entry("RLL", "RRR", (1.0, 2.0, 3.0), (0.1, 0.2, 0.3)),
        "schema_bearing|required": entry("HHH", "LLH", (4.0, 5.0, 6.0), (0.4, 0.5, 0.6)),
        "schema_bearing|required|critical": entry("LHH", "LLL", (4.0, 9.0, 6.0), (0.4, 0.9, 0.6)),
        "schema_bearing|dispatch_key|critical|no_lookahead": entry("HHH", "HHH"),
    },
    budget=0.5,
    reserve_by_state={"critical": 100.0},
    reserve_pooled=10.0,
    provenance="illustrative",
)


@pytest.mark.parametrize(
    ("full_key", "expected"),
    [
        ("schema_bearing|dispatch_key|critical|no_lookahead", "schema_bearing|dispatch_key|critical|no_lookahead"),
        ("schema_bearing|required|critical|lookahead_critical", "schema_bearing|required|critical"),
        ("schema_bearing|required|boundary|no_lookahead", "schema_bearing|required"),
        ("pure_scaffold|dispatch_key|critical|no_lookahead", "pure_scaffold"),
        ("schema_bearing|dispatch_key|boundary|no_lookahead", None),  # no schema_bearing or dispatch_key|boundary
        ("free_generation|optional|boundary|no_lookahead", None),
    ],
    ids=["full", "three", "two", "class", "no-entry", "no-class-entry"],
)
def test_fallback_chain(full_key, expected):
    assert GOLDEN.entry_key(tag(full_key)) == expected
    result = GOLDEN.lookup((tag(full_key),))
    if expected is None:
        assert result == PolicyLookup((H, H, H), (H, H, H), ((None, None),) * 3)
    else:
        assert result == GOLDEN.entries[expected].lookup()


def test_candidates_on_one_entry_keep_its_action_and_floor():
    a, b = tag("pure_scaffold|required|boundary|no_lookahead"), tag("pure_scaffold|optional|critical|no_lookahead")
    assert GOLDEN.lookup((a, b, a)) == GOLDEN.entries["pure_scaffold"].lookup()


def test_candidates_on_several_entries_take_the_most_protective_action_and_floor():
    scaffold = tag("pure_scaffold|scaffold_separator|boundary|no_lookahead")  # RLL / RRR
    required = tag("schema_bearing|required|critical|no_lookahead")  # LHH / LLL
    base, floor, priorities = GOLDEN.lookup((scaffold, required))
    assert base == floor == (L, H, H)
    # R->L scores: (1, 2, 3) vs (4, 9, 6): all differ; L->H: (0.1, 0.2, 0.3) vs (0.4, 0.9, 0.6)
    assert priorities == ((None, None),) * 3
    required_boundary = tag("schema_bearing|required|boundary|no_lookahead")  # HHH / LLH, R->L (4, 5, 6)
    base, floor, priorities = GOLDEN.lookup((required, required_boundary))
    assert base == floor == (H, H, H)
    assert priorities == ((4.0, 0.4), (None, None), (6.0, 0.6))  # unique scores survive


def test_unresolved_tokens_get_full_protection():
    high = PolicyLookup((H, H, H), (H, H, H), ((None, None),) * 3)
    assert GOLDEN.lookup(()) == high
    no_entry = tag("free_generation|optional|boundary|no_lookahead")
    assert GOLDEN.lookup((tag("pure_scaffold|required|boundary|no_lookahead"), no_entry)) == high


@pytest.mark.parametrize(
    "bad",
    [
        StructuralTag("schema_bearing", "projection", "boundary", "no_lookahead"),  # an SQL role
        StructuralTag("schema_bearing", "required", "stable", "no_lookahead"),  # an SQL state
        ("pure_scaffold", "scaffold_separator"),
        "pure_scaffold",
    ],
)
def test_lookup_rejects_tags_outside_the_vocabulary(bad):
    with pytest.raises(ValueError, match="not in the function_calling vocabulary"):
        GOLDEN.lookup((bad,))


@settings(max_examples=60, deadline=None)
@given(tables(), st.lists(candidate_sets(), min_size=1, max_size=20))
def test_lookup_equals_brute_force(table, candidate_lists):
    for candidates in candidate_lists:
        assert table.lookup(candidates) == brute_lookup(table, candidates)
    for full in all_tags():
        found = [k for k in full.fallback_keys() if k in table.entries]
        assert table.entry_key(full) == (found[0] if found else None)


@settings(max_examples=20, deadline=None)
@given(tables(family="sql"), st.lists(candidate_sets(family="sql"), min_size=1, max_size=20))
def test_sql_vocabulary_lookup_equals_brute_force(table, candidate_lists):
    for candidates in candidate_lists:
        assert table.lookup(candidates) == brute_lookup(table, candidates)


def test_reserve_by_state_with_pooled_fallback():
    assert GOLDEN.reserve("critical") == 100.0
    assert GOLDEN.reserve("boundary") == 10.0
    assert GOLDEN.reserve(None) == 10.0
    with pytest.raises(ValueError, match="state must be one of"):
        GOLDEN.reserve("stable")


def test_layer_groups():
    assert GOLDEN.layer_groups == (range(0, 2), range(2, 4), range(4, 6))


def test_copies_share_the_frozen_table():
    assert copy.copy(GOLDEN) is GOLDEN and copy.deepcopy(GOLDEN) is GOLDEN


# ---------------------------------------------------------------------------------------------------- all high
@pytest.mark.parametrize("source", ["costs", "config", "model"])
def test_all_high_reference(source):
    model = tiny_model("qwen2", num_hidden_layers=5)
    costs = GroupCosts.from_config(model.config)
    table = PolicyTable.all_high({"costs": costs, "config": model.config, "model": model}[source])
    assert table.costs == costs and table.budget == 1.0 and table.provenance == "reference"
    assert table.reserve(None) == 0.0 and all(table.reserve(s) == 0.0 for s in STATES["function_calling"])
    for full in all_tags():
        base, floor, _ = table.lookup((full,))
        assert base == floor == (H, H, H)
    assert table.fingerprint == (model_fingerprint(model) if source == "model" else None)


def test_all_high_rejects_other_inputs():
    with pytest.raises(TypeError, match="config_or_costs must be a GroupCosts"):
        PolicyTable.all_high([2, 2])


# ---------------------------------------------------------------------------------------------------- files
def test_save_load_round_trip_is_exact(tmp_path):
    GOLDEN.save_pretrained(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == POLICY_FILES
    loaded = PolicyTable.from_pretrained(tmp_path)
    assert loaded == GOLDEN
    assert loaded.to_json_dict() == GOLDEN.to_json_dict()
    assert (tmp_path / "README.md").read_text() == GOLDEN.render_card()


@settings(max_examples=40, deadline=None)
@given(tables())
def test_json_round_trip_is_exact(table):
    record = json.loads(json.dumps(table.to_json_dict()))
    assert PolicyTable.from_json_dict(record) == table


def test_model_check_on_load(tmp_path):
    model = tiny_model("qwen2", num_hidden_layers=4)
    table = PolicyTable(
        family="function_calling",
        costs=GroupCosts.from_config(model.config),
        entries={"pure_scaffold": entry("RLL", "RRR")},
        budget=0.25,
        fingerprint=model_fingerprint(model),
    )
    table.save_pretrained(tmp_path / "calibrated")
    assert PolicyTable.from_pretrained(tmp_path / "calibrated", model=model) == table
    other_rope = tiny_model("qwen2", num_hidden_layers=4, rope_theta=500000.0)
    with pytest.raises(ValueError, match="this policy table was built for another model: rope_parameters"):
        PolicyTable.from_pretrained(tmp_path / "calibrated", model=other_rope)
    PolicyTable.all_high(model.config).save_pretrained(tmp_path / "reference")  # no fingerprint: costs are checked
    with pytest.raises(ValueError, match="built for other layer dimensions"):
        PolicyTable.from_pretrained(tmp_path / "reference", model=tiny_model("qwen2", num_hidden_layers=5))


def test_missing_table_file(tmp_path):
    with pytest.raises(ValueError, match="is not a saved policy table: policy_table.json is missing"):
        PolicyTable.from_pretrained(tmp_path)


def test_invalid_json(tmp_path):
    (tmp_path / "policy_table.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        PolicyTable.from_pretrained(tmp_path)


def _edit(record, path, value):
    *parents, last = path
    for key in parents:
        record = record[key]
    if value is _DELETE:
        del record[last]
    else:
        record[last] = value


_DELETE = object()
_ENTRY = "schema_bearing|required"


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("format_version",), 2, "unknown format_version 2"),
        (("extra",), 1, r"unknown fields \['extra'\]"),
        (("window",), _DELETE, r"lacks the fields \['window'\]"),
        (("family",), "yaml", "family in policy_table.json must be one of"),
        (("vocabulary", "state"), ["boundary"], "not hf_structkv's function_calling vocabulary"),
        (
            ("conventions", "tie_order"),
            "group-first",
            r"conventions this hf_structkv does not implement: \['tie_order'\]",
        ),
        (("conventions",), "pask", "conventions in policy_table.json must be a JSON object"),
        (("calibration",), [], "calibration in policy_table.json must be a JSON object, got list"),
        (("entries", "schema_bearing|mandatory"), _DELETE, None),  # placeholder replaced below
        (("entries", _ENTRY, "action"), ["H", "H", "X"], r"entries\['schema_bearing\|required'\]\.action must list"),
        (("entries", _ENTRY, "floor"), ["L", "H"], "needs one action, floor and priority pair per layer group"),
        (
            ("entries", _ENTRY),
            {"action": ["L", "H"], "floor": ["L", "H"], "priorities": {"R->L": [1.0, 1.0], "L->H": [1.0, 1.0]}},
            "has 2 layer groups but the table has 3",
        ),
        (("entries", _ENTRY, "priorities", "L->H"), [0.1, -1.0, 0.2], r"priorities\['L->H'\] must list one finite"),
        (("entries", _ENTRY, "priorities", "R->H"), [0.1, 1.0, 0.2], "must have exactly the fields"),
        (("entries", _ENTRY, "note"), "x", "must have exactly the fields"),
        (("decode_budget",), -0.5, r"budget \(B_D\) must be a number in \[0, 1\]"),
        (("decode_budget",), 1.5, r"budget \(B_D\) must be a number in \[0, 1\]"),
        (("reserve", "pooled"), -1.0, "reserve_pooled must be a finite number of bits >= 0"),
        (("reserve", "by_state", "stable"), 1.0, "reserve_by_state has unknown state 'stable'"),
        (("reserve", "by_state", "critical"), -2.0, r"reserve_by_state\['critical'\] must be a finite number"),
        (("window",), 0, "window must be an integer >= 1"),
        (("sink_tokens",), -1, "sink_tokens must be an integer >= 0"),
        (("provenance",), "guessed", "provenance must be one of"),
        (("group_costs", "layer_groups"), [[0, 3], [3, 6]], "must be the 3 layer groups of A.2"),
        (("group_costs", "rows"), [8, 8, -8], r"costs\.rows must hold one integer >= 0 per layer group"),
        (("thresholds", "tau_low"), "low", "thresholds must map names to finite numbers"),
        (("tag_view",), "positions", "tag_view must be one of"),
    ],
)
def test_validation_errors(tmp_path, path, value, message):
    record = GOLDEN.to_json_dict()
    if path == ("entries", "schema_bearing|mandatory"):  # an unknown lookup key
        value, message = record["entries"][_ENTRY], r"unknown lookup key 'schema_bearing\|mandatory'"
    _edit(record, path, value)
    (tmp_path / "policy_table.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match=message):
        PolicyTable.from_pretrained(tmp_path)


def test_a_file_without_tag_view_means_full_tags(tmp_path):
    record = {**GOLDEN.to_json_dict(), "tag_view": "no_role"}
    assert PolicyTable.from_json_dict(record).tag_view == "no_role"
    del record["tag_view"]  # written before the field existed
    assert PolicyTable.from_json_dict(record) == GOLDEN and GOLDEN.tag_view == "full"
    ablated = PolicyTable.all_high(COSTS, tag_view="no_class")
    assert ablated.tag_view == "no_class" and "`no_class`" in ablated.render_card()


def test_a_position_bin_table_looks_up_bin_tags_and_round_trips(tmp_path):
    """The no-parser-transitions ablation: keys over the bin tags only, bins recorded, card and JSON exact."""
    bins = (5, 12)
    fields = dict(family="function_calling", costs=COSTS, budget=0.5, provenance="illustrative")
    table = PolicyTable(
        entries={"position": entry("HHH", "HHH"), "position|bin_1": entry("RLH", "RRL")},
        tag_view="position_bins",
        position_bins=[5, 12],  # a list is kept as a tuple
        **fields,
    )
    assert table.position_bins == bins
    assert table.lookup([position_tag(7, bins, "function_calling")]).base == (R, L, H)
    assert table.lookup([position_tag(12, bins, "function_calling")]).base == (H, H, H)
    assert table.entry_key(position_tag(0, bins, "function_calling")) == "position"
    with pytest.raises(ValueError, match="not in the function_calling vocabulary"):
        table.lookup([tag("pure_scaffold|required|boundary|no_lookahead")])
    table.save_pretrained(tmp_path)
    assert PolicyTable.from_pretrained(tmp_path) == table
    assert "`position_bins` (bins start at [5, 12])" in (tmp_path / "README.md").read_text()
    with pytest.raises(ValueError, match=r"unknown lookup key 'pure_scaffold' for the function_calling vocabulary"):
        PolicyTable(entries={"pure_scaffold": entry("HHH", "HHH")}, tag_view="position_bins", **fields)
    with pytest.raises(ValueError, match="unknown lookup key 'position'"):
        PolicyTable(entries={"position": entry("HHH", "HHH")}, **fields)
    with pytest.raises(ValueError, match="apply to tag_view='position_bins' only"):
        PolicyTable(entries={}, position_bins=(3,), **fields)
    reference = PolicyTable.all_high(COSTS, tag_view="position_bins", position_bins=bins)
    assert set(reference.entries) == {"position"} and reference.position_bins == bins
    record = table.to_json_dict()
    record["position_bins"] = "5,12"
    with pytest.raises(ValueError, match="position_bins in policy_table.json must be a JSON list"):
        PolicyTable.from_json_dict(record)
    del record["position_bins"]  # a file written before the field: no bins, which this view's keys then need
    with pytest.raises(ValueError, match="unknown lookup key 'position|bin_1'"):
        PolicyTable.from_json_dict(record)


def test_calibrated_tables_need_a_fingerprint_that_fits_their_costs():
    fields = dict(family="function_calling", costs=COSTS, entries={}, budget=0.5)
    with pytest.raises(ValueError, match="a calibrated policy table needs the fingerprint of its model"):
        PolicyTable(**fields)
    fingerprint = model_fingerprint(tiny_model("llama"))  # 2 layers: not COSTS' 6
    with pytest.raises(ValueError, match=r"costs do not match the fingerprint's model \(2 layers"):
        PolicyTable(**fields, fingerprint=fingerprint)
    with pytest.raises(ValueError, match=r"the fingerprint lacks the fields \['rope_parameters'\]"):
        PolicyTable(**fields, fingerprint={k: v for k, v in fingerprint.items() if k != "rope_parameters"})


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (lambda: PolicyEntry(("H", "H", "H"), (H, H, H), ((1.0, 1.0),) * 3), TypeError, "tuple of Action values"),
        (lambda: PolicyEntry((H, H, H), (H, H), ((1.0, 1.0),) * 3), ValueError, "one action, floor and priority"),
        (lambda: PolicyEntry((H,), (H,), ((float("nan"), 1.0),)), ValueError, "pairs of finite numbers >= 0"),
        (lambda: PolicyTable("function_calling", COSTS, {"pure_scaffold": "HHH"}, 0.5), TypeError, "PolicyEntry"),
        (lambda: PolicyTable("function_calling", [1, 2, 3], {}, 0.5), TypeError, "costs must be a GroupCosts"),
    ],
)
def test_construction_errors(build, error, message):
    with pytest.raises(error, match=message):
        build()


def test_failed_overwrite_leaves_no_loadable_mix(tmp_path, monkeypatch):
    GOLDEN.save_pretrained(tmp_path)
    original = Path.write_text

    def crash(self, *args, **kwargs):
        if ".policy_table.json." in self.name:
            raise OSError("disk full")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", crash)
    with pytest.raises(OSError, match="disk full"):
        PolicyTable.all_high(COSTS).save_pretrained(tmp_path)
    assert {p.name for p in tmp_path.iterdir()} == {"README.md"}  # no temporary files, no stale table


# ---------------------------------------------------------------------------------------------------- Hub (mocked)
def test_load_from_repo_id_downloads_only_the_table_files(tmp_path, monkeypatch, fake_hub):
    GOLDEN.save_pretrained(tmp_path / "saved")
    calls = fake_hub(served=tmp_path / "saved")
    monkeypatch.chdir(tmp_path)
    assert PolicyTable.from_pretrained("someone/pask-policy", revision="v1", token="hf_test") == GOLDEN
    [(repo_id, kwargs)] = calls["downloads"]
    assert repo_id == "someone/pask-policy" and kwargs["revision"] == "v1" and kwargs["token"] == "hf_test"
    assert set(kwargs["allow_patterns"]) == POLICY_FILES


def test_push_to_hub_uploads_the_table_and_its_card(fake_hub):
    calls = fake_hub(load=PolicyTable.from_pretrained)
    url = GOLDEN.push_to_hub("someone/pask-policy", private=True, token="hf_test", revision="v1")
    assert url == "https://huggingface.co/someone/pask-policy/commit/abc123"
    assert calls["token"] == "hf_test"
    assert calls["create_repo"] == ("someone/pask-policy", {"private": True, "exist_ok": True})
    assert calls["create_branch"] == ("someone/pask-policy", {"branch": "v1", "exist_ok": True})
    assert calls["upload_folder"]["revision"] == "v1" and set(calls["upload_folder"]["allow_patterns"]) == POLICY_FILES
    assert calls["files"] == POLICY_FILES
    assert calls["readme"].startswith("---\nlibrary_name: hf_structkv\ntags:\n- hf_structkv\n- kv-cache\n")
    assert 'PolicyTable.from_pretrained("someone/pask-policy", model=model)' in calls["readme"]
    assert calls["loaded"] == GOLDEN


def test_a_one_group_table_round_trips_fits_its_model_and_says_it_is_the_ablation(tmp_path):
    """The no-layer-groups ablation (PASK Fig. 5): one group of every layer, one action per token."""
    model = tiny_model("qwen2", num_hidden_layers=4)
    costs = GroupCosts.from_config(model.config, groups=1)
    table = PolicyTable(
        family="function_calling",
        costs=costs,
        entries={"pure_scaffold": PolicyEntry((L,), (R,), ((1.0, 2.0),))},
        budget=0.25,
        fingerprint=model_fingerprint(model),
    )
    assert table.layer_groups == (range(0, 4),)
    scaffold = tag("pure_scaffold|required|boundary|no_lookahead")
    assert table.lookup([scaffold]) == PolicyLookup((L,), (R,), ((1.0, 2.0),))
    assert table.lookup(()) == PolicyLookup((H,), (H,), ((None, None),))
    table.save_pretrained(tmp_path)
    assert PolicyTable.from_pretrained(tmp_path, model=model) == table
    card = (tmp_path / "README.md").read_text()
    assert "tied across depth (the no-layer-groups ablation" in card and "| all | 0-3 |" in card
    assert "GroupCosts.from_config(model.config, groups=1)" in card and "| `pure_scaffold` | L | R | 1 | 2 |" in card
    with pytest.raises(ValueError, match="has 3 layer groups but the table has 1"):
        PolicyTable(family="function_calling", costs=costs, entries={"pure_scaffold": entry("RLL", "RRR")}, budget=1)
    unbound = dataclasses.replace(table, fingerprint=None, provenance="illustrative")
    with pytest.raises(ValueError, match="built for other layer dimensions"):
        unbound.check_model(tiny_model("qwen2", num_hidden_layers=4, num_key_value_heads=1))


# ---------------------------------------------------------------------------------------------------- card
def test_card_states_provenance_budget_entries_and_resolution():
    card = GOLDEN.render_card()
    assert "- pask-policy-table\n- illustrative\n" in card and "**Illustrative, not calibrated.**" in card
    assert f"| Full-precision payload `C_full` | {COSTS.full:,} bits per token |" in card
    assert f"allowance {0.5 * COSTS.full:,.1f} bits" in card
    assert "| `schema_bearing\\|required\\|critical` | L H H | L L L | 4 / 9 / 6 | 0.4 / 0.9 / 0.6 |" in card
    assert "| `free_generation\\|optional\\|boundary\\|no_lookahead` | no entry: H action and floor |" in card
    assert "| critical | 100.0 |" in card and "| any other state (pooled) | 10.0 |" in card
    assert "base_model" not in card.split("---")[1]


# ---------------------------------------------------------------------------------------------------- illustrative
def test_illustrative_policy_is_labelled_and_follows_its_design():
    table = illustrative_policy()
    assert table.provenance == "illustrative" and "not calibrated" in table.calibration["note"]
    assert table.budget == 0.5 and (table.sink_tokens, table.window) == (4, 32)
    assert table.costs == GroupCosts.from_dims([2] * 24, [64] * 24)
    assert table.fingerprint["name_or_path"] == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    for full in all_tags():
        base, floor, _ = table.lookup((full,))
        if full.role == "dispatch_key" and full.tag_class == "schema_bearing":
            assert base == floor == (H, H, H)
        elif full.tag_class == "schema_bearing" and full.role == "required":
            assert base == (H, H, H)
        elif full.tag_class == "pure_scaffold":
            assert max(base) <= H and min(base) <= L and floor[0] == R
        elif full.tag_class == "free_generation":
            assert base == (L, L, L)


def test_shipped_illustrative_files_are_what_save_pretrained_writes(tmp_path):
    table = illustrative_policy()
    table.save_pretrained(tmp_path)
    shipped = POLICIES / "qwen2.5-coder-0.5b-instruct-illustrative"
    for name in POLICY_FILES:
        assert (shipped / name).read_text() == (tmp_path / name).read_text(), name


@pytest.mark.slow
def test_illustrative_policy_fits_the_embedded_model(default_model):
    model, _ = default_model
    table = illustrative_policy(model=model)
    assert table.costs == GroupCosts.from_config(model.config)


# ---------------------------------------------------------------------------------------------------- calibrated
@pytest.mark.parametrize("name", sorted(SHIPPED_PAIRS))
def test_calibrated_policy_is_algorithm_1_output_with_its_record(name):
    from hf_structkv.policy import calibrated_policy

    table = calibrated_policy(name=name)
    assert table.provenance == "calibrated" and table.fingerprint is not None
    assert table.costs == GroupCosts.from_dims([2] * 24, [64] * 24)
    assert 0 <= table.budget <= 1 and "alpha_D" in table.thresholds
    report = POLICIES / shipped_pair_folders(name)[0]
    assert (report / "calibration_report.json").is_file()


@pytest.mark.parametrize("name", sorted(SHIPPED_PAIRS))
def test_shipped_calibrated_files_are_what_save_pretrained_writes(tmp_path, name):
    from hf_structkv.policy import calibrated_policy

    calibrated_policy(name=name).save_pretrained(tmp_path)
    shipped = POLICIES / shipped_pair_folders(name)[0]
    for file in POLICY_FILES:
        assert (shipped / file).read_text() == (tmp_path / file).read_text(), file


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SHIPPED_PAIRS))
def test_calibrated_policy_fits_the_embedded_model(default_model, name):
    from hf_structkv.policy import calibrated_policy

    model, _ = default_model
    assert calibrated_policy(model=model, name=name).costs == GroupCosts.from_config(model.config)


def test_shipped_pairs_by_name():
    from hf_structkv.policy import SHIPPED_PAIRS, calibrated_policy, calibrated_prefill_policy
    from hf_structkv.policy.shipped import DEFAULT_CALIBRATED, pair_name

    # "calibrated" is the default pair; every shipped pair loads by its name; an unknown name lists the names
    assert DEFAULT_CALIBRATED in SHIPPED_PAIRS
    assert pair_name("calibrated") == DEFAULT_CALIBRATED
    assert all(pair_name(name) == name for name in [*SHIPPED_PAIRS, "some/folder"])
    assert calibrated_policy() == calibrated_policy(name=DEFAULT_CALIBRATED)
    assert calibrated_prefill_policy() == calibrated_prefill_policy(name=DEFAULT_CALIBRATED)
    for name in SHIPPED_PAIRS:
        assert calibrated_policy(name=name).provenance == "calibrated"
        assert calibrated_prefill_policy(name=name).provenance == "calibrated"
    with pytest.raises(ValueError, match="no shipped calibrated pair 'nope': choose one of"):
        calibrated_policy(name="nope")
