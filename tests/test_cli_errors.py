"""``hf-structkv`` refuses bad input before any work, naming the argument and the fix, in one line with exit status 2
(issue 34, defects 9 and 10); ``--debug`` shows the traceback instead."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

import hf_structkv.cli as cli
from hf_structkv.cli import main


@pytest.fixture(autouse=True)
def no_model(monkeypatch):
    """Every refusal here comes before a model is loaded: loading one fails the test."""

    def load_model(name, dtype):
        raise AssertionError(f"model {name!r} loaded before the bad input was refused")

    monkeypatch.setattr(cli, "load_model", load_model)


def refused_by_the_parser(capsys, argv: list[str]) -> str:
    """``main(argv)`` exits 2 from argparse; its last stderr line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def refused_at_run_time(capsys, argv: list[str]) -> str:
    """``main(argv)`` returns 2 and prints exactly one stderr line, ``hf-structkv: error: ...`` (no traceback)."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hf-structkv: error: "), captured.err
    assert captured.out == ""
    return lines[0]


# ---------------------------------------------------------------------------------------------------- parser
@pytest.mark.parametrize(
    "argv, message",
    [
        (["compact", "--squad-paragraphs", "0"], r"argument --squad-paragraphs: must be an integer >= 1, got '0'"),
        (["compact", "--squad-paragraphs", "-1"], r"argument --squad-paragraphs: must be an integer >= 1, got '-1'"),
        (["compact", "--squad-paragraphs", "two"], r"argument --squad-paragraphs: must be an integer >= 1, got 'two'"),
        (["compact", "--chunk-tokens", "0"], r"argument --chunk-tokens: must be an integer >= 1, got '0'"),
        (["compact", "--chunk-tokens", "1.5"], r"argument --chunk-tokens: must be an integer >= 1, got '1.5'"),
        (["compact", "--query-cap", "0"], r"argument --query-cap: must be an integer >= 1, got '0'"),
        (["compact", "--model", "/nonexistent"], r"argument --model: '/nonexistent' does not exist; pass 'default'"),
        (["compact", "--model", "./my-model"], r"argument --model: './my-model' does not exist; pass 'default' or"),
        (["head-budgets", "--squad-paragraphs", "0"], r"argument --squad-paragraphs: must be an integer >= 1"),
        (["head-budgets", "--quotes", "-1"], r"argument --quotes: must be an integer >= 0, got '-1'"),
        (["head-budgets", "--fractions", "0,a"], r"argument --fractions: takes comma-separated numbers .* got '0,a'"),
        (["generate", "--cache", "c", "--question", ""], r"argument --question: must hold a question, got ''"),
        (["generate", "--cache", "c", "--question", "a", "--question", " \n"], r"must hold a question, got ' \\n'"),
        (["generate", "--cache", "c", "--question", "a", "--max-new-tokens", "0"], r"--max-new-tokens: must be an"),
        (["calibrate", "--window", "0"], r"argument --window: must be an integer >= 1, got '0'"),
        (["calibrate", "--calibration-cases", "-2"], r"argument --calibration-cases: must be an integer >= 1"),
        (["calibrate", "--threads", "0"], r"argument --threads: must be an integer >= 1, got '0'"),
    ],
)
def test_bad_numbers_texts_and_model_paths_are_refused_by_the_parser(capsys, tmp_path, argv, message):
    out = [] if argv[0] == "generate" else ["--out", str(tmp_path / "out")]
    line = refused_by_the_parser(capsys, [*argv, *out])
    assert re.search(message, line), line


def test_a_model_file_is_not_a_model_folder(capsys, tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    line = refused_by_the_parser(capsys, ["compact", "--model", str(weights), "--out", str(tmp_path / "out")])
    assert line.endswith(
        f"argument --model: {str(weights)!r} is a file; pass 'default' or a local transformers model folder"
    )


# ---------------------------------------------------------------------------------------------------- files
@pytest.mark.parametrize(
    "content, problem",
    [
        (b"", "is empty; it must hold the text to read"),
        (b" \n\t\n", "is empty; it must hold the text to read"),
        (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "is not UTF-8 text (invalid start byte at byte 0); pass a UTF-8 text file"),
    ],
)
def test_an_empty_or_binary_context_file_is_refused_naming_it(capsys, tmp_path, content, problem):
    path = tmp_path / "context.txt"
    path.write_bytes(content)
    line = refused_at_run_time(capsys, ["compact", "--context-file", str(path), "--out", str(tmp_path / "out")])
    assert line == f"hf-structkv: error: --context-file {str(path)!r} {problem}"
    assert not (tmp_path / "out").exists()


def test_a_missing_context_or_text_file_is_refused_naming_the_option(capsys, tmp_path):
    missing = str(tmp_path / "missing.txt")
    line = refused_at_run_time(capsys, ["compact", "--context-file", missing, "--out", str(tmp_path / "out")])
    assert line == f"hf-structkv: error: --context-file {missing!r} is not a file; pass a UTF-8 text file"
    good = tmp_path / "good.txt"
    good.write_text("Some text.", encoding="utf-8")
    argv = ["head-budgets", "--text-file", str(good), "--text-file", missing, "--out", str(tmp_path / "out")]
    line = refused_at_run_time(capsys, argv)
    assert line == f"hf-structkv: error: --text-file {missing!r} is not a file; pass a UTF-8 text file"


@pytest.mark.parametrize("command", ["compact", "head-budgets", "compact-dataset", "calibrate"])
def test_a_bad_out_is_reported_before_any_work(capsys, tmp_path, command):
    """An existing file, or a folder under a file: refused before the context is read or the model loaded."""
    existing = tmp_path / "taken"
    existing.write_text("not a folder")
    extra = ["--data", str(tmp_path / "rows.jsonl")] if command == "compact-dataset" else []
    line = refused_at_run_time(capsys, [command, *extra, "--out", str(existing)])
    assert (
        line
        == f"hf-structkv: error: --out {str(existing)!r} is an existing file; pass a folder (it is made when missing)"
    )
    under = existing / "sub" / "cache"
    line = refused_at_run_time(capsys, [command, *extra, "--out", str(under)])
    assert line == f"hf-structkv: error: --out {str(under)!r} lies under the file {str(existing)!r}; pass a folder"


# ---------------------------------------------------------------------------------------------------- runtime errors
def test_a_missing_or_empty_data_file_fails_at_once(capsys, tmp_path):
    """Issue 34: ``--data missing.jsonl`` waited 27 s for the Hub, then raised ConnectionError; an empty one raised a
    bare StopIteration."""
    missing = str(tmp_path / "missing.jsonl")
    line = refused_at_run_time(capsys, ["compact-dataset", "--data", missing, "--out", str(tmp_path / "out")])
    assert line.startswith(f"hf-structkv: error: data {missing!r} does not exist: pass a .json/.jsonl/")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    line = refused_at_run_time(capsys, ["compact-dataset", "--data", str(empty), "--out", str(tmp_path / "out")])
    assert line == f"hf-structkv: error: data file {str(empty)!r} is empty: it must hold one row per context"


def test_a_library_error_is_one_line_and_debug_shows_the_traceback(capsys, tmp_path):
    missing = str(tmp_path / "no_cache")
    line = refused_at_run_time(capsys, ["info", missing])
    assert missing in line
    with pytest.raises(ValueError, match="no_cache"):
        main(["--debug", "info", missing])


def test_a_model_id_missing_from_the_local_cache_is_one_line(capsys, tmp_path, monkeypatch):
    """A Hub-style ``--model`` name is looked up in the local cache only; its OSError is printed as one line."""
    monkeypatch.undo()  # the real load_model
    context = tmp_path / "context.txt"
    context.write_text("Some text.", encoding="utf-8")
    argv = ["compact", "--model", "nobody/no-such-model", "--context-file", str(context), "--out", str(tmp_path / "o")]
    line = refused_at_run_time(capsys, argv)
    assert line.startswith(
        "hf-structkv: error: --model 'nobody/no-such-model' is no local folder and is not in the local"
    )


def test_the_console_script_prints_one_line_and_exits_2(tmp_path):
    script = Path(sys.executable).parent / "hf-structkv"
    missing = str(tmp_path / "no_cache")
    result = subprocess.run([str(script), "info", missing], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("hf-structkv: error: ") and result.stderr.count("\n") == 1, result.stderr
    debug = subprocess.run([str(script), "--debug", "info", missing], capture_output=True, text=True, timeout=120)
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr
