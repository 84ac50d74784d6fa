"""``compact_dataset`` / ``hf-structkv compact-dataset``: one cache folder per context, sharded, resumable, manifest."""

import contextlib
import hashlib
import io
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import hf_structkv.compaction.dataset as dataset_module
from hf_structkv import CompactedCache
from hf_structkv.cache.compacted_files import CACHE_FILES
from hf_structkv.cli import build_parser, compaction_kwargs, main
from hf_structkv.compaction import SelfStudy, compact
from hf_structkv.compaction.dataset import (
    MANIFEST_NAME,
    compact_dataset,
    compact_document,
    dataset_contexts,
    load_rows,
    merge_manifest,
)
from hf_structkv.models import tiny_model
from hf_structkv.prompts import document_chat_parts, document_chat_prompt

SPECIAL_TOKENS = ["<pad>", "</s>", "<s>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>"]  # ids 0, 1, 2 as tiny_model
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SETTINGS = {"ratio": 4.0, "method": "kv_surgeon"}


def chat_tokenizer(chat_template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """One token per printable ASCII character or newline (103 ids, within the tiny models' 256), with a chat
    template: a real tokenizer that saves, loads and renders chat prompts without any download."""
    characters = [chr(c) for c in range(32, 127)] + ["\n"]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIAL_TOKENS + characters)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="</s>",
        bos_token="<s>",
        unk_token="<unk>",
        additional_special_tokens=SPECIAL_TOKENS[4:],
        chat_template=chat_template,
    )


def document(i: int) -> str:
    return f"Document {i}: " + "the quick brown fox jumps over the lazy dog. " * (i + 1)


ROWS = [{"id": f"doc{i}", "context": document(i), "question": f"question {i}"} for i in range(4)]


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama"), chat_tokenizer()


@pytest.fixture
def rows():
    return datasets.Dataset.from_list(ROWS)


@pytest.fixture
def counted_compactions(monkeypatch):
    """Patches the pipeline call of `compact_document`; returns the list of documents compacted since."""
    seen = []

    def counting_compact(model, tokenizer, context, **kwargs):
        seen.append(context)
        return compact(model, tokenizer, context, **kwargs)

    monkeypatch.setattr(dataset_module, "compact", counting_compact)
    return seen


def run_cli(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def manifest(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / MANIFEST_NAME).read_text(encoding="utf-8").splitlines()]


def compact_all(model, tokenizer, rows, out, num_processes=1, **settings):
    """Every process's `compact_dataset` one after the other, then `merge_manifest`; the merged records."""
    for index in range(num_processes):
        compact_dataset(
            model,
            tokenizer,
            rows,
            out,
            id_column="id",
            process_index=index,
            num_processes=num_processes,
            progress=False,
            **(settings or SETTINGS),
        )
    return merge_manifest(out, num_processes)


# ---------------------------------------------------------------------------------------------------- rows
@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_load_rows_reads_data_files(tmp_path, rows, suffix):
    path = tmp_path / f"rows{suffix}"
    {".jsonl": rows.to_json, ".json": rows.to_json, ".csv": rows.to_csv, ".parquet": rows.to_parquet}[suffix](path)
    loaded = load_rows(path)
    assert isinstance(loaded, datasets.Dataset) and loaded.to_list() == ROWS


def test_load_rows_reads_saved_datasets_and_folders(tmp_path, rows):
    rows.save_to_disk(tmp_path / "one")
    assert load_rows(tmp_path / "one").to_list() == ROWS
    datasets.DatasetDict({"validation": rows}).save_to_disk(tmp_path / "single_split")
    assert load_rows(tmp_path / "single_split").to_list() == ROWS
    datasets.DatasetDict({"train": rows.select([0]), "test": rows}).save_to_disk(tmp_path / "two")
    assert load_rows(tmp_path / "two", split="test").to_list() == ROWS
    with pytest.raises(ValueError, match=r"split must be one of \['test', 'train'\]"):
        load_rows(tmp_path / "two")
    (tmp_path / "files").mkdir()
    rows.to_json(tmp_path / "files" / "train.jsonl")
    assert load_rows(tmp_path / "files").to_list() == ROWS  # a folder of data files: datasets.load_dataset


def test_load_rows_rejects_unknown_suffix(tmp_path):
    path = tmp_path / "rows.txt"
    path.write_text("hello")
    with pytest.raises(ValueError, match=r"suffix '\.txt'; use one of \['\.csv', '\.json', '\.jsonl', '\.parquet'\]"):
        load_rows(path)


@pytest.mark.parametrize("name", ["missing.jsonl", "missing.csv", "sub/missing.parquet", "./missing", "../a/b/c"])
def test_load_rows_refuses_a_missing_path_at_once(tmp_path, monkeypatch, name):
    """Issue 34: a mistyped file name went to the Hub (27 s, then ConnectionError)."""

    def no_request(*args, **kwargs):
        raise AssertionError("datasets.load_dataset was asked")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets, "load_dataset", no_request)
    with pytest.raises(ValueError, match=rf"data '{re.escape(name)}' does not exist: pass a \.json/\.jsonl/"):
        load_rows(name)


@pytest.mark.parametrize(
    "content, message",
    [
        ("", r"is empty: it must hold one row per context"),
        ("\n\n", r"holds no rows readable as json"),
        ("not json\n", r"holds no rows readable as json"),
    ],
)
def test_load_rows_refuses_an_empty_or_unreadable_data_file(tmp_path, content, message):
    path = tmp_path / "rows.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=rf"data file '{re.escape(str(path))}' {message}"):
        load_rows(path)


def test_load_rows_refuses_another_split_of_a_data_file(tmp_path, rows):
    rows.to_json(tmp_path / "rows.jsonl")
    assert load_rows(tmp_path / "rows.jsonl", split="train").to_list() == ROWS
    with pytest.raises(ValueError, match=r"a data file has one split, 'train'; got split 'test'"):
        load_rows(tmp_path / "rows.jsonl", split="test")


def test_dataset_contexts_names_and_deduplicates(rows):
    repeated = datasets.Dataset.from_list(ROWS + [ROWS[1], {**ROWS[0], "question": "another"}])
    by_id = dataset_contexts(repeated, id_column="id")
    assert [(c.name, c.row, c.text) for c in by_id] == [(r["id"], i, r["context"]) for i, r in enumerate(ROWS)]
    by_hash = dataset_contexts(repeated)
    assert [c.name for c in by_hash] == [hashlib.sha256(r["context"].encode()).hexdigest()[:16] for r in ROWS]
    assert by_hash[2].sha256 == hashlib.sha256(ROWS[2]["context"].encode()).hexdigest()
    numbered = datasets.Dataset.from_dict({"n": [7, 8], "text": ["a", "b"]})
    assert [c.name for c in dataset_contexts(numbered, "text", "n")] == ["7", "8"]


@pytest.mark.parametrize(
    "table, kwargs, error, message",
    [
        ({"context": ["a"]}, {"text_column": "text"}, ValueError, r"text_column 'text' is not a column.*\['context'\]"),
        ({"context": ["a"]}, {"id_column": "id"}, ValueError, r"id_column 'id' is not a column"),
        ({"context": ["a", " \n"]}, {}, ValueError, r"row 1: column 'context' must hold a non-empty text"),
        ({"context": ["a", "b"], "id": ["x", "x"]}, {"id_column": "id"}, ValueError, r"rows 0 and 1 have the same"),
        ({"context": ["a"], "id": ["a/b"]}, {"id_column": "id"}, ValueError, r"row 0: 'id' value 'a/b' is not usable"),
        ({"context": ["a"], "id": [".hidden"]}, {"id_column": "id"}, ValueError, r"not usable as a folder name"),
        ({"context": ["a"], "id": [MANIFEST_NAME]}, {"id_column": "id"}, ValueError, r"reserved for the manifest"),
    ],
)
def test_dataset_contexts_rejects_bad_columns(table, kwargs, error, message):
    with pytest.raises(error, match=message):
        dataset_contexts(datasets.Dataset.from_dict(table), **kwargs)


def test_dataset_contexts_refuses_a_dataset_without_rows():
    with pytest.raises(ValueError, match="dataset has no rows"):
        dataset_contexts(datasets.Dataset.from_dict({"context": []}))


def test_dataset_contexts_needs_a_dataset(rows):
    with pytest.raises(TypeError, match=r"must be a datasets.Dataset, got DatasetDict.*dataset\['train'\]"):
        dataset_contexts(datasets.DatasetDict({"train": rows}))


# ---------------------------------------------------------------------------------------------------- one document
def assert_same_kept_entries(cache, reference) -> None:
    """Two compacted caches store the same kept keys, values, biases and per-head offsets in every layer."""
    for mine, theirs in zip(cache.layers, reference.layers, strict=True):
        for name in ("prefix_keys", "prefix_values", "prefix_bias", "prefix_offsets"):
            torch.testing.assert_close(getattr(mine, name), getattr(theirs, name))


def test_compact_document_uses_the_chat_template(llama):
    model, tokenizer = llama
    cache = compact_document(model, tokenizer, document(0), **SETTINGS)
    context_text, suffix = document_chat_prompt(tokenizer, document(0))
    assert suffix == "<|end|><|assistant|>" and cache.metadata["question_suffix"] == suffix
    reference = compact(model, tokenizer, context_text, self_study=SelfStudy(turn_suffix=suffix), **SETTINGS)
    assert cache.original_length == reference.original_length == len(context_text) - len("<|user|>") + 1
    assert_same_kept_entries(cache, reference)


def test_compact_document_keeps_the_chat_scaffold_whole_with_keep_template(llama):
    model, tokenizer = llama
    cache = compact_document(model, tokenizer, document(0), keep_template=True, ratio=4.0, method="streaming_llm")
    opening, body, suffix = document_chat_parts(tokenizer, document(0))
    reference = compact(model, tokenizer, body, ratio=4.0, method="streaming_llm", prefix=opening)
    assert cache.metadata["chunking"]["prefix_tokens"] == len(opening) - len("<|user|>") + 1 > 0
    assert cache.metadata["question_suffix"] == suffix and cache.original_length == reference.original_length
    assert_same_kept_entries(cache, reference)
    with pytest.raises(ValueError, match="pass it or prefix=, not both"):
        compact_document(model, tokenizer, document(0), keep_template=True, prefix="x", ratio=4.0)
    with pytest.raises(TypeError, match="keep_template must be True or False"):
        compact_document(model, tokenizer, document(0), keep_template="yes", ratio=4.0)
    with pytest.raises(ValueError, match="keep_template=True needs a tokenizer with a chat template"):
        compact_document(model, chat_tokenizer(chat_template=None), document(0), keep_template=True, ratio=4.0)


def test_compact_document_without_a_chat_template_compacts_the_text():
    tokenizer = chat_tokenizer(chat_template=None)
    cache = compact_document(tiny_model("llama"), tokenizer, document(0), ratio=4.0, method="streaming_llm")
    assert cache.original_length == len(document(0)) and "question_suffix" not in cache.metadata


# ---------------------------------------------------------------------------------------------------- many documents
def test_two_processes_compact_each_context_once(tmp_path, llama, counted_compactions):
    model, tokenizer = llama
    repeated = datasets.Dataset.from_list(ROWS + [ROWS[2]])  # a repeated context is compacted once
    first = compact_dataset(model, tokenizer, repeated, tmp_path, id_column="id", process_index=0, num_processes=2)
    assert [r["id"] for r in first] == ["doc0", "doc2"] and len(counted_compactions) == 2
    second = compact_dataset(model, tokenizer, repeated, tmp_path, id_column="id", process_index=1, num_processes=2)
    assert [r["id"] for r in second] == ["doc1", "doc3"] and len(counted_compactions) == 4
    assert sorted(counted_compactions) == sorted(document_chat_prompt(tokenizer, r["context"])[0] for r in ROWS)
    assert len(list(tmp_path.glob("manifest.part-*.jsonl"))) == 2
    records = merge_manifest(tmp_path, num_processes=2)
    assert records == manifest(tmp_path) == sorted(first + second, key=lambda r: r["row"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc0", "doc1", "doc2", "doc3", MANIFEST_NAME]


def test_manifest_describes_every_saved_cache(tmp_path, llama):
    model, tokenizer = llama
    records = compact_all(model, tokenizer, datasets.Dataset.from_list(ROWS), tmp_path)
    assert [(r["id"], r["row"], r["folder"], r["reused"]) for r in records] == [
        (f"doc{i}", i, f"doc{i}", False) for i in range(4)
    ]
    for record, row in zip(records, ROWS, strict=True):
        folder = tmp_path / record["folder"]
        assert sorted(p.name for p in folder.iterdir()) == sorted(CACHE_FILES)
        cache = CompactedCache.load(folder, model=model, tokenizer=tokenizer)
        context_text, suffix = document_chat_prompt(tokenizer, row["context"])
        ids = tokenizer(context_text, add_special_tokens=False).input_ids
        assert cache.original_length == record["length"] == len(ids)
        assert cache.head_lengths() == [[record["length"] // 4] * 2] * 2
        assert record["bytes"] == cache.nbytes() and record["full_bytes"] == cache.full_nbytes()
        assert record["heldout_relative_loss"] == cache.metadata["quality"]["heldout_relative_loss_mean"]
        assert 0 < record["heldout_relative_loss"] < 1 and record["seconds"] > 0
        assert cache.metadata["question_suffix"] == suffix and cache.metadata["method"] == "kv_surgeon"
        assert cache.metadata["dataset"] == {
            "id": row["id"],
            "row": record["row"],
            "text_sha256": hashlib.sha256(row["context"].encode()).hexdigest(),
            "settings": SETTINGS,
            "seconds": record["seconds"],
        }


def test_rerun_skips_complete_folders_and_redoes_partial_ones(tmp_path, llama, counted_compactions):
    model, tokenizer = llama
    rows = datasets.Dataset.from_list(ROWS)
    compact_all(model, tokenizer, rows, tmp_path, num_processes=2)
    written = {name: (tmp_path / name / "cache.safetensors").stat().st_mtime_ns for name in ("doc0", "doc3")}
    (tmp_path / "doc1" / "cache.safetensors").unlink()  # a folder cut short (not written by compact_dataset)
    (tmp_path / ".partial").mkdir()
    (tmp_path / "doc2").rename(tmp_path / ".partial" / "doc2")  # killed before its rename
    (tmp_path / ".partial" / "doc2" / "config.json").unlink()
    counted_compactions.clear()
    records = compact_all(model, tokenizer, rows, tmp_path, num_processes=2)
    assert len(counted_compactions) == 2
    assert [r["reused"] for r in records] == [True, False, False, True]
    assert {name: (tmp_path / name / "cache.safetensors").stat().st_mtime_ns for name in written} == written
    assert not (tmp_path / ".partial").exists()
    for record in records:
        CompactedCache.load(tmp_path / record["folder"], model=model, tokenizer=tokenizer)


def test_rerun_refuses_folders_made_otherwise(tmp_path, llama, rows):
    model, tokenizer = llama
    compact_all(model, tokenizer, rows, tmp_path)
    with pytest.raises(ValueError, match=r"doc0 already holds a compacted cache made from compaction settings"):
        compact_all(model, tokenizer, rows, tmp_path, ratio=2.0, method="kv_surgeon")
    changed = datasets.Dataset.from_list([{**ROWS[0], "context": "Another text."}])
    with pytest.raises(ValueError, match=r"made from another text than row 0's: delete it, or write to another"):
        compact_all(model, tokenizer, changed, tmp_path)
    with pytest.raises(ValueError, match=r"another model or tokenizer \(num_hidden_layers"):
        compact_all(tiny_model("llama", num_hidden_layers=3), tokenizer, rows, tmp_path)


def test_settings_record_objects_by_their_description(tmp_path, llama, rows):
    model, tokenizer = llama
    study = SelfStudy(answer_tokens=4, question_tokens=4, greedy=True)
    compact_all(model, tokenizer, rows.select([0]), tmp_path, ratio=4.0, method="streaming_llm", self_study=study)
    settings = CompactedCache.load(tmp_path / "doc0").metadata["dataset"]["settings"]
    assert settings == {"method": "streaming_llm", "ratio": 4.0, "self_study": study.describe()}


@pytest.mark.parametrize(
    "index, count, error, message",
    [
        (2, 2, ValueError, r"process_index must be an integer in \[0, 1\], got 2"),
        (0, 0, ValueError, r"num_processes must be an integer >= 1, got 0"),
        (True, 2, TypeError, r"process_index must be an integer in \[0, 1\], got True"),
        (0, 2.0, TypeError, r"num_processes must be an integer >= 1, got 2.0"),
    ],
)
def test_compact_dataset_checks_process_arguments(tmp_path, llama, rows, index, count, error, message):
    with pytest.raises(error, match=message):
        compact_dataset(*llama, rows, tmp_path, process_index=index, num_processes=count)


def test_merge_manifest_needs_every_part(tmp_path, llama, rows):
    compact_dataset(*llama, rows, tmp_path, id_column="id", process_index=1, num_processes=2, **SETTINGS)
    with pytest.raises(ValueError, match=r"lacks the part manifests \['manifest.part-00000-of-00002.jsonl'\]"):
        merge_manifest(tmp_path, num_processes=2)


# ---------------------------------------------------------------------------------------------------- command line
def test_compact_dataset_options():
    args = build_parser().parse_args(["compact-dataset", "--data", "d.jsonl", "--out", "o"])
    assert (args.data, args.split, args.text_column, args.id_column) == ("d.jsonl", None, "context", None)
    assert args.ratio is None  # --ratio 8 unless --max-loss, applied by compaction_kwargs
    assert (args.model, compaction_kwargs(args)["ratio"], args.method, args.queries, args.budgets) == (
        "default",
        8.0,
        "kv_surgeon",
        "repeat",
        "auto",
    )
    assert (args.chunk_tokens, args.on_policy, args.query_cap) == (None, False, 4096)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """The tiny llama and the character tokenizer saved as a local model folder (what ``--model`` accepts)."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    tiny_model("llama").save_pretrained(folder)
    chat_tokenizer().save_pretrained(folder)
    return folder


def test_accelerate_launch_with_two_cpu_processes_then_resume(tmp_path, rows, model_folder):
    """Two CPU processes (gloo) share the rows; a plain rerun (one process) then reuses every folder."""
    data, out = tmp_path / "rows.jsonl", tmp_path / "caches"
    rows.to_json(data)
    options = ["--model", str(model_folder), "--data", str(data), "--id-column", "id", "--out", str(out)]
    options += ["--ratio", "4"]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    launch += ["--main_process_port", str(free_port())]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf_datasets")}
    result = subprocess.run(
        launch + ["-m", "hf_structkv.cli", "compact-dataset", *options],
        capture_output=True,
        text=True,
        timeout=240,
        env=environment,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compact-dataset 1/2" in result.stderr and "compact-dataset 2/2" in result.stderr
    assert f"4 contexts (0 already done) -> {out / MANIFEST_NAME}" in result.stdout
    records = manifest(out)
    assert [r["id"] for r in records] == ["doc0", "doc1", "doc2", "doc3"]
    assert sorted(p.name for p in out.iterdir()) == ["doc0", "doc1", "doc2", "doc3", MANIFEST_NAME]
    for record in records:
        assert CompactedCache.load(out / record["folder"]).original_length == record["length"]
    stored, full = sum(r["bytes"] for r in records), sum(r["full_bytes"] for r in records)
    assert f"stored {stored:,} bytes vs {full:,} full ({full / stored:.2f}x)" in result.stdout

    printed = run_cli(["compact-dataset", *options])
    assert f"4 contexts (4 already done) -> {out / MANIFEST_NAME}" in printed
    assert manifest(out) == [{**record, "reused": True} for record in records]
