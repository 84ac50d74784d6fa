"""``hf-structkv``: compact a context or a dataset of contexts, answer questions from a compacted cache, inspect a
saved cache."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from .compaction.head_storage import STORAGE_CHOICES
from .compaction.settings import METHODS, QUERY_TIERS
from .prompts import question_text
from .validation import int_option, is_hub_id

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
RUNTIME_ERRORS = (ValueError, TypeError, OSError)
"""What the library raises for bad input or unreadable files: printed as one ``hf-structkv: error:`` line (exit 2)
unless ``--debug`` asks for the traceback."""


def load_model(name: str, dtype: torch.dtype):
    """``default`` = the embedded Qwen2.5-Coder-0.5B-Instruct; otherwise a local transformers model folder, or a Hub
    model id already in the local cache.

    Raises:
        OSError: ``name`` is a Hub model id missing from the local cache (or the folder's files cannot be read).
    """
    if name == "default":
        from .models import load_default_model

        return load_default_model(dtype=dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, local_files_only=True).eval()
        return model, AutoTokenizer.from_pretrained(name, local_files_only=True)
    except OSError as err:
        if Path(name).is_dir():
            raise
        raise OSError(
            f"--model {name!r} is no local folder and is not in the local Hugging Face cache (models are never "
            f"downloaded here): pass a folder, or download it first (hf download {name})"
        ) from err


def model_name(text: str) -> str:
    """``--model``: ``default``, an existing folder, or a Hub model id (read from the local cache only); a path that
    does not exist is refused at once."""
    if text == "default" or Path(text).is_dir():
        return text
    if Path(text).exists():
        raise argparse.ArgumentTypeError(f"{text!r} is a file; pass 'default' or a local transformers model folder")
    if not is_hub_id(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} does not exist; pass 'default' or a local transformers model folder"
        )
    return text


def positive_number(text: str) -> float:
    """``--max-loss``: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def question(text: str) -> str:
    """``--question``: a text with something besides white space."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"must hold a question, got {text!r}")
    return text


def read_text_file(option: str, name: str) -> str:
    """The UTF-8 text of the file ``name`` given to ``option``.

    Raises:
        ValueError: naming ``option`` and the file: it is not a file, not UTF-8, or holds only white space.
    """
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"{option} {name!r} is not a file; pass a UTF-8 text file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{option} {name!r} is not UTF-8 text ({err.reason} at byte {err.start}); pass a UTF-8 text file"
        ) from None
    if not text.strip():
        raise ValueError(f"{option} {name!r} is empty; it must hold the text to read")
    return text


def check_out(out: str, saves: str | None = None) -> None:
    """``--out`` names a folder that exists or can be made and written, and (``saves``: ``"cache"`` or
    ``"budgets"``, what the command saves there) holds no other kind of saved artifact: checked before any work.

    Raises:
        ValueError: ``out`` is empty, an existing file, lies under a file, its nearest existing folder is not
            writable, or it holds another artifact's files.
    """
    if not out:
        raise ValueError("--out is empty; pass a folder (it is made when missing)")
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {out!r} is an existing file; pass a folder (it is made when missing)")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"--out {out!r} lies under the file {str(existing)!r}; pass a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out!r}: {str(existing)!r} is not writable; pass a folder you can write")
    if saves is not None:
        try:
            _saved_class(saves).check_save_directory(path)
        except ValueError as err:
            raise ValueError(f"--out {out!r}: {err}") from None


def _saved_class(saves: str):
    """The artifact class a command saves into ``--out`` (imported only when checked)."""
    if saves == "cache":
        from .cache.compacted import CompactedCache

        return CompactedCache
    from .compaction.budgets import HeadBudgets

    return HeadBudgets


def read_context(args) -> str:
    if args.context_file:
        return read_text_file("--context-file", args.context_file)
    from .eval.squad import squad_document

    return squad_document(args.squad_article, args.squad_paragraphs).text


DEFAULT_CLI_RATIO = 8.0
"""``--ratio`` when neither it nor ``--max-loss`` is given."""


def compaction_kwargs(args) -> dict:
    """The `compact` keyword arguments of the options that ``compaction_options`` adds (``--ratio`` defaults to
    `DEFAULT_CLI_RATIO` unless ``--max-loss`` sizes the heads)."""
    ratio = args.ratio
    if ratio is None and getattr(args, "max_loss", None) is None:
        ratio = DEFAULT_CLI_RATIO
    return {
        "ratio": ratio,
        "method": args.method,
        "queries": args.queries,
        "budgets": args.budgets,
        "chunk_tokens": args.chunk_tokens,
        "on_policy": args.on_policy,
        "query_cap": args.query_cap,
        "keep_template": args.keep_template,
    }


def cmd_compact(args) -> int:
    from .compaction.dataset import compact_document

    if args.max_loss is not None and args.ratio is not None:
        raise ValueError("--ratio and --max-loss exclude each other: --max-loss chooses each KV head's size")
    storage = {"storage": args.storage, "key_group": args.key_group, "max_loss": args.max_loss}
    if args.tools:
        from .cli_calls import compact_tools

        options = {**compaction_kwargs(args), **storage}
        return compact_tools(args, lambda name: load_model(name, DTYPES[args.dtype]), options)
    document = read_context(args)
    model, tokenizer = load_model(args.model, DTYPES[args.dtype])
    start = time.perf_counter()
    cache = compact_document(model, tokenizer, document, progress=True, **compaction_kwargs(args), **storage)
    seconds = time.perf_counter() - start
    cache.save_pretrained(args.out)
    print(f"compacted {cache.original_length} tokens in {seconds:.1f} s -> {args.out}")
    print(
        f"stored {cache.nbytes():,} bytes vs {cache.full_nbytes():,} full ({cache.full_nbytes() / cache.nbytes():.2f}x)"
    )
    if args.max_loss is not None:
        record = cache.metadata["max_loss"]
        print(
            f"max loss {args.max_loss:g} on each KV head's held-out calibration queries: byte ratio "
            f"{record['byte_ratio']:.2f}x, {record['heads_kept_whole']} KV heads kept whole"
        )
    if args.push:
        print("pushed:", cache.push_to_hub(args.push, private=args.private))
    return 0


def cmd_generate(args) -> int:
    from .cache.compacted import CompactedCache
    from .generation import generation_inputs

    model, tokenizer = load_model(args.model, DTYPES[args.dtype])
    cache = CompactedCache.load(args.cache, model=model, tokenizer=tokenizer)
    suffix = cache.metadata.get("question_suffix")
    for question in args.question:
        text = question if suffix is None else question_text(question, suffix)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        inputs = generation_inputs(cache, ids)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**inputs, cache=cache.copy(), max_new_tokens=args.max_new_tokens, do_sample=False)
        answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        print(f"Q: {question!r}\nA: {answer.strip()}  ({time.perf_counter() - start:.1f} s)")
    return 0


def cmd_info(args) -> int:
    """Print a saved cache's metadata and bytes without loading a model."""
    from .cache.compacted import CompactedCache

    cache = CompactedCache.load(args.cache)
    config = json.loads((Path(args.cache) / "config.json").read_text()) if Path(args.cache).is_dir() else {}
    lengths = [sum(h) for h in cache.head_lengths() if h is not None]
    print(json.dumps({k: v for k, v in config.items() if k != "layers"}, indent=2))
    print(f"original length      {cache.original_length}")
    print(f"kept entries (global layers, all heads) {sum(lengths):,}")
    storages = [kind for heads in cache.head_storage() if heads is not None for kind in heads]
    print(f"storage              {storages.count('int4')} of {len(storages)} KV heads in INT4, the others in dtype")
    print(f"stored bytes         {cache.nbytes():,}  (biases + offsets {cache.overhead_nbytes():,} with INT4 scales)")
    print(f"full DynamicCache    {cache.full_nbytes():,}  ({cache.full_nbytes() / cache.nbytes():.2f}x smaller)")
    return 0


def cmd_head_budgets(args) -> int:
    """Measure per-head sensitivity curves on texts and save the ratio-agnostic head-budget allocation."""
    from .compaction.budget_sensitivity import (
        CALIBRATION_ARTICLES,
        CALIBRATION_PARAGRAPHS,
        DEFAULT_FRACTIONS,
        compute_head_budgets,
    )
    from .eval.squad import squad_document

    if args.text_file:
        names = list(args.text_file)
        texts = [read_text_file("--text-file", name) for name in names]
    else:
        names = list(args.squad_article or CALIBRATION_ARTICLES)
        texts = [squad_document(name, args.squad_paragraphs or CALIBRATION_PARAGRAPHS).text for name in names]
    model, tokenizer = load_model(args.model, DTYPES[args.dtype])
    budgets = compute_head_budgets(
        model,
        tokenizer,
        texts,
        quotes=args.quotes,
        fractions=args.fractions or DEFAULT_FRACTIONS,
        method=args.method,
        max_answer_tokens=args.max_answer_tokens,
        query_cap=args.query_cap,
        text_names=names,
        progress=True,
    )
    budgets.save_pretrained(args.out)
    print(f"head budgets of {budgets.n_heads} KV heads from {len(texts)} text(s) in {budgets.provenance['seconds']} s")
    print(f"saved -> {args.out}")
    if args.push:
        print("pushed:", budgets.push_to_hub(args.push, private=args.private))
    return 0


def cmd_compact_dataset(args) -> int:
    """Compact every distinct context of a local dataset; under ``accelerate launch`` each process takes a share."""
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    from .compaction.dataset import MANIFEST_NAME, compact_dataset, load_rows, merge_manifest

    # Without an accelerator, `accelerate launch --multi_gpu --num_processes N` starts N CPU processes (gloo).
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU") or not torch.accelerator.is_available())
    with state.main_process_first():  # the first process fills the datasets cache, the others then read it
        rows = load_rows(args.data, args.split)
    model, tokenizer = load_model(args.model, DTYPES[args.dtype])
    compact_dataset(
        model.to(state.device),
        tokenizer,
        rows,
        args.out,
        text_column=args.text_column,
        id_column=args.id_column,
        process_index=state.process_index,
        num_processes=state.num_processes,
        **compaction_kwargs(args),
    )
    state.wait_for_everyone()
    if state.is_main_process:
        records = merge_manifest(args.out, state.num_processes)
        stored, full = sum(r["bytes"] for r in records), sum(r["full_bytes"] for r in records)
        reused = sum(r["reused"] for r in records)
        print(f"{len(records)} contexts ({reused} already done) -> {Path(args.out) / MANIFEST_NAME}")
        print(f"stored {stored:,} bytes vs {full:,} full ({full / stored:.2f}x)")
    return 0


def cmd_calibrate(args) -> int:
    """PASK Algorithm 1 on BFCL: calibrate a decode PolicyTable (and a PrefillPolicy) and save them with a report."""
    from .calibration.cli import run_calibrate

    return run_calibrate(args, lambda name: load_model(name, DTYPES[args.dtype]))


def cmd_generate_calls(args) -> int:
    """Function calls to --tools on a PASK cache, after a compacted catalogue with --catalogue (`cli_calls`)."""
    from .cli_calls import run_generate_calls

    return run_generate_calls(args, lambda name: load_model(name, DTYPES[args.dtype]))


def _fractions(text: str) -> list[float]:
    try:
        return [float(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes comma-separated numbers (e.g. 0,0.02,0.1), got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-structkv", description="Smaller KV caches for transformers: compacted reusable contexts."
    )
    parser.add_argument(
        "--debug", action="store_true", help="show the full traceback of an error (before the command's name)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def model_options(p):
        p.add_argument(
            "--model",
            default="default",
            type=model_name,
            help="'default' (embedded Qwen2.5-Coder-0.5B) or a local folder",
        )
        p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))

    def compaction_options(p):
        p.add_argument(
            "--ratio",
            type=float,
            default=None,
            help=f"original / kept entries per KV head (default {DEFAULT_CLI_RATIO:g})",
        )
        p.add_argument("--method", default="kv_surgeon", choices=METHODS, help="per-head compaction method")
        p.add_argument(
            "--on-policy",
            action="store_true",
            help="calibrate layer l with layers < l already compacted (the paper's setting; blocks replayed)",
        )
        p.add_argument("--query-cap", type=int_option(1), default=4096, help="calibration queries per KV head")
        p.add_argument(
            "--queries",
            default="repeat",
            choices=QUERY_TIERS,
            help="calibration tier: 'repeat' (one repeat pass) or 'self_study' (the model also writes a summary, key "
            "facts, a JSON structuring and three questions answered; CPU-sized answer lengths)",
        )
        p.add_argument(
            "--budgets",
            default="auto",
            help="'auto' (default: the shipped sensitivity-based allocation for the embedded model's structure, else "
            "uniform), 'uniform', or the path of a saved head-budget allocation",
        )
        p.add_argument(
            "--chunk-tokens",
            type=int_option(1),
            default=None,
            help="compact the context in chunks of at most this many tokens (default: one chunk)",
        )
        p.add_argument(
            "--keep-template",
            action="store_true",
            help="keep the chat scaffold before the document (system turn, user-turn header) whole; compact the "
            "document only",
        )

    compact_p = sub.add_parser("compact", help="read a context once and save its compacted cache")
    model_options(compact_p)
    source = compact_p.add_mutually_exclusive_group()
    source.add_argument("--context-file", help="UTF-8 text file holding the context")
    source.add_argument("--squad-article", default="Normans", help="a SQuAD dev article title (default: Normans)")
    source.add_argument(
        "--tools", help="JSON file of tool definitions: compact their catalogue as the chat template renders it"
    )
    compact_p.add_argument(
        "--squad-paragraphs", type=int_option(1), default=20, help="paragraphs of the article to use"
    )
    compaction_options(compact_p)
    compact_p.add_argument(
        "--storage",
        default="bf16",
        choices=STORAGE_CHOICES,
        help="'bf16': kept keys and values in the model's dtype, --ratio counts entries; 'int4': INT4 codes with a "
        "quantization-aware refit, --ratio counts bytes (of the keys and values in the model's dtype); 'auto': the "
        "same bytes, each KV head in INT4 or the dtype, whichever fits its calibration queries better",
    )
    compact_p.add_argument(
        "--max-loss",
        type=positive_number,
        default=None,
        help="instead of --ratio: each KV head gets the fewest bytes whose relative loss on its held-out share of "
        "the calibration queries is at most this (the resulting byte ratio is printed and recorded)",
    )
    compact_p.add_argument(
        "--key-group",
        type=int_option(1),
        default=None,
        help="--storage int4 / auto: kept entries per row of key scales (default: one row per head, which served "
        "better at every byte ratio in docs/RESULTS.md)",
    )
    compact_p.add_argument("--out", required=True, help="folder to write cache.safetensors, config.json, README.md")
    compact_p.add_argument("--push", metavar="REPO_ID", help="also push to this Hub repository")
    compact_p.add_argument("--private", action="store_true", help="create the Hub repository private")
    compact_p.set_defaults(func=cmd_compact, saves="cache")

    gen_p = sub.add_parser("generate", help="answer questions from a saved compacted cache")
    model_options(gen_p)
    gen_p.add_argument("--cache", required=True, help="a saved cache folder or Hub repository id")
    gen_p.add_argument("--question", action="append", required=True, type=question, help="question text (repeatable)")
    gen_p.add_argument("--max-new-tokens", type=int_option(1), default=48)
    gen_p.set_defaults(func=cmd_generate)

    from .cli_calls import add_generate_calls_parser

    add_generate_calls_parser(sub, model_options, question).set_defaults(func=cmd_generate_calls)

    info_p = sub.add_parser("info", help="print a saved cache's metadata and bytes")
    info_p.add_argument("cache", help="a saved cache folder or Hub repository id")
    info_p.set_defaults(func=cmd_info)

    dataset_p = sub.add_parser(
        "compact-dataset",
        help="compact every context of a local dataset, one cache folder each (resumable; shards across the "
        "processes of `accelerate launch`)",
    )
    model_options(dataset_p)
    dataset_p.add_argument(
        "--data",
        required=True,
        help="a .jsonl/.json/.csv/.parquet file, a folder from Dataset.save_to_disk, or a dataset in the local cache",
    )
    dataset_p.add_argument("--split", help="split to read (default: 'train', or the only one)")
    dataset_p.add_argument("--text-column", default="context", help="column holding each context (default: context)")
    dataset_p.add_argument(
        "--id-column", help="column naming each context's folder (default: a hash of the context's text)"
    )
    compaction_options(dataset_p)
    dataset_p.add_argument("--out", required=True, help="folder for one cache folder per context and manifest.jsonl")
    dataset_p.set_defaults(func=cmd_compact_dataset)

    budgets_p = sub.add_parser("head-budgets", help="compute a model's sensitivity-based per-head budgets")
    model_options(budgets_p)
    texts = budgets_p.add_mutually_exclusive_group()
    texts.add_argument("--text-file", action="append", help="UTF-8 text file (repeatable), disjoint from evaluations")
    texts.add_argument(
        "--squad-article", action="append", help="SQuAD dev article title (repeatable; default: Force, Prime_number)"
    )
    budgets_p.add_argument(
        "--squad-paragraphs", type=int_option(1), help="paragraphs of each article to use (default: 5)"
    )
    budgets_p.add_argument(
        "--fractions",
        type=_fractions,
        help="comma-separated retained fractions probed per head, 0 = the head removed (default: 0,0.02,0.1)",
    )
    budgets_p.add_argument("--method", default="kv_surgeon", choices=METHODS, help="per-head compaction method")
    budgets_p.add_argument(
        "--quotes",
        type=int_option(0),
        default=0,
        help="exact-lookup references per text (sentences continued verbatim)",
    )
    budgets_p.add_argument(
        "--max-answer-tokens", type=int_option(1), default=48, help="length of each reference answer"
    )
    budgets_p.add_argument("--query-cap", type=int_option(1), default=4096, help="calibration queries per KV head")
    budgets_p.add_argument("--out", required=True, help="folder to write config.json and README.md")
    budgets_p.add_argument("--push", metavar="REPO_ID", help="also push to this Hub repository")
    budgets_p.add_argument("--private", action="store_true", help="create the Hub repository private")
    budgets_p.set_defaults(func=cmd_head_budgets, saves="budgets")

    from .calibration.cli import add_calibrate_options

    calibrate_p = sub.add_parser("calibrate", help="PASK offline calibration (Algorithm 1) of a policy table on BFCL")
    model_options(calibrate_p)
    add_calibrate_options(calibrate_p)
    calibrate_p.set_defaults(func=cmd_calibrate)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command; bad arguments exit 2 from the parser, a runtime error (`RUNTIME_ERRORS`) prints one line
    ``hf-structkv: error: ...`` and returns 2 (``--debug``: raised with its traceback)."""
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "out", None) is not None:
            check_out(args.out, getattr(args, "saves", None))
        return args.func(args)
    except RUNTIME_ERRORS as err:
        if args.debug:
            raise
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"hf-structkv: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
