"""Answer quality from compacted caches on SQuAD v2 dev (offline), against the full cache, side by side.

One article is read once per method and compacted at the given ratio; every answerable question of its first
paragraphs is answered greedily from each cache. A reply counts as correct when a normalised gold answer occurs in it
(SQuAD normalisation; free-form chat replies, so exact match would undercount). Held-out relative loss (eq. 4) of
calibrated methods comes from the compaction's own held-out queries.

    python benchmarks/squad_qa.py --methods streaming_llm key_norm kv_surgeon --ratio 8 \
        --out benchmarks/results/squad_qa.json
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
import transformers

import hf_structkv
from hf_structkv.compaction import compact, prefill_context
from hf_structkv.eval.squad import contains_answer, squad_document
from hf_structkv.generation import generation_inputs
from hf_structkv.models import load_default_model
from hf_structkv.prompts import document_chat_prompt, question_text


def answer_all(model, tokenizer, make_cache, questions, suffix, max_new_tokens) -> list[dict]:
    """Greedy replies to every question from a fresh cache each, with correctness."""
    rows = []
    for item in questions:
        ids = tokenizer(question_text(item.question, suffix), return_tensors="pt", add_special_tokens=False).input_ids
        cache = make_cache()
        inputs = generation_inputs(cache, ids)
        with torch.no_grad():
            out = model.generate(**inputs, cache=cache, max_new_tokens=max_new_tokens, do_sample=False)
        reply = " ".join(tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True).split())
        rows.append({"question": item.question, "reply": reply, "correct": contains_answer(reply, item.answers)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--article", default="Normans")
    parser.add_argument("--paragraphs", type=int, default=20)
    parser.add_argument("--questions", type=int, default=24, help="at most this many questions, evenly spread")
    parser.add_argument("--methods", nargs="+", default=["streaming_llm", "key_norm", "kv_surgeon"])
    parser.add_argument("--ratio", type=float, default=8.0)
    parser.add_argument("--query-cap", type=int, default=4096)
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/squad_qa.json")
    args = parser.parse_args()

    model, tokenizer = load_default_model()
    document = squad_document(args.article, args.paragraphs)
    step = max(1, len(document.questions) // args.questions)
    questions = document.questions[::step][: args.questions]
    context_text, suffix = document_chat_prompt(tokenizer, document.text)
    context_ids = tokenizer(context_text, return_tensors="pt", add_special_tokens=False).input_ids

    full = prefill_context(model, context_ids, prefill_chunk_tokens=1024)
    results = [
        {
            "cache": "full",
            "ratio": 1.0,
            "rows": answer_all(model, tokenizer, lambda: copy.deepcopy(full), questions, suffix, args.max_new_tokens),
        }
    ]
    for method in args.methods:
        start = time.perf_counter()
        compacted = compact(
            model, tokenizer, context_ids, ratio=args.ratio, method=method, on_policy=False, query_cap=args.query_cap
        )
        seconds = time.perf_counter() - start
        hf_structkv.enable(model)
        rows = answer_all(model, tokenizer, compacted.copy, questions, suffix, args.max_new_tokens)
        quality = compacted.metadata.get("quality", {}).get("heldout_relative_loss_mean")
        results.append(
            {
                "cache": method,
                "ratio": args.ratio,
                "compaction_seconds": seconds,
                "stored_bytes": compacted.nbytes(),
                "heldout_relative_loss": quality,
                "rows": rows,
            }
        )
    print(f"SQuAD dev {document.title!r}: {context_ids.shape[1]} context tokens, {len(questions)} questions")
    print(f"{'cache':<16}{'ratio':>7}{'correct':>9}{'held-out loss':>15}{'compact s':>11}")
    for result in results:
        result["accuracy"] = sum(row["correct"] for row in result["rows"]) / len(result["rows"])
        loss = result.get("heldout_relative_loss")
        print(
            f"{result['cache']:<16}{result['ratio']:>7.1f}{result['accuracy']:>9.1%}"
            f"{'' if loss is None else f'{loss:.3f}':>15}{result.get('compaction_seconds', 0):>11.1f}"
        )
    payload = {
        "article": document.title,
        "context_tokens": int(context_ids.shape[1]),
        "questions": len(questions),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "query_cap": args.query_cap,
        "on_policy": False,
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
