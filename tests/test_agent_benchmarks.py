"""The helpers of issue 33's agent benchmarks, `benchmarks/tool_catalogue.py` and `benchmarks/long_trajectory.py`:
case choice, the catalogue's size and contents, resumable logs, the synthetic trajectory, the summaries."""

import argparse
import json
import shutil

import pytest
from test_benchmark_scripts import BENCHMARKS, load_script

from hf_structkv.eval.bfcl import bfcl_split, load_bfcl
from hf_structkv.structured_generation import call_prompt, catalogue_text

tc = load_script(BENCHMARKS / "tool_catalogue.py")
lt = load_script(BENCHMARKS / "long_trajectory.py")


def tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_cases_come_in_turn_without_system_messages_or_contradicting_functions():
    cases = tc.pick_cases(tc.CATEGORIES, 9, seed=0)
    assert [case.category for case in cases] == list(tc.CATEGORIES) * 3
    assert all(case.messages[0]["role"] != "system" for case in cases)
    definitions = {}
    for case in cases:
        for tool in case.tools:
            assert definitions.setdefault(tool["name"], tool) == tool
    assert [c.id for c in tc.pick_cases(tc.CATEGORIES, 9, seed=0)] == [c.id for c in cases]  # seeded
    with pytest.raises(ValueError, match="usable test cases"):
        tc.pick_cases(["simple_python"], 10**6, seed=0)


def test_the_catalogue_holds_the_cases_functions_and_the_most_others_that_fit(tokenizer):
    cases = tc.pick_cases(tc.CATEGORIES, 3, seed=0)[:2]  # simple_python and multiple
    tools = tc.build_catalogue(tokenizer, cases, tc.CATEGORIES, 1500, seed=0)
    names = [tool["name"] for tool in tools]
    assert len(names) == len(set(names))
    assert {tool["name"] for case in cases for tool in case.tools} <= set(names)
    assert tokens(tokenizer, catalogue_text(tokenizer, tools)) <= 1500
    # brute force: the other tools added one by one in the pool's seeded order while they fit
    rng = tc.catalogue_rng(0)
    own = list({tool["name"]: tool for case in cases for tool in case.tools}.values())
    pool, fitted = tc.other_tools(cases, tc.CATEGORIES, rng), list(own)
    assert pool and not {t["name"] for t in pool} & {t["name"] for t in own}
    for tool in pool:
        if tokens(tokenizer, catalogue_text(tokenizer, [*fitted, tool])) > 1500:
            break
        fitted.append(tool)
    rng.shuffle(fitted)
    assert fitted == tools and len(fitted) > len(own)
    assert tc.build_catalogue(tokenizer, cases, tc.CATEGORIES, 1500, seed=0) == tools
    assert [t["name"] for t in tc.build_catalogue(tokenizer, cases, tc.CATEGORIES, 1500, seed=1)] != names
    with pytest.raises(ValueError, match="--catalogue-tokens 100"):
        tc.build_catalogue(tokenizer, cases, tc.CATEGORIES, 100, seed=0)


def test_groups_are_consecutive_and_their_own_functions_fit(tokenizer):
    cases = tc.pick_cases(tc.CATEGORIES, 9, seed=0)
    groups = tc.group_cases(tokenizer, cases, 2000)
    assert [case for group in groups for case in group] == cases and len(groups) > 1
    for first, second in zip(groups, groups[1:]):
        own = list({t["name"]: t for case in [*first, second[0]] for t in case.tools}.values())
        assert tokens(tokenizer, catalogue_text(tokenizer, own)) > 2000  # the next case did not fit
    for group in groups:
        own = list({t["name"]: t for case in group for t in case.tools}.values())
        assert len(group) == 1 or tokens(tokenizer, catalogue_text(tokenizer, own)) <= 2000


def test_the_case_log_resumes_and_refuses_other_settings(tmp_path):
    path = tmp_path / "run.cases.jsonl"
    log = tc.CaseLog(path, {"seed": 0})
    log.add_case("full_kv", {"id": "a", "valid": True})
    log.add_catalogue("kv_surgeon@4x", 12.5)
    log.add_catalogue("kv_surgeon_tasks@4x/g0", 3.0, ["q1", "q2"])
    again = tc.CaseLog(path, {"seed": 0})
    assert again.cases == {("full_kv", "a"): {"row": "full_kv", "id": "a", "valid": True}}
    assert again.catalogues["kv_surgeon@4x"] == {"catalogue": "kv_surgeon@4x", "seconds": 12.5}
    assert again.catalogues["kv_surgeon_tasks@4x/g0"]["task_questions"] == ["q1", "q2"]
    assert len(path.read_text().splitlines()) == 4
    with pytest.raises(ValueError, match="other settings"):
        tc.CaseLog(path, {"seed": 1})


def test_a_log_without_an_added_setting_resumes_with_it_and_compares_it_from_then_on(tmp_path):
    assert tc.ADDED_SETTINGS == ("task_questions",)
    path = tmp_path / "run.cases.jsonl"
    tc.CaseLog(path, {"seed": 0}).add_case("full_kv", {"id": "a", "valid": True})  # written before the flag
    with pytest.raises(ValueError, match="other settings"):
        tc.CaseLog(path, {"seed": 0, "other": 1})  # a key not in ADDED_SETTINGS is never skipped
    with pytest.raises(ValueError, match="other settings"):
        tc.CaseLog(path, {"seed": 1, "task_questions": ["q1"]})
    resumed = tc.CaseLog(path, {"seed": 0, "task_questions": ["q1", "q2"]})
    assert list(resumed.cases) == [("full_kv", "a")]
    assert json.loads(path.read_text().splitlines()[-1]) == {"added_settings": {"task_questions": ["q1", "q2"]}}
    resumed.add_case("kv_surgeon_tasks@4x", {"id": "a", "valid": False})
    again = tc.CaseLog(path, {"seed": 0, "task_questions": ["q1", "q2"]})  # the recorded value matches: no new line
    assert set(again.cases) == {("full_kv", "a"), ("kv_surgeon_tasks@4x", "a")}
    assert len(path.read_text().splitlines()) == 4
    with pytest.raises(ValueError, match="other settings"):
        tc.CaseLog(path, {"seed": 0, "task_questions": ["q3"]})  # other questions than the logged tasks rows'
    assert set(tc.CaseLog(path, {"seed": 0}).cases) == set(again.cases)  # a run without the flag resumes too
    assert tc.same_settings({"a": 1}, {"a": 1, "task_questions": []}) and not tc.same_settings({"a": 1}, {"a": 2})


def test_task_questions_are_the_first_calibration_cases_whose_functions_lie_in_the_catalogue(tokenizer):
    cases = tc.pick_cases(tc.CATEGORIES, 3, seed=0)
    tools = tc.build_catalogue(tokenizer, cases, tc.CATEGORIES, 8192, seed=0)
    # a BFCL catalogue rarely holds every function of a multi-function case: add those of a few calibration cases of
    # the other categories, so that the order in turn is exercised
    extra = [
        tool
        for category in ("multiple", "live_multiple")
        for entry in bfcl_split([category], "calibration", seed=0)[1:3]
        for tool in entry.tools
    ]
    tools = list({tool["name"]: tool for tool in [*tools, *extra]}.values())
    held = {tool["name"]: tool for tool in tools}
    # brute force: each category's fitting calibration cases in its seeded order, then taken in turn
    fitting = {
        category: [
            entry
            for entry in bfcl_split([category], "calibration", seed=0)
            if entry.messages[0]["role"] != "system" and all(held.get(t["name"]) == t for t in entry.tools)
        ]
        for category in tc.CATEGORIES
    }
    in_turn = [
        fitting[category][turn]
        for turn in range(max(map(len, fitting.values())))
        for category in tc.CATEGORIES
        if turn < len(fitting[category])
    ]
    assert len(in_turn) > 4 and {e.category for e in in_turn[:4]} == set(tc.CATEGORIES)
    every = tc.catalogue_questions(tools, tc.CATEGORIES, 10**6, seed=0)
    assert [e.id for e in every] == [e.id for e in in_turn]  # fewer than asked: all there are
    questions = tc.catalogue_questions(tools, tc.CATEGORIES, 4, seed=0)
    assert [q.id for q in questions] == [e.id for e in in_turn[:4]]
    assert [q.id for q in tc.catalogue_questions(tools, tc.CATEGORIES, 4, seed=0)] == [q.id for q in questions]
    calibration = {e.id for e in bfcl_split(tc.CATEGORIES, "calibration", seed=0)}
    test = {e.id for e in bfcl_split(tc.CATEGORIES, "test", seed=0)}
    assert not calibration & test  # the partitions are disjoint: a task question is never an evaluated case
    assert {q.id for q in every} <= calibration and not {q.id for q in every} & {c.id for c in cases}
    # a definition that differs from the catalogue's does not fit, even under the same name
    changed = [
        {**tool, "description": "changed"} if tool["name"] == questions[0].tools[0]["name"] else tool for tool in tools
    ]
    assert questions[0].id not in {q.id for q in tc.catalogue_questions(changed, tc.CATEGORIES, 10**6, seed=0)}
    assert tc.catalogue_questions([], tc.CATEGORIES, 4, seed=0) == []
    with pytest.raises(ValueError, match="usable test cases"):
        tc.pick_cases(["simple_python"], 10**6, seed=0)


def test_a_tasks_catalogue_records_its_questions_and_reloads_only_with_them(tmp_path, model, tokenizer):
    from types import SimpleNamespace

    from test_structured_generation import TOOLS

    log = tc.CaseLog(tmp_path / "run.cases.jsonl", {"seed": 0})
    args = SimpleNamespace(seed=0, on_policy=False, query_cap=64)
    questions = [
        SimpleNamespace(id="q1", messages=[{"role": "user", "content": "Weather in Oslo?"}]),
        SimpleNamespace(id="q2", messages=[{"role": "user", "content": "Is it cold in Lima?"}]),
    ]
    row = tc.Row("kv_surgeon_tasks@4x", "kv_surgeon", 4.0, tasks=True)
    made = tc.catalogue_for(model, tokenizer, TOOLS, row, 0, tmp_path, log, args, questions)
    calibration = made.metadata["calibration"]
    assert made.metadata["task_questions"] == ["q1", "q2"] and calibration["queries"] == "self_study"
    assert len(calibration["self_study"]["prompt_tasks"]) == 2
    assert log.catalogues["kv_surgeon_tasks@4x/g0"]["task_questions"] == ["q1", "q2"]
    again = tc.catalogue_for(model, tokenizer, TOOLS, row, 0, tmp_path, log, args, questions)
    assert again.metadata["task_questions"] == ["q1", "q2"]
    with pytest.raises(ValueError, match=r"calibrated with task questions \['q1', 'q2'\], this run's are \['q2'\]"):
        tc.catalogue_for(model, tokenizer, TOOLS, row, 0, tmp_path, log, args, questions[1:])
    none = tc.catalogue_for(model, tokenizer, TOOLS, row, 1, tmp_path, log, args, [])  # none fit: self-study alone
    assert none.metadata["task_questions"] == [] and "prompt_tasks" not in none.metadata["calibration"]["self_study"]
    assert none.metadata["calibration"]["queries"] == "self_study"
    plain = tc.catalogue_for(
        model, tokenizer, TOOLS, tc.Row("kv_surgeon@4x", "kv_surgeon", 4.0), 0, tmp_path, log, args, []
    )
    assert "task_questions" not in plain.metadata and plain.metadata["calibration"]["queries"] == "repeat"
    assert "task_questions" not in log.catalogues["kv_surgeon@4x/g0"]


def test_the_task_question_flag_is_checked(capsys):
    assert tc.parse_args(tc.arguments(), ["--task-questions", "8"]).task_questions == 8
    assert tc.parse_args(tc.arguments(), []).task_questions == 0
    with pytest.raises(SystemExit):
        tc.parse_args(tc.arguments(), ["--task-questions", "-1"])
    assert "--task-questions must be >= 0, got -1" in capsys.readouterr().err


@pytest.mark.slow
def test_the_committed_4k_log_resumes_with_task_questions(tmp_path, tokenizer):
    """The committed partial log (``--cases 64 --catalogue-tokens 4096 --threads 1 --ratios 4 --baselines``, before
    ``--task-questions`` existed) resumes when ``--task-questions 8`` is added: the settings this code makes for that
    command are the logged ones plus ``task_questions``. The model entry is the logged path (a machine's own); about
    a minute of catalogue building on CPU."""
    committed = BENCHMARKS / "results" / "tool_catalogue_4k.cases.jsonl"
    logged = json.loads(committed.read_text().splitlines()[0])["settings"]
    argv = "--cases 64 --catalogue-tokens 4096 --threads 1 --ratios 4 --baselines --task-questions 8".split()
    args = tc.parse_args(tc.arguments(), argv)
    plan = tc.Plan.make(tokenizer, args)
    settings = plan.settings(logged["model"], tokenizer, args)
    assert {key: value for key, value in settings.items() if key != "task_questions"} == logged
    assert settings["task_questions"] == {"per_catalogue": 8, "rule": tc.TASK_QUESTION_RULE}
    assert len(plan.questions) == len(plan.catalogues) and any(plan.questions)
    evaluated = {c.id for c in plan.cases}
    for questions, tools in zip(plan.questions, plan.catalogues):  # each catalogue's own questions
        assert len(questions) <= 8 and not {q.id for q in questions} & evaluated
        assert all(tool in tools for q in questions for tool in q.tools)
    copy = tmp_path / "tool_catalogue_4k.cases.jsonl"
    shutil.copy(committed, copy)  # CaseLog appends to the log it resumes: never the committed file
    log = tc.CaseLog(copy, settings)
    # the log grows as the run goes on (later rows after full_kv): it resumes with every case it holds
    assert log.cases and any(row == tc.FULL for row, _ in log.cases)


def test_rows_and_the_best_query_free_baseline():
    rows = tc.method_rows([4.0], ["streaming_llm", "key_norm"])
    assert [r.label for r in rows] == [
        "full_kv",
        "full_kv_int4",
        "full_kv_int4+pask@0.33",
        "kv_surgeon@4x",
        "kv_surgeon_int4@4x",
        "streaming_llm@4x",
        "key_norm@4x",
        "kv_surgeon_int4@4x+pask@0.33",
    ]
    assert rows[-1].pask and rows[-1].catalogue_label == "kv_surgeon_int4@4x" and rows[-1].storage == "int4"
    tasks = tc.method_rows([4.0], [], tasks=True)
    assert [r.label for r in tasks] == [
        "full_kv",
        "full_kv_int4",
        "full_kv_int4+pask@0.33",
        "kv_surgeon@4x",
        "kv_surgeon_int4@4x",
        "kv_surgeon_tasks@4x",
        "kv_surgeon_int4_tasks@4x",
        "kv_surgeon_int4@4x+pask@0.33",
    ]
    assert [(r.tasks, r.storage) for r in tasks[5:7]] == [(True, "bf16"), (True, "int4")]
    assert not any(r.tasks for r in rows) and tasks[5].catalogue_label == "kv_surgeon_tasks@4x"
    whole, whole_pask = rows[1:3]  # every entry in INT4, no method: not a baseline row, one catalogue for both
    assert (whole.method, whole.storage, whole.pask, whole_pask.pask) == (None, "int4", False, True)
    assert whole_pask.catalogue_label == whole.label
    summaries = [
        {"method": "streaming_llm", "ratio": 4.0, "accuracy": 0.5},
        {"method": "key_norm", "ratio": 4.0, "accuracy": 0.5},
        {"method": "key_norm", "ratio": 10.0, "accuracy": 0.4},
        {"method": "streaming_llm", "ratio": 10.0, "accuracy": 0.2},
        {"method": "kv_surgeon", "ratio": 10.0, "accuracy": 0.9},
    ]
    tc.mark_best_baselines(summaries, ["streaming_llm", "key_norm"])
    assert [s.get("best_query_free") for s in summaries] == [True, False, True, False, None]


def test_ground_truth_calls_take_the_first_accepted_values_and_drop_omittable_ones():
    entry = next(e for e in load_bfcl("multiple") if e.id == "multiple_0")
    ((name, accepted),) = entry.ground_truth[0].items()
    calls = lt.ground_truth_calls(entry)
    assert (
        calls == [{"name": name, "arguments": {k: v[0] for k, v in accepted.items() if v[0] != ""}}]
        and calls[0]["arguments"]
    )
    assert all(v[0] == "" for k, v in accepted.items() if k not in calls[0]["arguments"])


def test_a_trajectory_stays_within_its_length_and_ends_with_a_question(tokenizer):
    pool = tc.pick_cases(lt.CATEGORIES, 2, seed=0)
    tools = list({t["name"]: t for case in pool for t in case.tools}.values())
    chat = lt.trajectory(tokenizer, pool, tools, 1200, seed=0)
    assert tokens(tokenizer, call_prompt(tokenizer, chat, tools)) <= 1200
    assert chat[-1]["role"] == "user" and [m["role"] for m in chat].count("assistant") >= 2
    for i, message in enumerate(chat):
        if message["role"] == "assistant":
            calls = json.loads(message["content"])
            results = [json.loads(m["content"]) for m in chat[i + 1 : i + 1 + len(calls)]]
            assert [r["name"] for r in results] == [c["name"] for c in calls]
    assert lt.trajectory(tokenizer, pool, tools, 1200, seed=0) == chat
    longer = lt.trajectory(tokenizer, pool, tools, 2400, seed=0)
    assert len(longer) > len(chat)
    with pytest.raises(ValueError, match="more than 50"):
        lt.trajectory(tokenizer, pool, tools, 50, seed=0)


def test_crossover_is_the_shortest_length_no_slower_than_dynamic():
    def rec(variant, length, batch, ms):
        return {"variant": variant, "length": length, "batch": batch, "decode_ms_median": ms}

    records = [
        rec("dynamic", 512, 1, 10.0),
        rec("pask", 512, 1, 12.0),
        rec("pask+catalogue", 512, 1, 9.0),
        rec("dynamic", 2048, 1, 20.0),
        rec("pask", 2048, 1, 19.0),
        rec("pask+catalogue", 2048, 1, 21.0),
    ]
    assert lt.crossovers(records, [512, 2048], [1]) == {"pask@batch1": 2048, "pask+catalogue@batch1": 512}
    assert lt.crossovers(records[:2], [512], [1, 4])["pask@batch4"] is None


def test_rows_can_be_chosen_and_full_kv_stays(capsys):
    argv = ["--ratios", "4", "--baselines", "key_norm"]
    every = [row.label for row in tc.selected_rows(tc.parse_args(tc.arguments(), argv))]
    assert every == [
        "full_kv",
        "full_kv_int4",
        "full_kv_int4+pask@0.33",
        "kv_surgeon@4x",
        "kv_surgeon_int4@4x",
        "key_norm@4x",
        "kv_surgeon_int4@4x+pask@0.33",
    ]
    chosen = tc.parse_args(tc.arguments(), [*argv, "--rows", "key_norm@4x", "kv_surgeon_int4@4x"])
    assert [row.label for row in tc.selected_rows(chosen)] == ["full_kv", "kv_surgeon_int4@4x", "key_norm@4x"]
    with pytest.raises(SystemExit):
        tc.parse_args(tc.arguments(), [*argv, "--rows", "streaming_llm@4x"])
    assert "--rows ['streaming_llm@4x'] are not rows" in capsys.readouterr().err


def test_long_trajectory_refuses_an_unknown_pask_pair_before_loading_the_model(capsys):
    with pytest.raises(SystemExit):
        lt.main(["--pask-policy", "no-such-pair", "--lengths", "64"])
    assert "--pask-policy 'no-such-pair' is neither a shipped pair" in capsys.readouterr().err


def test_the_whole_int4_catalogue_keeps_every_entry_rounded_to_int4(model, tokenizer, tmp_path):
    tools = list(tc.pick_cases(tc.CATEGORIES, 1, seed=0)[0].tools)
    args = argparse.Namespace(seed=0, on_policy=False, query_cap=64)
    log = tc.CaseLog(tmp_path / "run.cases.jsonl", {"seed": 0})
    with pytest.warns(UserWarning, match="keeps every KV head whole in INT4"):
        whole = tc.catalogue_for(
            model, tokenizer, tools, tc.Row(tc.WHOLE_INT4, storage="int4"), 0, tmp_path, log, args, []
        )
    full = tc.keep_all_catalogue(model, tokenizer, tools)
    lengths = [h for layer in full.head_lengths() if layer for h in layer]
    assert [h for layer in whole.head_lengths() if layer for h in layer] == lengths  # every entry kept
    assert {s for layer in whole.head_storage() if layer for s in layer} == {"int4"}
    assert full.nbytes() > 5 * whole.nbytes()  # a float32 model: INT4 codes and FP16 scales
    assert "full_kv_int4/g0" in log.catalogues  # saved and logged: a rerun loads it
    again = tc.catalogue_for(model, tokenizer, tools, tc.Row(tc.WHOLE_INT4, storage="int4"), 0, tmp_path, log, args, [])
    assert again.nbytes() == whole.nbytes()
