"""The ``hf-structkv`` command line: compact, generate, info (slow ones run the embedded default model)."""

import contextlib
import io
import json
import re
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from hf_structkv import CompactedCache
from hf_structkv.cache.compacted_files import CACHE_FILES
from hf_structkv.cli import DTYPES, build_parser, compaction_kwargs, load_model, main, read_context
from hf_structkv.compaction import prefill_context
from hf_structkv.compaction.budgets import default_head_budgets
from hf_structkv.eval.squad import squad_document
from hf_structkv.generation import generation_inputs
from hf_structkv.models import tiny_model
from hf_structkv.prompts import document_chat_prompt, question_text

QUESTION = "In what country is Normandy located?"


def run_cli(argv: list[str]) -> str:
    """``main(argv)`` (must return 0); its stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue()


def number(pattern: str, text: str) -> int:
    """The integer (with thousands separators) that ``pattern``'s group matches in ``text``."""
    match = re.search(pattern, text)
    assert match, (pattern, text)
    return int(match.group(1).replace(",", ""))


def context_ids(tokenizer, paragraphs: int = 2) -> tuple[torch.Tensor, str]:
    context_text, suffix = document_chat_prompt(tokenizer, squad_document("Normans", paragraphs).text)
    return tokenizer(context_text, return_tensors="pt", add_special_tokens=False).input_ids, suffix


@pytest.fixture(scope="module")
def compacted(tmp_path_factory):
    """A 2-paragraph Normans cache compacted 4x by the CLI: ``(folder, printed text)``."""
    out = tmp_path_factory.mktemp("cli") / "normans"
    printed = run_cli(["compact", "--squad-paragraphs", "2", "--ratio", "4", "--out", str(out)])
    return out, printed


# ---------------------------------------------------------------------------------------------------- parser
@pytest.mark.parametrize(
    "command, options",
    [
        (None, ["compact", "generate", "info"]),
        (
            "compact",
            [
                "--model",
                "--dtype",
                "--context-file",
                "--squad-article",
                "--squad-paragraphs",
                "--ratio",
                "--method",
                "--on-policy",
                "--query-cap",
                "--queries",
                "--budgets",
                "--chunk-tokens",
                "--out",
                "--push",
                "--private",
            ],
        ),
        ("generate", ["--model", "--dtype", "--cache", "--question", "--max-new-tokens"]),
        ("info", ["cache"]),
    ],
)
def test_help_exits_0_and_lists_the_options(capsys, command, options):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"] if command else ["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: hf-structkv {command or ''}".rstrip())
    for option in options:
        assert option in text, option


@pytest.mark.parametrize(
    "argv, message",
    [
        (["compact", "--dtype", "int8", "--out", "x"], r"argument --dtype: invalid choice: 'int8'"),
        (["generate", "--dtype", "fp16", "--cache", "x", "--question", "q"], r"argument --dtype: invalid choice"),
        (["compact"], r"the following arguments are required: --out"),
        (["compact", "--out", "x", "--ratio", "four"], r"argument --ratio: invalid float value: 'four'"),
        (
            ["compact", "--out", "x", "--context-file", "a.txt", "--squad-article", "Southern_California"],
            r"argument --squad-article: not allowed with argument --context-file",
        ),
        (["generate", "--cache", "x"], r"the following arguments are required: --question"),
        (["info"], r"the following arguments are required: cache"),
        (["compact", "--out", "x", "--queries", "ruler"], r"argument --queries: invalid choice: 'ruler'"),
        (["compact", "--out", "x", "--chunk-tokens", "1.5"], r"argument --chunk-tokens: must be an integer >= 1"),
        ([], r"the following arguments are required: command"),
    ],
)
def test_bad_arguments_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)


def test_parser_defaults():
    args = build_parser().parse_args(["compact", "--out", "o"])
    assert (args.model, args.dtype, args.squad_article, args.squad_paragraphs) == ("default", "float32", "Normans", 20)
    assert (compaction_kwargs(args)["ratio"], args.method, args.context_file) == (8.0, "kv_surgeon", None)
    assert (args.ratio, args.max_loss, args.storage) == (None, None, "bf16")  # --ratio 8 unless --max-loss
    assert (args.on_policy, args.query_cap) == (False, 4096)
    assert (args.queries, args.budgets, args.chunk_tokens, args.keep_template) == ("repeat", "auto", None, False)
    assert (args.push, args.private) == (None, False)
    kept = build_parser().parse_args(["compact-dataset", "--data", "d", "--out", "o", "--keep-template"])
    assert compaction_kwargs(kept)["keep_template"] is True
    args = build_parser().parse_args(["generate", "--cache", "c", "--question", "a", "--question", "b"])
    assert args.question == ["a", "b"] and args.max_new_tokens == 48
    assert sorted(DTYPES) == ["bfloat16", "float16", "float32"] and DTYPES["bfloat16"] is torch.bfloat16


def test_read_context(tmp_path):
    path = tmp_path / "context.txt"
    path.write_text("Ünïcode context.\n", encoding="utf-8")
    assert read_context(Namespace(context_file=str(path), squad_article="Normans", squad_paragraphs=3)) == (
        "Ünïcode context.\n"
    )
    squad = read_context(Namespace(context_file=None, squad_article="Normans", squad_paragraphs=3))
    assert squad == squad_document("Normans", 3).text


def test_console_script_help():
    script = Path(sys.executable).parent / "hf-structkv"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: hf-structkv")
    assert all(command in result.stdout for command in ("compact", "generate", "info"))


class ChatCharTokenizer:
    """A chat template and one id per character: enough for `cmd_compact` on a tiny model."""

    chat_template = "tiny"
    eos_token_id = None
    all_special_tokens = []

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return f"<u>{messages[0]['content']}</u><a>"

    def __call__(self, text, return_tensors=None, add_special_tokens=False):
        return type("Encoding", (), {"input_ids": torch.tensor([[3 + ord(ch) % 250 for ch in text]])})()

    def get_vocab(self):
        return {chr(i): 3 + i % 250 for i in range(256)}


def test_compact_passes_queries_budgets_and_chunks_to_compact(tmp_path, monkeypatch):
    import hf_structkv.cli as cli

    monkeypatch.setattr(cli, "load_model", lambda name, dtype: (tiny_model("llama"), ChatCharTokenizer()))
    context = tmp_path / "context.txt"
    context.write_text("The Normans were in Normandy. " * 3, encoding="utf-8")
    out = tmp_path / "cache"
    argv = ["compact", "--context-file", str(context), "--ratio", "5", "--queries", "self_study"]
    run_cli([*argv, "--chunk-tokens", "40", "--budgets", "uniform", "--out", str(out)])
    cache = CompactedCache.load(out)
    assert cache.metadata["calibration"]["queries"] == "self_study"
    assert cache.metadata["calibration"]["self_study"]["turn_suffix"] == "</u><a>"
    assert cache.metadata["chunking"]["chunk_tokens"] == 40
    assert cache.metadata["chunking"]["chunk_spans"] == [[0, 32], [32, 64], [64, 95]]  # "<u>" + 90 + "\n\n"
    assert cache.metadata["budgets"]["source"] == "uniform"


# ---------------------------------------------------------------------------------------------------- model runs
@pytest.mark.slow
def test_load_model_from_a_local_folder(tmp_path, default_model):
    tiny_model("qwen2").save_pretrained(tmp_path)
    default_model[1].save_pretrained(tmp_path)
    model, tokenizer = load_model(str(tmp_path), torch.bfloat16)
    assert model.dtype == torch.bfloat16 and not model.training
    assert model.config.model_type == "qwen2" and model.config.hidden_size == 64
    assert tokenizer.get_vocab() == default_model[1].get_vocab() and tokenizer.chat_template


@pytest.mark.slow
def test_compact_writes_the_cache_and_prints_its_bytes(compacted, default_model):
    folder, printed = compacted
    assert sorted(p.name for p in folder.iterdir()) == sorted(CACHE_FILES)
    cache = CompactedCache.load(folder)
    ids, suffix = context_ids(default_model[1])
    length = ids.shape[1]
    assert cache.original_length == length
    shipped = default_head_budgets(default_model[0]).token_budgets(4.0, length)  # budgets="auto" on this model
    assert cache.head_lengths() == [[max(1, n) for n in shipped[i]] for i in range(24)]
    assert cache.metadata["budgets"]["source"] == "shipped"
    assert cache.metadata["question_suffix"] == suffix
    assert cache.metadata["method"] == "kv_surgeon" and cache.metadata["hyperparameters"]["ratio"] == 4.0
    assert cache.metadata["calibration"]["on_policy"] is False
    assert 0 <= cache.metadata["quality"]["heldout_relative_loss_mean"] < 1
    assert number(r"compacted (\d+) tokens in [\d.]+ s -> ", printed) == length
    assert printed.splitlines()[0].endswith(f"-> {folder}")
    assert number(r"stored ([\d,]+) bytes", printed) == cache.nbytes()
    assert number(r"bytes vs ([\d,]+) full", printed) == cache.full_nbytes()
    assert f"({cache.full_nbytes() / cache.nbytes():.2f}x)" in printed
    assert 3.5 < cache.full_nbytes() / cache.nbytes() < 4


@pytest.mark.slow
def test_info_prints_metadata_length_and_bytes(compacted, capsys):
    folder, _ = compacted
    assert main(["info", str(folder)]) == 0
    printed = capsys.readouterr().out
    cache = CompactedCache.load(folder)
    head, _, tail = printed.partition("original length")
    config = json.loads(head)
    assert "layers" not in config
    assert config["original_length"] == cache.original_length and config["method"] == "kv_surgeon"
    assert config["fingerprint"]["num_hidden_layers"] == 24
    assert number(r"original length\s+(\d+)", printed) == cache.original_length
    kept = sum(n for layer in cache.head_lengths() if layer for n in layer)
    assert number(r"kept entries \(global layers, all heads\) ([\d,]+)", printed) == kept
    assert number(r"stored bytes\s+([\d,]+)", printed) == cache.nbytes()
    assert number(r"biases \+ offsets ([\d,]+)", printed) == cache.overhead_nbytes()
    assert number(r"full DynamicCache\s+([\d,]+)", printed) == cache.full_nbytes()
    assert f"({cache.full_nbytes() / cache.nbytes():.2f}x smaller)" in tail


@pytest.mark.slow
def test_generate_from_a_keep_everything_cache_answers_like_the_full_prompt(tmp_path, default_model, capsys):
    """At ratio 1 every entry is kept, so the CLI's answer is the model's greedy answer on the whole prompt."""
    folder = tmp_path / "all"
    run_cli(["compact", "--squad-paragraphs", "2", "--ratio", "1", "--out", str(folder)])
    questions = [QUESTION, "When were the Normans in Normandy?"]
    argv = ["generate", "--cache", str(folder), "--max-new-tokens", "8"]
    assert main(argv + [arg for q in questions for arg in ("--question", q)]) == 0
    printed = capsys.readouterr().out
    answer_line = r"Q: (.*)\nA: (\S.*)  \(\d+\.\d s\)\n"
    assert re.fullmatch(f"({answer_line}){{2}}", printed), printed
    pairs = re.findall(answer_line, printed)
    assert [q for q, _ in pairs] == [repr(q) for q in questions]
    model, tokenizer = default_model
    ids, suffix = context_ids(tokenizer)
    question_ids = tokenizer(question_text(QUESTION, suffix), return_tensors="pt", add_special_tokens=False).input_ids
    cache = prefill_context(model, ids)
    inputs = generation_inputs(cache, question_ids)
    with torch.no_grad():
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=8, do_sample=False)
    expected = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).strip()
    assert pairs[0][1] == expected
    assert "France" in expected


@pytest.mark.slow
def test_compact_a_context_file(tmp_path, default_model):
    path = tmp_path / "context.txt"
    path.write_text("The Normans gave their name to Normandy, a region in France.", encoding="utf-8")
    folder = tmp_path / "file_cache"
    printed = run_cli(
        ["compact", "--context-file", str(path), "--ratio", "2", "--budgets", "uniform", "--out", str(folder)]
    )
    tokenizer = default_model[1]
    context_text, _ = document_chat_prompt(tokenizer, path.read_text(encoding="utf-8"))
    length = tokenizer(context_text, add_special_tokens=False, return_tensors="pt").input_ids.shape[1]
    cache = CompactedCache.load(folder)
    assert cache.original_length == length == number(r"compacted (\d+) tokens", printed)
    assert cache.head_lengths()[0] == [length // 2] * 2
