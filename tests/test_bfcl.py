"""BFCL data, splits, the AST-checker shim and the evaluation loop (needs the bfcl-eval package)."""

import sys
from collections import Counter

import pytest

pytest.importorskip(
    "bfcl_eval", reason='bfcl-eval is not installed: pip install --no-deps "bfcl-eval==2026.3.23" (scripts/setup.sh)'
)


from hf_structkv.eval.bfcl import (  # noqa: E402
    CATEGORIES,
    SPLITS,
    BfclEntry,
    bfcl_split,
    evaluate_bfcl,
    load_bfcl,
    split_bfcl,
    summarise,
    tool_set_key,
)
from hf_structkv.eval.bfcl_checker import bfcl_model_output, check_calls  # noqa: E402
from hf_structkv.models import tiny_model  # noqa: E402
from hf_structkv.policy import PolicyTable, illustrative_policy  # noqa: E402

# Cases per category in bfcl-eval 2026.3.23 (BFCL v4), as PASK Table 7 lists them.
CASES = {
    "simple_python": 400,
    "multiple": 200,
    "parallel": 200,
    "parallel_multiple": 200,
    "live_simple": 258,
    "live_multiple": 1053,
    "live_parallel": 16,
    "live_parallel_multiple": 24,
}
# Live cases whose possible answer the checker itself rejects (it omits a required parameter, names one the function
# lacks, or omits an optional one it does not mark optional): no output can pass them.
UNSATISFIABLE = {
    "live_simple_106-63-0",
    "live_simple_112-68-0",
    "live_multiple_507-149-4",
    "live_multiple_862-181-3",
    "live_multiple_964-207-0",
    "live_multiple_1038-265-0",
}
NON_LIVE = CATEGORIES[:4]


def _first_value(options):
    """The first accepted value of a possible-answer list (``""`` = omitted), nested dicts resolved the same way."""
    if not isinstance(options, list):
        return _resolve(options)
    return next((_resolve(option) for option in options if option != ""), None)


def _resolve(value):
    if isinstance(value, dict):
        return {key: resolved for key, options in value.items() if (resolved := _first_value(options)) is not None}
    if isinstance(value, list):
        return [_resolve(item) for item in value]
    return value


def ground_truth_calls(entry: BfclEntry) -> list[dict]:
    """Our JSON calls built from the ground truth: first accepted value of each parameter, optional ones that may be
    omitted left out."""
    tools = {tool["name"]: tool for tool in entry.tools}
    calls = []
    for answer in entry.ground_truth:
        ((name, parameters),) = answer.items()
        required = set(tools[name]["parameters"].get("required", []))
        arguments = {}
        for key, options in parameters.items():
            if "" in options and key not in required:
                continue
            value = _first_value(options)
            if value is not None:
                arguments[key] = value
        calls.append({"name": name, "arguments": arguments})
    return calls


@pytest.mark.parametrize("category", CATEGORIES)
def test_load_counts_ids_and_fields(category):
    entries = load_bfcl(category)
    assert len(entries) == CASES[category]
    assert len({entry.id for entry in entries}) == len(entries)
    for entry in entries:
        assert entry.category == category and entry.id.startswith(category + "_")
        assert entry.tools and entry.ground_truth and entry.messages[-1]["role"] == "user"
        assert all(set(m) >= {"role", "content"} for m in entry.messages)
    assert load_bfcl(category) == entries


def test_a_system_message_stays_a_system_message_after_the_call_instruction():
    from hf_structkv.structured_generation import CALL_INSTRUCTION, _chat

    entry = next(e for e in load_bfcl("live_simple") if e.messages[0]["role"] == "system")
    chat = _chat(list(entry.messages))
    assert chat[0]["role"] == "system" and chat[0]["content"].startswith(CALL_INSTRUCTION)
    assert chat[0]["content"].endswith(entry.messages[0]["content"]) and chat[1:] == list(entry.messages[1:])


def test_load_rejects_unknown_category():
    with pytest.raises(ValueError, match="category must be one of"):
        load_bfcl("simple_java")


def test_tool_set_key_ignores_descriptions_and_order_but_not_schemas():
    a = {"name": "f", "description": "x", "parameters": {"type": "dict", "properties": {"n": {"type": "float"}}}}
    a_reworded = {
        "name": "f",
        "description": "y",
        "parameters": {"type": "object", "properties": {"n": {"type": "number"}}},
    }
    b = {"name": "g", "parameters": {"type": "dict", "properties": {}}}
    a_integer = {"name": "f", "parameters": {"type": "dict", "properties": {"n": {"type": "integer"}}}}
    assert tool_set_key([a, b]) == tool_set_key([b, a_reworded])
    assert tool_set_key([a]) != tool_set_key([a_integer])
    assert tool_set_key([a]) != tool_set_key([a, b])


@pytest.mark.parametrize("category", CATEGORIES)
def test_split_partitions_are_disjoint_complete_grouped_and_1_1_3(category):
    entries = load_bfcl(category)
    parts = split_bfcl(entries, seed=0)
    assert list(parts) == list(SPLITS)
    ids = [entry.id for part in parts.values() for entry in part]
    assert sorted(ids) == sorted(entry.id for entry in entries)
    partition_of_tool_set = {}
    for name, part in parts.items():
        for entry in part:
            assert partition_of_tool_set.setdefault(tool_set_key(entry.tools), name) == name
    largest_group = max(Counter(tool_set_key(entry.tools) for entry in entries).values())
    for name, weight in zip(SPLITS, (1, 1, 3)):
        assert abs(len(parts[name]) - weight / 5 * len(entries)) <= largest_group


def test_split_sizes_of_the_non_live_categories_match_the_paper():
    for category in NON_LIVE:
        parts = split_bfcl(load_bfcl(category))
        n = CASES[category]
        assert [len(parts[name]) for name in SPLITS] == [n // 5, n // 5, 3 * n // 5]


def test_split_is_deterministic_and_depends_on_the_seed():
    entries = load_bfcl("simple_python") + load_bfcl("live_simple")
    first, again, other = split_bfcl(entries, 0), split_bfcl(entries, 0), split_bfcl(entries, 1)
    assert first == again
    assert first["test"] != other["test"]
    # within each category: a category's split does not depend on the other categories passed along
    alone = split_bfcl(load_bfcl("live_simple"), 0)
    assert [e for e in first["development"] if e.category == "live_simple"] == list(alone["development"])


def test_bfcl_split_takes_the_partition_head_per_category():
    chosen = bfcl_split(["multiple", "parallel"], "development", seed=0, limit=3)
    assert [e.category for e in chosen] == ["multiple"] * 3 + ["parallel"] * 3
    assert list(chosen[:3]) == list(split_bfcl(load_bfcl("multiple"))["development"][:3])
    later = bfcl_split(["multiple", "parallel"], "development", seed=0, limit=2, start=3)
    assert list(later[:2]) == list(split_bfcl(load_bfcl("multiple"))["development"][3:5])
    assert [e.category for e in later] == ["multiple"] * 2 + ["parallel"] * 2
    assert not {e.id for e in later} & {e.id for e in chosen}  # disjoint from the first three
    with pytest.raises(ValueError, match="split must be one of"):
        bfcl_split(["multiple"], "dev")
    with pytest.raises(ValueError, match="start must be"):
        bfcl_split(["multiple"], "test", start=-1)
    with pytest.raises(ValueError, match="limit must be"):
        bfcl_split(["multiple"], "test", limit=0)
    with pytest.raises(ValueError, match="categories must be"):
        bfcl_split("multiple", "test")


def test_model_output_conversion():
    calls = [{"name": "math.hypot", "arguments": {"x": 4, "y": 5}}, {"name": "f", "arguments": {}}]
    assert bfcl_model_output(calls) == [{"math.hypot": {"x": 4, "y": 5}}, {"f": {}}]
    with pytest.raises(TypeError, match="calls must be a list"):
        bfcl_model_output({"name": "f", "arguments": {}})
    with pytest.raises(ValueError, match=r"calls\[0\] needs a non-empty string 'name'"):
        bfcl_model_output([{"arguments": {}}])
    with pytest.raises(TypeError, match=r"calls\[0\]\['arguments'\] must be a dict"):
        bfcl_model_output([{"name": "f", "arguments": [1]}])


@pytest.mark.parametrize("category", CATEGORIES)
def test_checker_accepts_every_ground_truth_call(category):
    for entry in load_bfcl(category):
        verdict = check_calls(category, entry.tools, entry.ground_truth, ground_truth_calls(entry))
        assert verdict["valid"] == (entry.id not in UNSATISFIABLE), (entry.id, verdict)
        assert verdict["error_type"] is None or not verdict["valid"]


@pytest.mark.parametrize("category", NON_LIVE)
def test_checker_rejects_a_wrong_name_and_a_missing_required_argument(category):
    entry = next(e for e in load_bfcl(category) if any(t["parameters"].get("required") for t in e.tools))
    calls = ground_truth_calls(entry)
    renamed = [dict(calls[0], name="not_a_tool"), *calls[1:]]
    verdict = check_calls(category, entry.tools, entry.ground_truth, renamed)
    assert not verdict["valid"] and verdict["error"]
    tools = {tool["name"]: tool for tool in entry.tools}
    index = next(i for i, call in enumerate(calls) if tools[call["name"]]["parameters"].get("required"))
    dropped = tools[calls[index]["name"]]["parameters"]["required"][0]
    missing = [dict(call) for call in calls]
    missing[index] = {
        "name": calls[index]["name"],
        "arguments": {key: value for key, value in calls[index]["arguments"].items() if key != dropped},
    }
    verdict = check_calls(category, entry.tools, entry.ground_truth, missing)
    assert not verdict["valid"]
    if category in ("simple_python", "multiple"):
        assert verdict["error_type"] == "simple_function_checker:missing_required"
    assert check_calls(category, entry.tools, entry.ground_truth, None)["error_type"] == "ast_decoder:decoder_failed"


def test_checker_shim_leaves_no_stand_in_behind():
    check_calls("simple_python", load_bfcl("simple_python")[0].tools, load_bfcl("simple_python")[0].ground_truth, [])
    assert "bfcl_eval.constants.model_config" not in sys.modules
    with pytest.raises(ValueError, match="category must be"):
        check_calls("", [], [], [])


def test_summarise_counts_per_category():
    records = [
        {"category": "a", "valid": True, "budget_ratio": 0.5, "nbytes": 10, "full_nbytes": 20, "seconds": 1.0},
        {"category": "a", "valid": False, "budget_ratio": 1.0, "nbytes": 30, "full_nbytes": 30, "seconds": 2.0},
        {"category": "b", "valid": True, "budget_ratio": 0.3, "nbytes": 5, "full_nbytes": 10, "seconds": 3.0},
    ]
    summary = summarise(records)
    assert summary["cases"] == 3 and summary["correct"] == 2 and summary["accuracy"] == pytest.approx(2 / 3)
    assert summary["per_category"] == {
        "a": {"cases": 2, "correct": 1, "accuracy": 0.5},
        "b": {"cases": 1, "correct": 1, "accuracy": 1.0},
    }
    assert summary["mean_budget_ratio"] == pytest.approx(0.6)
    assert (summary["nbytes"], summary["full_nbytes"], summary["seconds"]) == (45, 60, 6.0)


RECORD_FIELDS = {
    "id",
    "category",
    "valid",
    "error_type",
    "error",
    "text",
    "calls",
    "prompt_tokens",
    "generated_tokens",
    "nbytes",
    "full_nbytes",
    "scheduled_payload_bytes",
    "full_payload_bytes",
    "budget_ratio",
    "seconds",
}


def test_evaluate_bfcl_on_a_tiny_model_fills_every_record_field(tokenizer):
    model = tiny_model("qwen2", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    entries = bfcl_split(["simple_python", "parallel"], "development", limit=1)
    evaluation = evaluate_bfcl(model, tokenizer, entries, PolicyTable.all_high(model.config), max_new_tokens=12)
    assert [r["id"] for r in evaluation.records] == [e.id for e in entries]
    for record, entry in zip(evaluation.records, entries):
        assert RECORD_FIELDS <= set(record) and record["category"] == entry.category
        assert 0 < record["generated_tokens"] <= 12 and record["prompt_tokens"] > 0
        assert record["budget_ratio"] == 1.0 and record["nbytes"] > 0 and record["full_nbytes"] > 0
        assert record["valid"] == (record["error_type"] is None)
        if record["calls"] is None:
            assert record["error_type"] == "ast_decoder:decoder_failed"
    assert evaluation.summary == summarise(evaluation.records)
    with pytest.raises(ValueError, match="entries must be a non-empty list"):
        evaluate_bfcl(model, tokenizer, [], PolicyTable.all_high(model.config))
    with pytest.raises(ValueError, match="max_new_tokens must be"):
        evaluate_bfcl(model, tokenizer, entries, PolicyTable.all_high(model.config), max_new_tokens=0)


@pytest.mark.slow
def test_embedded_model_on_two_simple_python_cases(default_model):
    model, tokenizer = default_model
    entries = bfcl_split(["simple_python"], "development", limit=2)
    evaluation = evaluate_bfcl(model, tokenizer, entries, illustrative_policy(model), max_new_tokens=96)
    for record, entry in zip(evaluation.records, entries):
        # the grammar makes the model open a list of calls to the entry's tools (it may loop until the cap)
        assert any(record["text"].startswith(f'[\n  {{"name": "{tool["name"]}"') for tool in entry.tools), record
        assert record["valid"] == (record["error_type"] is None)
        assert (record["calls"] is None) == (record["error_type"] == "ast_decoder:decoder_failed")
        assert 0 < record["budget_ratio"] < 1 and record["nbytes"] > 0 and record["full_nbytes"] > 0
    assert evaluation.summary["cases"] == 2
