"""README command (1): compact a real document once, save and reload it, answer questions from it.

On the embedded Qwen2.5-Coder-0.5B-Instruct (GGUF shipped on PyPI), a SQuAD v2 dev article of a few thousand
tokens is read once, compacted (KV-Surgeon on repeat-pass calibration queries by default), saved (safetensors +
JSON + model card) and loaded back; a few of its questions are answered from the full cache and from the compacted
cache, with stored bytes and times printed side by side.

    python examples/demo_compacted_cache.py [--ratio 8] [--method kv_surgeon] [--on-policy] [--paragraphs 20]
        [--questions 4] [--out out/demo_cache]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import hf_structkv
from hf_structkv import CompactedCache
from hf_structkv.compaction import compact, prefill_context
from hf_structkv.eval.squad import contains_answer, squad_document
from hf_structkv.generation import generation_inputs
from hf_structkv.models import load_default_model
from hf_structkv.prompts import document_chat_prompt, question_text


def answer(model, tokenizer, cache, question: str, max_new_tokens: int) -> tuple[str, float]:
    """Greedy answer of ``question`` from ``cache`` (consumed), and the seconds it took."""
    ids = tokenizer(question, return_tensors="pt", add_special_tokens=False).input_ids
    inputs = generation_inputs(cache, ids)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**inputs, cache=cache, max_new_tokens=max_new_tokens, do_sample=False)
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    return " ".join(text.split()), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--article", default="Normans")
    parser.add_argument("--paragraphs", type=int, default=20)
    parser.add_argument("--ratio", type=float, default=8.0)
    parser.add_argument("--method", default="kv_surgeon")
    parser.add_argument("--on-policy", action="store_true", help="on-policy calibration (slower)")
    parser.add_argument("--query-cap", type=int, default=4096, help="calibration queries per KV head")
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--out", default="out/demo_cache")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch threads: {torch.get_num_threads()}")

    start = time.perf_counter()
    model, tokenizer = load_default_model()
    print(f"loaded the embedded model in {time.perf_counter() - start:.1f} s")
    document = squad_document(args.article, args.paragraphs)
    context_text, suffix = document_chat_prompt(tokenizer, document.text)
    context_ids = tokenizer(context_text, return_tensors="pt", add_special_tokens=False).input_ids
    print(f"context: SQuAD dev article {document.title!r}, {args.paragraphs} paragraphs, {context_ids.shape[1]} tokens")

    start = time.perf_counter()
    full = prefill_context(model, context_ids, prefill_chunk_tokens=1024, progress=True)
    full_seconds = time.perf_counter() - start
    start = time.perf_counter()
    compacted = compact(
        model,
        tokenizer,
        context_ids,
        ratio=args.ratio,
        method=args.method,
        on_policy=args.on_policy,
        query_cap=args.query_cap,
        progress=True,
    )
    compact_seconds = time.perf_counter() - start
    compacted.metadata["question_suffix"] = suffix
    compacted.save_pretrained(args.out)
    start = time.perf_counter()
    loaded = CompactedCache.load(args.out, model=model, tokenizer=tokenizer)
    load_seconds = time.perf_counter() - start
    print(
        f"prefill (full cache) {full_seconds:.1f} s | compact (prefill + calibrate + select) {compact_seconds:.1f} s | "
        f"load {load_seconds:.2f} s from {args.out}"
    )
    full_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in full.layers)
    print(
        f"stored bytes: full DynamicCache {full_bytes:,} | compacted {loaded.nbytes():,} "
        f"({full_bytes / loaded.nbytes():.2f}x smaller; biases + offsets {loaded.overhead_nbytes():,})"
    )
    quality = loaded.metadata.get("quality", {}).get("heldout_relative_loss_mean")
    print(f"method {loaded.metadata['method']} at ratio {args.ratio}; held-out relative loss {quality}\n")

    hf_structkv.enable(model)  # load(model=...) already did; explicit for readers
    step = max(1, len(document.questions) // args.questions)
    for item in document.questions[::step][: args.questions]:
        text = question_text(item.question, suffix)
        full_answer, full_time = answer(model, tokenizer, copy.deepcopy(full), text, args.max_new_tokens)
        comp_answer, comp_time = answer(model, tokenizer, loaded.copy(), text, args.max_new_tokens)
        print(f"Q: {item.question}   (gold: {item.answers[0]!r})")
        for name, reply, seconds in (("full", full_answer, full_time), ("compacted", comp_answer, comp_time)):
            verdict = "ok " if contains_answer(reply, item.answers) else "no "
            print(f"  {name:<9} [{verdict}] {seconds:4.1f} s  {reply}")


if __name__ == "__main__":
    main()
