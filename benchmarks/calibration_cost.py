"""Calibration cost per case: Runtime-V by likelihood replays against Runtime-V by generated verdicts, side by side.

Runtime-V (every intervention of every bucket on a calibration case, both stages) is the part of Algorithm 1 whose
cost grows with the calibration split: the reference trajectories are generated once and shared, and the development
stage runs per candidate. For ``--cases`` calibration cases spread over the paper-sized split (the one
``hf-structkv calibrate --calibration-cases 64 --test-reserved 56`` builds), this runs `calibrate`'s Runtime-V pass
(``runtime_v_shard``: exactly that case) with ``sensitivity="likelihood"`` and then ``"verdict"``, case after case,
into a fresh store seeded only with the committed reference trajectories, and records the wall time and the number
of interventions each measured (the rest are skipped: an intervention that cannot reach the reply is a zero loss or
the reference's verdict without a run).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/calibration_cost.py --cases 2 \
        --out benchmarks/results/calibration_cost.json
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from hf_structkv.calibration import CalibrationSettings, calibrate
from hf_structkv.eval.bfcl import bfcl_calibration_cases, bfcl_split

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bfcl_budget import load_model  # noqa: E402
from results_json import write_json  # noqa: E402
from runtime_v_resume import spread  # noqa: E402

CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple")
SENSITIVITIES = ("likelihood", "verdict")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=2, help="calibration cases, spread over the split")
    parser.add_argument("--calibration-cases", type=int, default=64, help="per category, as calibrate's")
    parser.add_argument("--test-reserved", type=int, default=56)
    parser.add_argument("--dev-cases", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument(
        "--reference-cache",
        default="benchmarks/results/calibration_cache",
        help="folder whose reference-*.json trajectories seed the fresh store (the reference pass is shared)",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/calibration_cost.json")
    args = parser.parse_args(argv)
    if args.cases < 1:
        parser.error("--cases must be >= 1")
    return args


def runtime_v(model, tokenizer, calibration, development, settings, store: Path, index: int) -> dict:
    """Wall time and measured interventions of Runtime-V on calibration case ``index`` alone."""
    start = time.perf_counter()
    result = calibrate(
        model,
        tokenizer,
        calibration,
        development,
        settings,
        cache_dir=store,
        log=lambda line: None,
        runtime_v_shard=(index, len(calibration)),
    )
    seconds = time.perf_counter() - start
    measured = {stage: result.report[stage]["measured"] for stage in settings.stages}
    return {"seconds": round(seconds, 2), "measured": measured, "interventions": sum(measured.values())}


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    calibration = bfcl_calibration_cases(CATEGORIES, limit=args.calibration_cases, test_reserved=args.test_reserved)
    development = bfcl_split(CATEGORIES, "development", limit=args.dev_cases)
    model, tokenizer = load_model(False)
    indices = spread(list(range(len(calibration))), args.cases)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        store = Path(folder)
        for reference in Path(args.reference_cache).glob("reference-*.json"):
            shutil.copy(reference, store / reference.name)
        for index in indices:
            case = calibration[index]
            row = {"case": case.id, "category": case.category, "index": index}
            for sensitivity in SENSITIVITIES:
                settings = CalibrationSettings(max_new_tokens=args.max_new_tokens, sensitivity=sensitivity)
                row[sensitivity] = runtime_v(model, tokenizer, calibration, development, settings, store, index)
                print(f"{case.id}: {sensitivity} {row[sensitivity]}", flush=True)
            rows.append(row)
    totals = {s: sum(r[s]["seconds"] for r in rows) for s in SENSITIVITIES}
    count = {s: sum(r[s]["interventions"] for r in rows) for s in SENSITIVITIES}
    summary = {
        "seconds_per_case": {s: round(totals[s] / len(rows), 1) for s in SENSITIVITIES},
        "seconds_per_intervention": {s: round(totals[s] / max(1, count[s]), 2) for s in SENSITIVITIES},
        "verdict_over_likelihood": round(totals["verdict"] / totals["likelihood"], 2),
    }
    print(f"{'case':<28}{'likelihood s':>14}{'verdict s':>12}{'interventions':>15}")
    for r in rows:
        print(
            f"{r['case']:<28}{r['likelihood']['seconds']:>14.1f}{r['verdict']['seconds']:>12.1f}"
            f"{r['verdict']['interventions']:>15}"
        )
    print(summary)
    write_json(
        args.out,
        {
            "threads": args.threads,
            "rows": rows,
            "summary": summary,
        },
        started=started,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
