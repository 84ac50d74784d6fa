"""Serving cost of a compacted cache vs the full cache on the embedded model: stored bytes and decode time per token.

Measured side by side in one run on one context (SQuAD dev article, chat prompt), greedy decoding of a fixed number
of tokens; the compacted caches use the query-free StreamingLLM selection (serving cost does not depend on which
entries are kept) and the plain-torch reference attention.

    python benchmarks/serving_cost.py --out benchmarks/results/serving_cost.json
"""

from __future__ import annotations

import argparse
import copy
import platform
import sys
import time
from pathlib import Path

import torch
import transformers

import hf_structkv
from hf_structkv.compaction import compact, prefill_context
from hf_structkv.eval.squad import squad_document
from hf_structkv.generation import generation_inputs
from hf_structkv.models import load_default_model
from hf_structkv.prompts import document_chat_prompt, question_text

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's helpers, also when imported by path
from results_json import write_json  # noqa: E402


def seconds_per_token(model, make_cache, question_ids, new_tokens: int, repeats: int) -> float:
    """Best-of-``repeats`` decode time per token (generate time of ``new_tokens`` minus that of 1 token)."""

    def run(n: int) -> float:
        cache = make_cache()
        inputs = generation_inputs(cache, question_ids)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(**inputs, cache=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - start

    best = min(run(new_tokens) - run(1) for _ in range(repeats))
    return best / (new_tokens - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paragraphs", type=int, default=20)
    parser.add_argument("--ratios", type=float, nargs="+", default=[1.0, 4.0, 16.0])
    parser.add_argument("--new-tokens", type=int, default=17)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/serving_cost.json")
    args = parser.parse_args()
    started = time.perf_counter()

    model, tokenizer = load_default_model()
    document = squad_document("Normans", args.paragraphs)
    context_text, suffix = document_chat_prompt(tokenizer, document.text)
    context_ids = tokenizer(context_text, return_tensors="pt", add_special_tokens=False).input_ids
    question = question_text(document.questions[0].question, suffix)
    question_ids = tokenizer(question, return_tensors="pt", add_special_tokens=False).input_ids

    full = prefill_context(model, context_ids, prefill_chunk_tokens=1024)
    full_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in full.layers)
    rows = [
        {
            "cache": "DynamicCache (stock sdpa)",
            "ratio": 1.0,
            "stored_bytes": full_bytes,
            "s_per_token": seconds_per_token(
                model, lambda: copy.deepcopy(full), question_ids, args.new_tokens, args.repeats
            ),
        }
    ]
    for ratio in args.ratios:
        compacted = compact(model, tokenizer, context_ids, ratio=ratio, method="streaming_llm")
        hf_structkv.enable(model)
        rows.append(
            {
                "cache": "CompactedCache (torch reference)",
                "ratio": ratio,
                "stored_bytes": compacted.nbytes(),
                "s_per_token": seconds_per_token(model, compacted.copy, question_ids, args.new_tokens, args.repeats),
            }
        )
        model.set_attn_implementation("sdpa")
    baseline = rows[0]
    print(f"context {context_ids.shape[1]} tokens, torch threads {torch.get_num_threads()}")
    print(f"{'cache':<34}{'ratio':>7}{'stored MB':>11}{'bytes x':>9}{'ms/token':>10}{'speed x':>9}")
    for row in rows:
        row["bytes_reduction"] = baseline["stored_bytes"] / row["stored_bytes"]
        row["speedup"] = baseline["s_per_token"] / row["s_per_token"]
        print(
            f"{row['cache']:<34}{row['ratio']:>7.1f}{row['stored_bytes'] / 1e6:>11.2f}{row['bytes_reduction']:>9.2f}"
            f"{row['s_per_token'] * 1e3:>10.1f}{row['speedup']:>9.2f}"
        )
    result = {
        "context_tokens": int(context_ids.shape[1]),
        "new_tokens": args.new_tokens,
        "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "rows": rows,
    }
    write_json(args.out, result, started=started)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
