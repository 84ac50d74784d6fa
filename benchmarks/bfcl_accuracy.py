"""BFCL accuracy of constrained function calling on the mixed-precision cache, policies side by side.

Each case of the chosen BFCL categories and split (seeded 1:1:3 calibration / development / test split, tool sets kept
whole; `hf_structkv.eval.bfcl`) is answered greedily by the embedded model under the tools' JSON schema
(`generate_calls`, batch 1) with a `StructuredMixedPrecisionCache` under each policy, and scored by BFCL's own AST
checker. Reported per policy: accuracy overall and per category, mean measured payload ratio B, and the physical
bytes after generation next to a `DynamicCache` of the same tokens. Choices belong on ``--split development``;
``--split test`` is for final reporting. (Not named ``bfcl_eval.py``: run as a script, that name would shadow the
``bfcl_eval`` package.)

    python benchmarks/bfcl_accuracy.py --categories simple_python multiple parallel parallel_multiple \
        --split development --limit 10 --policy all_high illustrative --out benchmarks/results/bfcl_accuracy.json

PASK's Fig. 5 ablations side by side at an aligned Decode budget: calibrate each variant (``hf-structkv calibrate
--tag-view ... / --layer-groups 1 --decode-only --out DIR``), then pass the folders with ``--decode-budget B``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
import transformers

from hf_structkv.eval.bfcl import CATEGORIES, SPLITS, bfcl_split, evaluate_bfcl
from hf_structkv.models import load_default_model
from hf_structkv.policy import PolicyTable, calibrated_policy, illustrative_policy

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's helpers, also when imported by path
from results_json import write_json  # noqa: E402


def load_policy(name: str, model) -> PolicyTable:
    """``all_high``, ``illustrative`` (hand-written, not calibrated), ``calibrated`` (the shipped Algorithm 1 table) or
    a saved `PolicyTable` folder."""
    if name == "all_high":
        return PolicyTable.all_high(model)
    if name == "illustrative":
        return illustrative_policy(model)
    if name == "calibrated":
        return calibrated_policy(model)
    if not Path(name).is_dir():
        raise ValueError(f"--policy must be all_high, illustrative, calibrated or a PolicyTable folder, got {name!r}")
    return PolicyTable.from_pretrained(name, model=model)


def at_decode_budget(table: PolicyTable, budget: float | None) -> PolicyTable:
    """``table`` served at Decode budget ``B_D = budget`` (``None``: its own); the all-high reference is left as is."""
    if budget is None or table.provenance == "reference":
        return table
    return dataclasses.replace(table, budget=budget)


def print_table(
    results: list[dict],
    groups: list[str],
    group_key: str = "per_category",
    score_key: str = "accuracy",
    score_label: str = "accuracy",
    width: int = 16,
) -> None:
    """One row per ``{"policy", "summary"}`` result: cases, the overall score, the score of each group (a BFCL
    category, a Spider hardness level; ``summary[group_key][group][score_key]``), mean B, bytes and time."""
    score_width = max(8, len(score_label) + 2)
    header = f"{'policy':<16}{'cases':>6}{score_label:>{score_width}}"
    print(
        header + "".join(f"{g[: width - 2]:>{width}}" for g in groups) + f"{'mean B':>8}{'stored MB':>11}"
        f"{'Dynamic MB':>12}{'s / case':>10}"
    )
    for result in results:
        summary = result["summary"]
        per_group = "".join(
            f"{summary[group_key][g][score_key]:>{width}.1%}" if g in summary[group_key] else f"{'':>{width}}"
            for g in groups
        )
        print(
            f"{result['policy']:<16}{summary['cases']:>6}{summary[score_key]:>{score_width}.1%}{per_group}"
            f"{summary['mean_budget_ratio']:>8.3f}{summary['nbytes'] / 2**20:>11.2f}"
            f"{summary['full_nbytes'] / 2**20:>12.2f}{summary['seconds'] / summary['cases']:>10.1f}"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--categories", nargs="+", default=list(CATEGORIES[:4]), choices=CATEGORIES)
    parser.add_argument("--split", default="development", choices=SPLITS)
    parser.add_argument("--limit", type=int, default=10, help="cases per category (the split's seeded sample)")
    parser.add_argument("--seed", type=int, default=0, help="split seed")
    parser.add_argument(
        "--policy", nargs="+", default=["all_high", "illustrative"], help="all_high | illustrative | calibrated | PATH"
    )
    parser.add_argument(
        "--decode-budget",
        type=float,
        default=None,
        help="serve every compressing table at this B_D (PASK Fig. 5: ablations at an aligned Decode budget)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/bfcl_accuracy.json")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    started = time.perf_counter()

    torch.set_num_threads(args.threads)
    entries = bfcl_split(args.categories, args.split, seed=args.seed, limit=args.limit)
    model, tokenizer = load_default_model()
    results = []
    for name in args.policy:
        policy = at_decode_budget(load_policy(name, model), args.decode_budget)
        evaluation = evaluate_bfcl(model, tokenizer, entries, policy, max_new_tokens=args.max_new_tokens, progress=True)
        results.append({"policy": name, "summary": evaluation.summary, "records": evaluation.records})

    print(f"BFCL v4 {args.split} split (seed {args.seed}), {len(entries)} cases, {args.threads} thread(s)")
    print_table(results, args.categories)
    payload = {
        "model": model.config.name_or_path,
        "categories": args.categories,
        "split": args.split,
        "seed": args.seed,
        "limit_per_category": args.limit,
        "max_new_tokens": args.max_new_tokens,
        "decode_budget": args.decode_budget,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "results": results,
    }
    write_json(args.out, payload, started=started)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
