"""Serving cost of a compacted cache vs the full cache on the embedded model: stored bytes and decode time per token.

Real context (default): measured side by side in one run on one context (SQuAD dev article, chat prompt), greedy
decoding of a fixed number of tokens; the compacted caches use the query-free StreamingLLM selection (serving cost
does not depend on which entries are kept) and hf_structkv's attention.

    python benchmarks/serving_cost.py --out benchmarks/results/serving_cost.json

Random K/V (``--random-kv``, issue 31): no prefill and no calibration. Per context length and batch size, side by
side: the full ``DynamicCache`` (stock SDPA; the context repeated per batch row, as a batch of prefilled caches holds
it), a compacted cache in the model's dtype (storage ``"bf16"``) at ``BF16_RATIO`` x fewer entries, an INT4-compacted
cache at ``INT4_RATIO`` x fewer bytes (storage ``"int4"``), both sized as ``compact(budgets="uniform")`` sizes them,
and the weights-only floor (the same decode with no context). Keys and values are drawn N(0, 1) in the model's
dtype: a decode step's cost does not depend on the numbers. The compacted caches are served by hf_structkv's attention
(``attention_backend`` in the JSON); at a decode step the INT4 heads (one row of key scales, even head dims) are read
from their codes, on the CPU by one C kernel call per layer where it builds (`attention/int4_decode.c`;
``int4_decode`` in the JSON: ``"C kernel"`` or ``"torch"``), other steps dequantise them per forward, so their time
includes that. Targets (issue 31, at the longest context measured):
the INT4 cache at least ``TARGET_SPEEDUP`` x faster than the DynamicCache at batch 4, and within
``TARGET_FLOOR_RATIO`` x of the floor at batch 1.

    OMP_NUM_THREADS=1 python benchmarks/serving_cost.py --random-kv --contexts 4096 16384 --batches 1 4 \
        --out benchmarks/results/serving_cost_random_kv.json

``--tiny`` (random K/V only) runs the same code on a random tiny model (a smoke test, times meaningless).
"""

from __future__ import annotations

import argparse
import operator
import platform
import sys
import time
from functools import partial
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache

import hf_structkv
from hf_structkv.attention.backend import choose_backend
from hf_structkv.attention.native_int4 import runs_natively
from hf_structkv.cache.compacted import CompactedCache
from hf_structkv.compaction import UniformBudgets, compact, compact_head, compact_head_to_bytes, prefill_context
from hf_structkv.compaction.byte_budgets import head_byte_budgets
from hf_structkv.compaction.layer_compaction import CacheSelection
from hf_structkv.eval.squad import squad_document
from hf_structkv.generation import context_copy, generation_inputs
from hf_structkv.models import load_default_model, tiny_byte_tokenizer, tiny_model
from hf_structkv.persistence import config_fingerprint
from hf_structkv.prompts import document_chat_prompt, question_text

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's helpers, also when imported by path
from results_json import write_json  # noqa: E402

BF16_RATIO = 10.0
"""Entry ratio of the compacted cache in the model's dtype (random K/V)."""

INT4_RATIO = 20.0
"""Byte ratio of the INT4-compacted cache against the full cache in the model's dtype (random K/V)."""

KEY_GROUP = None  # the package default: one row of key scales per head
"""Kept entries per row of INT4 key scales: ``compact``'s default."""

TARGET_SPEEDUP = 4.0
"""Issue 31: the INT4 cache at least this much faster per token than the DynamicCache at batch 4."""

TARGET_FLOOR_RATIO = 1.1
"""Issue 31: the INT4 cache's time per token at most this multiple of the weights-only floor's at batch 1."""

RANDOM_QUESTION = "What did the Normans give their name to?"
"""The question decoded after a random context."""

FULL, FLOOR = "DynamicCache", "weights-only floor"
BF16, INT4 = f"CompactedCache bf16 {BF16_RATIO:g}x", f"CompactedCache int4 {INT4_RATIO:g}x"

TARGETS = (
    (4, "speedup", operator.ge, TARGET_SPEEDUP, f">= {TARGET_SPEEDUP:g}x faster than {FULL}"),
    (1, "over_floor", operator.le, TARGET_FLOOR_RATIO, f"within {TARGET_FLOOR_RATIO:g}x of the {FLOOR}"),
)
"""The issue-31 targets of the INT4 cache: ``(batch, row field, comparison, bound, wording)``."""

RESULTS = Path("benchmarks/results")
REAL_CONTEXT_DEFAULTS = {"paragraphs": 20, "ratios": [1.0, 4.0, 16.0]}
RANDOM_KV_DEFAULTS = {"contexts": [4096, 16384], "batches": [1, 4], "tiny": False}


def seconds_per_token(model, make_inputs, new_tokens: int, repeats: int) -> float:
    """Best-of-``repeats`` decode time per token (generate time of ``new_tokens`` minus that of 1 token);
    ``make_inputs()`` gives fresh keyword arguments of ``model.generate`` for each run."""

    def run(n: int) -> float:
        inputs = make_inputs()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - start

    best = min(run(new_tokens) - run(1) for _ in range(repeats))
    return best / (new_tokens - 1)


def generate_kwargs(cache, question_ids: torch.Tensor) -> dict:
    """Keyword arguments of ``model.generate`` answering ``question_ids [B, q]`` after a fresh copy of the context
    ``cache`` for ``B`` rows (`context_copy`), or, for ``cache`` None, with no context (generate's own empty cache)."""
    if cache is None:
        return {"input_ids": question_ids, "attention_mask": torch.ones_like(question_ids)}
    fresh = context_copy(cache, question_ids.shape[0])
    return {**generation_inputs(fresh, question_ids), "cache": fresh}


def decode_seconds(model, cache, question_ids: torch.Tensor, args: argparse.Namespace) -> float:
    """`seconds_per_token` answering ``question_ids [B, q]`` after ``cache`` (None: no context): a `CompactedCache`
    through hf_structkv's attention, anything else through stock SDPA (restored afterwards)."""
    if isinstance(cache, CompactedCache):
        hf_structkv.enable(model)
    try:
        return seconds_per_token(model, partial(generate_kwargs, cache, question_ids), args.new_tokens, args.repeats)
    finally:
        model.set_attn_implementation("sdpa")


def dynamic_nbytes(cache: DynamicCache) -> int:
    """Bytes of the keys and values a ``DynamicCache`` holds."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def context_nbytes(cache) -> int:
    """Bytes a context cache stores (`CompactedCache.nbytes`, `dynamic_nbytes`); 0 for no cache."""
    if cache is None:
        return 0
    return cache.nbytes() if isinstance(cache, CompactedCache) else dynamic_nbytes(cache)


# ------------------------------------------------------------------------------------------------- real context
def real_context_rows(model, tokenizer, args: argparse.Namespace) -> tuple[int, list[dict]]:
    """``(context tokens, rows)``: the full cache and the StreamingLLM-compacted caches at ``args.ratios`` of the
    SQuAD article, each row with its stored bytes, seconds per token and both relative to the full cache."""
    document = squad_document("Normans", args.paragraphs)
    context_text, suffix = document_chat_prompt(tokenizer, document.text)
    context_ids = tokenizer(context_text, return_tensors="pt", add_special_tokens=False).input_ids
    question = question_text(document.questions[0].question, suffix)
    question_ids = tokenizer(question, return_tensors="pt", add_special_tokens=False).input_ids

    full = prefill_context(model, context_ids, prefill_chunk_tokens=1024)
    rows = [
        {
            "cache": "DynamicCache (stock sdpa)",
            "ratio": 1.0,
            "stored_bytes": dynamic_nbytes(full),
            "s_per_token": decode_seconds(model, full, question_ids, args),
        }
    ]
    for ratio in args.ratios:
        compacted = compact(model, tokenizer, context_ids, ratio=ratio, method="streaming_llm")
        rows.append(
            {
                "cache": "CompactedCache (torch reference)",
                "ratio": ratio,
                "stored_bytes": compacted.nbytes(),
                "s_per_token": decode_seconds(model, compacted, question_ids, args),
            }
        )
    baseline = rows[0]
    for row in rows:
        row["bytes_reduction"] = baseline["stored_bytes"] / row["stored_bytes"]
        row["speedup"] = baseline["s_per_token"] / row["s_per_token"]
    return int(context_ids.shape[1]), rows


def print_real_context(context_tokens: int, rows: list[dict]) -> None:
    print(f"context {context_tokens} tokens, torch threads {torch.get_num_threads()}")
    print(f"{'cache':<34}{'ratio':>7}{'stored MB':>11}{'bytes x':>9}{'ms/token':>10}{'speed x':>9}")
    for row in rows:
        print(
            f"{row['cache']:<34}{row['ratio']:>7.1f}{row['stored_bytes'] / 1e6:>11.2f}{row['bytes_reduction']:>9.2f}"
            f"{row['s_per_token'] * 1e3:>10.1f}{row['speedup']:>9.2f}"
        )


def real_context_result(model, tokenizer, args: argparse.Namespace) -> dict:
    context_tokens, rows = real_context_rows(model, tokenizer, args)
    print_real_context(context_tokens, rows)
    return {"context_tokens": context_tokens, "new_tokens": args.new_tokens, "rows": rows}


# ------------------------------------------------------------------------------------------------- random K/V
def random_context_cache(model, length: int, seed: int = 0) -> DynamicCache:
    """A batch-1 ``DynamicCache`` of ``length`` context entries in every layer, keys and values ``[1, H_kv, T, D]``
    drawn N(0, 1) (seeded) in the model's dtype; a sliding-window layer keeps its window, as after a prefill."""
    shape = config_fingerprint(model.config)
    cache = DynamicCache(config=model.config)
    generator = torch.Generator().manual_seed(seed)
    size = (1, shape["num_key_value_heads"], length, shape["head_dim"])
    for layer_idx in range(shape["num_hidden_layers"]):
        keys, values = (torch.randn(size, generator=generator).to(model.device, model.dtype) for _ in range(2))
        cache.update(keys, values, layer_idx)
    return cache


def compacted_random_cache(model, cache: DynamicCache, ratio: float, storage: str) -> CompactedCache:
    """``cache`` compacted by StreamingLLM (sinks and the most recent entries) to ``ratio``, sized as
    ``compact(ratio=ratio, storage=storage, budgets="uniform")`` sizes it: every KV head is owed ``max(1, floor(T /
    ratio))`` entries (`UniformBudgets`); ``"bf16"`` keeps them in the cache's dtype (`compact_head`), ``"int4"``
    spends their bytes (`head_byte_budgets`) on the most INT4 entries they buy (`compact_head_to_bytes`, key scales
    per ``KEY_GROUP`` entries)."""
    length = cache.get_seq_length()
    sizes = UniformBudgets.of(model).token_budgets(ratio, length)
    compact_one = compact_head
    if storage == "int4":
        first = cache.layers[next(iter(sizes))]
        layout = (first.keys.shape[-1], first.values.shape[-1], first.values.element_size(), "int4", KEY_GROUP)
        sizes = head_byte_budgets(sizes, length, *layout)
        compact_one = partial(compact_head_to_bytes, storage="int4", key_group=KEY_GROUP)
    selection = CacheSelection.keep_everything(cache, KEY_GROUP if storage == "int4" else None)
    for layer_idx, head_sizes in sizes.items():
        layer = cache.layers[layer_idx]
        heads = zip(layer.keys[0], layer.values[0], head_sizes, strict=True)  # [T, D], [T, D_v], entries or bytes
        selection.set_layer(layer_idx, [compact_one(k, v, None, size, method="streaming_llm") for k, v, size in heads])
    return selection.build(cache)


def context_caches(model, length: int) -> list[tuple[str, str | None, float | None, object]]:
    """``(label, storage, ratio, cache)`` of every cache timed on a random context of ``length`` tokens: the full
    cache, the compacted ones, and the floor (no cache)."""
    full = random_context_cache(model, length)
    return [
        (FULL, None, 1.0, full),
        (BF16, "bf16", BF16_RATIO, compacted_random_cache(model, full, BF16_RATIO, "bf16")),
        (INT4, "int4", INT4_RATIO, compacted_random_cache(model, full, INT4_RATIO, "int4")),
        (FLOOR, None, None, None),
    ]


def random_kv_rows(model, question_ids: torch.Tensor, length: int, args: argparse.Namespace) -> list[dict]:
    """One row per (batch, cache) on a random context of ``length`` tokens: stored bytes of the context
    (``stored_bytes``: one copy; ``batch_bytes``: what serving the batch holds, a DynamicCache one copy per row),
    ``byte_ratio`` (the full cache's stored bytes over the row's), seconds per token, ``speedup`` (the full cache's
    seconds over the row's) and ``over_floor`` (the row's seconds over the floor's), at the same batch."""
    caches = context_caches(model, length)
    rows = []
    for batch in args.batches:
        batch_rows = []
        for label, storage, ratio, cache in caches:
            stored = context_nbytes(cache)
            batch_rows.append(
                {
                    "context_tokens": length,
                    "batch": batch,
                    "cache": label,
                    "storage": storage,
                    "ratio": ratio,
                    "stored_bytes": stored,
                    "batch_bytes": stored * batch if isinstance(cache, DynamicCache) else stored,
                    "s_per_token": decode_seconds(model, cache, question_ids.repeat(batch, 1), args),
                }
            )
        by_label = {row["cache"]: row for row in batch_rows}
        for row in batch_rows:
            row["byte_ratio"] = by_label[FULL]["stored_bytes"] / row["stored_bytes"] if row["stored_bytes"] else None
            row["speedup"] = by_label[FULL]["s_per_token"] / row["s_per_token"]
            row["over_floor"] = row["s_per_token"] / by_label[FLOOR]["s_per_token"]
        rows += batch_rows
    return rows


def target_verdicts(rows: list[dict]) -> dict[str, str]:
    """`TARGETS` of the INT4 cache at the longest context of ``rows``: ``"met (x)"``, ``"not met (x)"`` (``x`` the
    row's field) or ``"not measured (...)"`` when the target's batch was not run."""
    context = max(row["context_tokens"] for row in rows)
    int4 = {row["batch"]: row for row in rows if row["context_tokens"] == context and row["cache"] == INT4}
    prefix = f"{INT4} at {context} tokens"
    verdicts = {}
    for batch, field, holds, bound, wording in TARGETS:
        name, row = f"{prefix}, batch {batch}: {wording}", int4.get(batch)
        if row is None:
            verdicts[name] = f"not measured (batch {batch} not run)"
        else:
            verdicts[name] = f"{'met' if holds(row[field], bound) else 'not met'} ({row[field]:.2f}x)"
    return verdicts


def print_random_kv(rows: list[dict], verdicts: dict[str, str]) -> None:
    print(f"random K/V, torch threads {torch.get_num_threads()}")
    header = f"{'context':>8}{'batch':>6}  {'cache':<26}{'ratio':>6}{'stored MB':>11}{'batch MB':>10}{'bytes x':>9}"
    print(header + f"{'ms/token':>10}{'speed x':>9}{'/ floor':>9}")
    for row in rows:
        ratio = "" if row["ratio"] is None else f"{row['ratio']:g}"
        byte_ratio = "" if row["byte_ratio"] is None else f"{row['byte_ratio']:.2f}"
        megabytes = f"{row['stored_bytes'] / 1e6:>11.2f}{row['batch_bytes'] / 1e6:>10.2f}"
        times = f"{row['s_per_token'] * 1e3:>10.1f}{row['speedup']:>9.2f}{row['over_floor']:>9.2f}"
        where = f"{row['context_tokens']:>8}{row['batch']:>6}  {row['cache']:<26}"
        print(f"{where}{ratio:>6}{megabytes}{byte_ratio:>9}{times}")
    for name, verdict in verdicts.items():
        print(f"target: {name}: {verdict}")


def random_kv_result(model, tokenizer, args: argparse.Namespace) -> dict:
    head_dim = config_fingerprint(model.config)["head_dim"]
    question = question_text(RANDOM_QUESTION, "")
    question_ids = tokenizer(question, return_tensors="pt", add_special_tokens=False).input_ids.to(model.device)
    rows = [row for length in args.contexts for row in random_kv_rows(model, question_ids, length, args)]
    verdicts = target_verdicts(rows)
    print_random_kv(rows, verdicts)
    return {
        "mode": "random_kv",
        "model": "tiny qwen2 (random)" if args.tiny else "embedded (Qwen2.5-Coder-0.5B-Instruct)",
        "dtype": str(model.dtype),
        "attention_backend": choose_backend(question_ids.float()),
        "int4_decode": "C kernel" if runs_natively(model.device, head_dim, head_dim) else "torch",
        "key_group": KEY_GROUP,
        "question_tokens": int(question_ids.shape[1]),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "rows": rows,
        "verdicts": verdicts,
    }


# ------------------------------------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paragraphs", type=int, help="real context: SQuAD paragraphs (default 20)")
    parser.add_argument("--ratios", type=float, nargs="+", help="real context: compaction ratios (default 1 4 16)")
    parser.add_argument("--random-kv", action="store_true", help="random K/V contexts instead of a real one")
    parser.add_argument("--contexts", type=int, nargs="+", help="random K/V: context tokens (default 4096 16384)")
    parser.add_argument("--batches", type=int, nargs="+", help="random K/V: batch sizes (default 1 4)")
    parser.add_argument("--tiny", action="store_true", default=None, help="random K/V: a random tiny model (smoke)")
    parser.add_argument("--new-tokens", type=int, default=17)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", help="default benchmarks/results/serving_cost.json (random K/V: *_random_kv.json)")
    args = parser.parse_args(argv)
    used, other = (
        (RANDOM_KV_DEFAULTS, REAL_CONTEXT_DEFAULTS) if args.random_kv else (REAL_CONTEXT_DEFAULTS, RANDOM_KV_DEFAULTS)
    )
    for name in other:
        if getattr(args, name) is not None:
            mode = "a real context (without --random-kv)" if args.random_kv else "--random-kv"
            parser.error(f"--{name} is for {mode} only")
    for name, default in used.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    counts = (
        {"contexts": args.contexts, "batches": args.batches} if args.random_kv else {"paragraphs": [args.paragraphs]}
    )
    for name, values in counts.items():
        if min(values) < 1:
            parser.error(f"--{name} must be >= 1, got {values}")
    if args.out is None:
        args.out = str(RESULTS / ("serving_cost_random_kv.json" if args.random_kv else "serving_cost.json"))
    if args.new_tokens < 2 or args.repeats < 1:
        parser.error(f"--new-tokens must be >= 2 and --repeats >= 1, got {args.new_tokens} and {args.repeats}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    if args.random_kv and args.tiny:
        model, tokenizer = tiny_model("qwen2", vocab_size=300), tiny_byte_tokenizer()
    else:
        model, tokenizer = load_default_model()
    measure = random_kv_result if args.random_kv else real_context_result
    result = measure(model, tokenizer, args)
    result |= {
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    result = write_json(args.out, result, started=started)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
