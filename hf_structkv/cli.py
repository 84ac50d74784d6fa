"""``hf-structkv``: compact a context, answer questions from a compacted cache, inspect a saved cache."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from .compaction.pipeline import METHODS
from .prompts import document_chat_prompt, question_text

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(name: str, dtype: torch.dtype):
    """``default`` = the embedded Qwen2.5-Coder-0.5B-Instruct; otherwise a local transformers model folder."""
    if name == "default":
        from .models import load_default_model

        return load_default_model(dtype=dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, local_files_only=True).eval()
    return model, AutoTokenizer.from_pretrained(name, local_files_only=True)


def read_context(args) -> str:
    if args.context_file:
        return Path(args.context_file).read_text(encoding="utf-8")
    from .eval.squad import squad_document

    return squad_document(args.squad_article, args.squad_paragraphs).text


def cmd_compact(args) -> int:
    from .compaction import compact

    document = read_context(args)
    model, tokenizer = load_model(args.model, DTYPES[args.dtype])
    context_text, question_suffix = document_chat_prompt(tokenizer, document)
    start = time.perf_counter()
    cache = compact(
        model,
        tokenizer,
        context_text,
        ratio=args.ratio,
        method=args.method,
        on_policy=args.on_policy,
        query_cap=args.query_cap,
        progress=True,
    )
    seconds = time.perf_counter() - start
    cache.metadata["question_suffix"] = question_suffix
    cache.save_pretrained(args.out)
    print(f"compacted {cache.original_length} tokens in {seconds:.1f} s -> {args.out}")
    print(
        f"stored {cache.nbytes():,} bytes vs {cache.full_nbytes():,} full ({cache.full_nbytes() / cache.nbytes():.2f}x)"
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
    print(f"stored bytes         {cache.nbytes():,}  (biases + offsets {cache.overhead_nbytes():,})")
    print(f"full DynamicCache    {cache.full_nbytes():,}  ({cache.full_nbytes() / cache.nbytes():.2f}x smaller)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-structkv", description="Smaller KV caches for transformers: compacted reusable contexts."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def model_options(p):
        p.add_argument("--model", default="default", help="'default' (embedded Qwen2.5-Coder-0.5B) or a local folder")
        p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))

    compact_p = sub.add_parser("compact", help="read a context once and save its compacted cache")
    model_options(compact_p)
    source = compact_p.add_mutually_exclusive_group()
    source.add_argument("--context-file", help="UTF-8 text file holding the context")
    source.add_argument("--squad-article", default="Normans", help="a SQuAD dev article title (default: Normans)")
    compact_p.add_argument("--squad-paragraphs", type=int, default=20, help="paragraphs of the article to use")
    compact_p.add_argument("--ratio", type=float, default=8.0, help="original / kept entries per KV head")
    compact_p.add_argument("--method", default="kv_surgeon", choices=METHODS, help="per-head compaction method")
    compact_p.add_argument(
        "--on-policy",
        action="store_true",
        help="calibrate layer l with layers < l already compacted (the paper's setting; one forward per layer)",
    )
    compact_p.add_argument("--query-cap", type=int, default=4096, help="calibration queries per KV head")
    compact_p.add_argument("--out", required=True, help="folder to write cache.safetensors, config.json, README.md")
    compact_p.add_argument("--push", metavar="REPO_ID", help="also push to this Hub repository")
    compact_p.add_argument("--private", action="store_true", help="create the Hub repository private")
    compact_p.set_defaults(func=cmd_compact)

    gen_p = sub.add_parser("generate", help="answer questions from a saved compacted cache")
    model_options(gen_p)
    gen_p.add_argument("--cache", required=True, help="a saved cache folder or Hub repository id")
    gen_p.add_argument("--question", action="append", required=True, help="question text (repeatable)")
    gen_p.add_argument("--max-new-tokens", type=int, default=48)
    gen_p.set_defaults(func=cmd_generate)

    info_p = sub.add_parser("info", help="print a saved cache's metadata and bytes")
    info_p.add_argument("cache", help="a saved cache folder or Hub repository id")
    info_p.set_defaults(func=cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
