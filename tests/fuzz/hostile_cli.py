"""The fixed catalogue of hostile ``hf-structkv`` command lines, run in-process (``cli.main``) with the tiny Llama
and a character tokenizer in place of the real model: bad numbers, files (empty, binary, missing, a folder, an
endless device), folders holding other artifacts, another model's cache or budgets, unusable datasets.

A command line is refused when argparse exits 2 naming the option, or ``main`` returns 2 after printing one line
``hf-structkv: error: ...`` naming it; it is handled when it exits 0 and did what it says (the saved cache loads,
the answer is printed). An exception that escapes ``main`` is unhelpful (a traceback)."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
from collections.abc import Callable
from pathlib import Path
from unittest import mock

from hostile_artifacts import Artifacts
from hostile_outcomes import Case, TimeBoundExceeded
from test_cli import ChatCharTokenizer

import hf_structkv.cli as cli
from hf_structkv import CompactedCache
from hf_structkv.compaction.budgets import HeadBudgets
from hf_structkv.models import tiny_model

RUNS = itertools.count()
CONTEXT = "The Normans were in Normandy in the 10th and 11th centuries. They gave their name to it. " * 2


class CharTokenizer(ChatCharTokenizer):
    """`ChatCharTokenizer` that also decodes (``hf-structkv generate`` prints the answer)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr((int(i) - 3) % 250) for i in ids)


def run_cli(argv: list[str], model: Callable = lambda: tiny_model("llama")) -> tuple[int, str, str]:
    """``(exit status, stdout, stderr)`` of ``main(argv)`` with ``load_model`` giving ``model()`` and the character
    tokenizer. Raises ``ValueError`` (the error line) for a refusal, ``RuntimeError`` for a refusal without its
    ``error:`` line or with a traceback, and for an exception escaping ``main``."""
    out, err = io.StringIO(), io.StringIO()
    with (
        mock.patch.object(cli, "load_model", lambda name, dtype: (model(), CharTokenizer())),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        try:
            status = cli.main(argv)
        except SystemExit as exit_info:
            status = exit_info.code
        except (MemoryError, TimeBoundExceeded):
            raise
        except Exception as escaped:  # noqa: BLE001 - a traceback is the unhelpful outcome
            raise RuntimeError(f"{type(escaped).__name__} escaped main: {escaped}") from None
    if status == 2:
        lines = err.getvalue().strip().splitlines()  # progress bars may come first
        last = lines[-1] if lines else ""
        if "Traceback" in err.getvalue() or not (last.startswith("hf-structkv: error: ") or ": error: " in last):
            raise RuntimeError(f"exit 2 without a one-line error: {err.getvalue()[-300:]}")
        raise ValueError(last)
    if status != 0:
        raise RuntimeError(f"exit {status}: {err.getvalue()[-300:]}")
    return status, out.getvalue(), err.getvalue()


def cli_cases(arts: Artifacts, work: Path) -> list[Case]:
    files = cli_inputs(arts, work)
    cases = []

    def add(target: str, label: str, argv: Callable[[Path], list[str]], judge, words: tuple[str, ...], **kw):
        def run():
            folder = work / f"cli-{next(RUNS)}"
            folder.mkdir(parents=True)
            _, stdout, _ = run_cli(argv(folder), **kw)
            return judge(folder, stdout)

        cases.append(Case("cli", f"hf-structkv {target}", label, run, words))

    compact = ["compact", "--context-file", str(files["context"]), "--ratio", "4"]
    for label, name in (
        ("empty", "empty"),
        ("white space", "blank"),
        ("binary", "binary"),
        ("missing", "missing"),
        ("a folder", "folder"),
        ("/dev/zero", "zero"),
        ("a pipe", "pipe"),
        ("UTF-16", "utf16"),
    ):
        add(
            "compact",
            f"--context-file {label}",
            lambda f, n=name: ["compact", "--context-file", str(files[n]), "--out", str(f / "o")],
            _saved_cache,
            ("--context-file",),
        )
    budgets_folders = {
        "a policy folder": arts.root / "table",
        "another model's budgets": files["qwen_budgets"],
        "a corrupt budgets file": files["corrupt_budgets"],
        "a cache folder": arts.root / "cache",
    }
    for option, values in (
        ("--ratio", ("0", "-1", "nan", "inf", "1e308", "0.5", "four", "1e-300")),
        ("--chunk-tokens", ("0", "-1", "1", "1e3", str(10**30))),
        ("--query-cap", ("0", "1", str(10**30))),
        ("--method", ("nope", "")),
        ("--queries", ("nope",)),
        ("--squad-paragraphs", ("0", "-1", "x")),
        ("--budgets", ("nope", "uniform", "./missing-budgets", *budgets_folders)),
    ):
        for value in values:
            argument = str(budgets_folders.get(value, value))
            add(
                "compact",
                f"{option} {value!r}",
                lambda f, o=option, v=argument: [*compact, o, v, "--out", str(f / "o")],
                _saved_cache,
                (option, option.strip("-").replace("-", "_")),
            )
    for label, out in (
        ("an existing file", lambda f: str(files["context"])),
        ("under a file", lambda f: str(files["context"] / "x")),
        ("a policy folder", lambda f: str(_copy_of(arts, "table", f))),
        ("empty", lambda f: ""),
        ("a model folder", lambda f: str(files["model_folder"])),
    ):
        add(
            "compact",
            f"--out {label}",
            lambda f, o=out: [*compact, "--out", o(f)],
            _saved_cache,
            ("--out", "save_directory", "out"),
        )
    for label, model in (("/nonexistent", "/nonexistent"), ("a file", str(files["context"])), ("a/b/c", "a/b/c")):
        add(
            "compact",
            f"--model {label}",
            lambda f, m=model: [*compact, "--model", m, "--out", str(f / "o")],
            _saved_cache,
            ("--model",),
        )
    add(
        "compact",
        "--squad-article Nope",
        lambda f: ["compact", "--squad-article", "Nope", "--out", str(f / "o")],
        _saved_cache,
        ("--squad-article", "squad"),
    )
    add("compact", "a good context", lambda f: [*compact, "--out", str(f / "o")], _saved_cache, ())

    good_cache = files["good_cache"]
    generate = ["generate", "--question", "Where were the Normans?", "--max-new-tokens", "3"]
    caches = {
        "missing": "./missing-cache",
        "a policy folder": str(arts.root / "table"),
        "a budgets folder": str(arts.root / "budgets"),
        "a corrupt cache": str(files["corrupt_cache"]),
        "a file": str(files["context"]),
        "a good cache": str(good_cache),
    }
    generate_caches = {**caches, "nope/cache": "nope/cache", "a cache of another tokenizer": str(arts.root / "cache")}
    for label, cache in generate_caches.items():
        add(
            "generate",
            f"--cache {label}",
            lambda f, c=cache: [*generate, "--cache", c],
            _answered,
            ("--cache", "cache", "tokenizer"),
        )
    add(
        "generate",
        "--cache of a qwen3 model's cache",
        lambda f: [*generate, "--cache", str(good_cache)],
        _answered,
        ("--cache", "cache"),
        model=lambda: tiny_model("qwen3"),
    )
    for option, value in (
        ("--question", ""),
        ("--question", " \n"),
        ("--max-new-tokens", "0"),
        ("--max-new-tokens", "-1"),
        ("--max-new-tokens", "x"),
    ):
        add(
            "generate",
            f"{option} {value!r}",
            lambda f, o=option, v=value: [*generate, "--cache", str(good_cache), o, v],
            _answered,
            (option,),
        )

    for label, cache in {**caches, "''": ""}.items():
        add("info", label, lambda f, c=cache: ["info", c], _informed, ("cache", "path_or_repo_id"))

    budgets = ["head-budgets", "--text-file", str(files["context"]), "--max-answer-tokens", "4", "--query-cap", "64"]
    for value in ("", "nan", "-1", "2", "inf", "0,0", "0.5,x"):
        add(
            "head-budgets",
            f"--fractions {value!r}",
            lambda f, v=value: [*budgets, "--fractions", v, "--out", str(f / "o")],
            _saved_budgets,
            ("--fractions", "fractions"),
        )
    for option, value in (("--quotes", "-1"), ("--max-answer-tokens", "0"), ("--text-file", str(files["empty"]))):
        add(
            "head-budgets",
            f"{option} {value!r}",
            lambda f, o=option, v=value: [*budgets, o, v, "--out", str(f / "o")],
            _saved_budgets,
            (option,),
        )

    dataset = ["compact-dataset", "--ratio", "4"]
    for label, name in (
        ("missing.jsonl", "missing.jsonl"),
        ("empty.jsonl", "empty.jsonl"),
        ("not JSON", "bad.jsonl"),
        ("no context column", "nocolumn.jsonl"),
        ("an empty context", "emptyrow.jsonl"),
        ("a numeric context", "number.jsonl"),
        ("a good file", "good.jsonl"),
    ):
        add(
            "compact-dataset",
            f"--data {label}",
            lambda f, n=name: [*dataset, "--data", str(files["data"] / n), "--out", str(f / "o")],
            _saved_dataset,
            ("--data", "data", "context"),
        )
    add(
        "compact-dataset",
        "--text-column nope",
        lambda f: [
            *dataset,
            "--data",
            str(files["data"] / "good.jsonl"),
            "--text-column",
            "nope",
            "--out",
            str(f / "o"),
        ],
        _saved_dataset,
        ("nope", "text-column", "text_column"),
    )

    for option, value in (("--window", "0"), ("--threads", "0"), ("--calibration-cases", "-2")):
        add(
            "calibrate",
            f"{option} {value}",
            lambda f, o=option, v=value: ["calibrate", o, v, "--out", str(f / "o")],
            lambda f, s: "calibrated",
            (option,),
        )
    for label, argv in (("no command", []), ("an unknown command", ["nope"]), ("--debug alone", ["--debug"])):
        add("(none)", label, lambda f, a=argv: a, lambda f, s: "exit 0 without a command", ("command", "choice"))
    return cases


# ---------------------------------------------------------------------------------------------------- judges
def _saved_cache(folder: Path, stdout: str) -> str | None:
    cache = CompactedCache.load(folder / "o")
    return None if cache.original_length > 0 and "compacted" in stdout else "exit 0 without a loadable cache"


def _answered(folder: Path, stdout: str) -> str | None:
    return None if stdout.startswith("Q: ") and "\nA: " in stdout else f"exit 0 without an answer: {stdout[:100]!r}"


def _informed(folder: Path, stdout: str) -> str | None:
    return None if "original length" in stdout else "exit 0 without the cache's description"


def _saved_budgets(folder: Path, stdout: str) -> str | None:
    HeadBudgets.load(folder / "o")
    return None


def _saved_dataset(folder: Path, stdout: str) -> str | None:
    lines = (folder / "o" / "manifest.jsonl").read_text().splitlines()
    return None if len(lines) == 2 else f"manifest of {len(lines)} contexts for a file of 2"


# ---------------------------------------------------------------------------------------------------- inputs
def _copy_of(arts: Artifacts, kind: str, folder: Path) -> Path:
    return arts.copy(kind, folder / kind)


def cli_inputs(arts: Artifacts, work: Path) -> dict[str, Path]:
    """The files and folders the command lines name, made once."""
    root = work / "cli-inputs"
    root.mkdir(parents=True, exist_ok=True)
    files = {
        name: root / name for name in ("context", "empty", "blank", "binary", "missing", "folder", "pipe", "utf16")
    }
    files["context"].write_text(CONTEXT, encoding="utf-8")
    files["empty"].write_bytes(b"")
    files["blank"].write_text(" \n\t\n")
    files["binary"].write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    files["utf16"].write_bytes(CONTEXT.encode("utf-16"))
    files["folder"].mkdir(exist_ok=True)
    if not files["pipe"].exists():
        os.mkfifo(files["pipe"])
    files["zero"] = Path("/dev/zero")
    files["qwen_budgets"] = Path(cli.__file__).parent / "data" / "head_budgets" / "qwen2.5-coder-0.5b-instruct"
    files["corrupt_budgets"] = root / "corrupt_budgets"
    files["corrupt_budgets"].mkdir(exist_ok=True)
    (files["corrupt_budgets"] / "head_budgets.json").write_text('{"format": "hf_structkv_head_budgets", "weights": ')
    files["corrupt_cache"] = arts.copy("cache", root / "corrupt_cache")
    (files["corrupt_cache"] / "cache.safetensors").write_bytes(b"\x00" * 16)
    files["model_folder"] = root / "model"
    tiny_model("llama").config.save_pretrained(files["model_folder"])
    files["good_cache"] = root / "good_cache"
    if not files["good_cache"].exists():
        run_cli(["compact", "--context-file", str(files["context"]), "--ratio", "4", "--out", str(files["good_cache"])])
    data = files["data"] = root / "data"
    data.mkdir(exist_ok=True)
    rows = {
        "empty.jsonl": "",
        "bad.jsonl": "{not json}\n",
        "nocolumn.jsonl": json.dumps({"text": CONTEXT}) + "\n",
        "emptyrow.jsonl": json.dumps({"context": ""}) + "\n" + json.dumps({"context": CONTEXT}) + "\n",
        "number.jsonl": json.dumps({"context": 5}) + "\n" + json.dumps({"context": CONTEXT}) + "\n",
        "good.jsonl": json.dumps({"context": CONTEXT}) + "\n" + json.dumps({"context": CONTEXT[::-1]}) + "\n",
    }
    for name, text in rows.items():
        (data / name).write_text(text)
    return files
