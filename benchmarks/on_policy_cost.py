"""Cost of on-policy calibration: `BlockReplay` (the model's blocks replayed one at a time) against a forward per layer,
and the fused SDPA path of compacted attention against the torch reference.

Every variant compacts the same context with `hf_structkv.compact` (KV-Surgeon, repeat-pass queries,
``on_policy=True``) in one process, one after the other: ``block replay`` (the default pipeline on CPU),
``forward per layer`` (``compact(block_replay=False)``: the path the pipeline takes for a model whose blocks cannot
be replayed) and ``block replay, reference attention`` (``HF_STRUCTKV_ATTENTION_BACKEND=reference``: the uncompacted
context served by the plain-torch reference instead of SDPA). The compacted caches must agree (held-out loss, largest
tensor difference from the first variant's), so the table is a pure cost comparison. Speed claims are ratios of wall
times measured side by side.

    python benchmarks/on_policy_cost.py --squad-article Normans --paragraphs 3 --ratio 10 \\
        --out benchmarks/results/on_policy_cost.json

``--tiny`` runs the same code on a random tiny model (a smoke test, times meaningless).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import transformers

from hf_structkv.attention.backend import BACKEND_ENV
from hf_structkv.compaction import compact
from hf_structkv.models import load_default_model, tiny_byte_tokenizer, tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's helpers, also when imported by path
from results_json import write_json  # noqa: E402

VARIANTS = ("block replay", "forward per layer", "block replay, reference attention")


def context(tokenizer, args) -> torch.Tensor:
    """The chat-formatted SQuAD article prefix (or, ``--tiny``, seeded bytes), ids ``[1, T]``."""
    if args.tiny:
        return torch.randint(3, 256, (1, 96), generator=torch.Generator().manual_seed(0))
    from hf_structkv.eval.squad import squad_document
    from hf_structkv.prompts import document_chat_prompt

    text, _ = document_chat_prompt(tokenizer, squad_document(args.squad_article, args.paragraphs).text)
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids


def run(model, tokenizer, ids: torch.Tensor, variant: str, args) -> tuple[dict, object]:
    backend = os.environ.get(BACKEND_ENV)
    if variant.endswith("reference attention"):
        os.environ[BACKEND_ENV] = "reference"
    try:
        start = time.perf_counter()
        cache = compact(
            model,
            tokenizer,
            ids,
            ratio=args.ratio,
            on_policy=True,
            query_cap=args.query_cap,
            progress=False,
            block_replay=variant != "forward per layer",
        )
        seconds = time.perf_counter() - start
    finally:
        if backend is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = backend
    loss = cache.metadata["quality"]["heldout_relative_loss_mean"]
    return {"variant": variant, "seconds": seconds, "heldout_relative_loss": loss}, cache


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--squad-article", default="Normans")
    parser.add_argument("--paragraphs", type=int, default=3)
    parser.add_argument("--ratio", type=float, default=10.0)
    parser.add_argument("--query-cap", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS[:2]))
    parser.add_argument("--out", default="benchmarks/results/on_policy_cost.json")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    if args.tiny:
        model, tokenizer = tiny_model("qwen2", vocab_size=300), tiny_byte_tokenizer()
    else:
        model, tokenizer = load_default_model()
    ids = context(tokenizer, args)
    rows, caches = [], []
    for variant in args.variants:
        row, cache = run(model, tokenizer, ids, variant, args)
        rows.append(row)
        caches.append(cache)
    for row, cache in zip(rows, caches, strict=True):
        row["seconds_over_first"] = row["seconds"] / rows[0]["seconds"]
        row["max_abs_difference_from_first"] = max(
            (a - b).abs().max().item() if a.numel() else 0.0
            for first, mine in zip(caches[0].layers, cache.layers, strict=True)
            for a, b in zip(first.context_tensors(), mine.context_tensors(), strict=True)
        )
    print(f"context tokens: {ids.shape[1]}, ratio {args.ratio:g}, threads {args.threads}")
    print(f"{'on-policy calibration':<36}{'seconds':>10}{'x first':>9}{'held-out loss':>15}{'max |diff|':>12}")
    for row in rows:
        print(
            f"{row['variant']:<36}{row['seconds']:>10.1f}{row['seconds_over_first']:>9.2f}"
            f"{row['heldout_relative_loss']:>15.5f}{row['max_abs_difference_from_first']:>12.1e}"
        )
    payload = {
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "context_tokens": ids.shape[1],
        "environment": {"torch": torch.__version__, "transformers": transformers.__version__},
        "rows": rows,
    }
    return write_json(args.out, payload, started=started)


if __name__ == "__main__":
    main()
