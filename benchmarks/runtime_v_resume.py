"""Runtime-V interventions, full generation against resumed from the reference (side by side, one case).

For one BFCL calibration case: its all-high reference, the recording of its K/V (`ReferenceKV.record`, one
generation), then ``--interventions`` interventions ``R`` in the middle layer group, each generated in full
(`run_case`) and resumed (`resumed_case_run`), timed one after the other, and checked equal (tokens, tags, text,
verdict). ``--stage decode``: decode buckets that reach generation, spread over their first changed forward ``k0``;
``--stage prefill``: prompt labels the intervention lowers, resumed after the prompt forward (``k0 = 1``).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/runtime_v_resume.py --out benchmarks/results/runtime_v_resume.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/runtime_v_resume.py --stage prefill --category parallel_multiple \
        --out benchmarks/results/runtime_v_resume_prefill.json
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch
import transformers

from hf_structkv.calibration import BfclTask, Bucket, BucketIntervention, reaches_generation
from hf_structkv.calibration.interventions import prefill_intervention_plan, prefill_positions
from hf_structkv.calibration.references import reference_trajectories, run_case
from hf_structkv.calibration.resume import ReferenceKV, first_changed_forward, resumed_case_run
from hf_structkv.eval.bfcl import CATEGORIES, bfcl_split
from hf_structkv.policy import Action, GroupCosts, PolicyTable
from hf_structkv.structure.prompt_spans import PROMPT_LABELS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bfcl_budget import load_model  # noqa: E402
from results_json import write_json  # noqa: E402

BFCL = BfclTask()


def spread(items: list, count: int) -> list:
    """``count`` items of ``items`` at evenly spaced indices (all when fewer)."""
    if count >= len(items):
        return list(items)
    return [items[round(i * (len(items) - 1) / max(1, count - 1))] for i in range(count)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", default="decode", choices=["decode", "prefill"])
    parser.add_argument("--category", default="parallel", choices=CATEGORIES)
    parser.add_argument("--case-index", type=int, default=0, help="index in the category's calibration partition")
    parser.add_argument("--interventions", type=int, default=6)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tiny", action="store_true", help="random tiny model, byte tokenizer (smoke test)")
    parser.add_argument("--out", default="benchmarks/results/runtime_v_resume.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.tiny)
    entry = bfcl_split([args.category], "calibration", limit=args.case_index + 1)[args.case_index]
    window, cap = args.window, args.max_new_tokens
    (reference,) = reference_trajectories(model, tokenizer, BFCL, [entry], cap, window, 4)
    start = time.perf_counter()
    all_high = PolicyTable.all_high(model, window=window, sink_tokens=4)
    recorded = ReferenceKV.record(model, tokenizer, BFCL, entry, reference, all_high, cap)
    record_seconds = time.perf_counter() - start
    if recorded is None:
        raise SystemExit("the recording did not reproduce the reference: nothing to resume")
    costs = GroupCosts.from_config(model.config)
    if args.stage == "decode":
        keys = {key for tags in reference.tags if tags for key in tags if reaches_generation(reference, key, window)}
        by_forward = sorted(keys, key=lambda key: (first_changed_forward(reference, key, window), key))
        chosen = [(key, first_changed_forward(reference, key, window)) for key in by_forward]
    else:
        chosen = [(label, 1) for label in PROMPT_LABELS if prefill_positions(reference, label, 4, window)]
    rows = []
    for key, forward in spread(chosen, args.interventions):
        bucket = Bucket(key, 1)
        if args.stage == "decode":
            policy, plan = BucketIntervention(costs, bucket, Action.R, 4, window), None
        else:
            policy, plan = all_high, prefill_intervention_plan(reference, bucket, Action.R, 4, window)
        start = time.perf_counter()
        fresh = run_case(model, tokenizer, BFCL, entry, policy, cap, prefill_plan=plan)[0]
        fresh_seconds = time.perf_counter() - start
        start = time.perf_counter()
        resumed = resumed_case_run(model, tokenizer, BFCL, entry, policy, cap, recorded, forward, prefill_plan=plan)
        resumed_seconds = time.perf_counter() - start
        rows.append(
            {
                "bucket": f"{args.stage}:{key}::middle",
                "first_changed_forward": forward,
                "generated_tokens": len(fresh.tokens),
                "fresh_seconds": fresh_seconds,
                "resumed_seconds": resumed_seconds,
                "equal": fresh == resumed,
                "valid": fresh.valid,
            }
        )
        print(
            f"{key:60s} k0 {forward:4d} / {len(fresh.tokens):4d} tokens  full {fresh_seconds:6.1f} s  "
            f"resumed {resumed_seconds:6.1f} s  equal {fresh == resumed}",
            flush=True,
        )
    fresh_total = sum(row["fresh_seconds"] for row in rows)
    resumed_total = sum(row["resumed_seconds"] for row in rows)
    result = {
        "model": "tiny qwen2" if args.tiny else "embedded Qwen2.5-Coder-0.5B-Instruct",
        "stage": args.stage,
        "case": entry.id,
        "prompt_tokens": len(reference.prompt_ids),
        "reference_tokens": len(reference.tokens),
        "window": window,
        "max_new_tokens": cap,
        "threads": args.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.processor() or platform.machine(),
        "record_seconds": record_seconds,
        "rows": rows,
        "all_equal": all(row["equal"] for row in rows),
        "fresh_seconds": fresh_total,
        "resumed_seconds": resumed_total,
        "speedup_per_intervention": fresh_total / resumed_total if resumed_total else None,
    }
    print(
        f"{entry.id}: {len(rows)} interventions, all equal: {result['all_equal']}; full {fresh_total:.1f} s, resumed "
        f"{resumed_total:.1f} s + one recording {record_seconds:.1f} s"
    )
    return write_json(args.out, result, started=started)


if __name__ == "__main__":
    main()
