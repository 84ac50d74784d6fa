"""The ``hf-structkv calibrate`` subcommand: options and the run (BFCL data, `calibrate`, saving)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..policy.costs import GROUP_COUNTS
from ..quant.int4_centred import INT4_KEY_LAYOUTS
from ..structure.tags import TAG_VIEWS
from ..validation import int_option
from .settings import SENSITIVITIES

__all__ = ["CPU_SIZES", "PAPER_SIZES", "add_calibrate_options", "run_calibrate"]

CPU_SIZES = {"calibration_cases": 3, "dev_cases": 3, "max_dev_candidates": 3, "max_new_tokens": 128}
"""Defaults sized for a CPU: cases per category of each partition, candidates evaluated per path, generation cap."""
PAPER_SIZES = {"calibration_cases": None, "dev_cases": None, "max_dev_candidates": None, "max_new_tokens": 192}
"""``--paper-sizes``: whole calibration / development partitions, every candidate, 192 new tokens (D.8)."""


def _tau(text: str) -> tuple[float, float]:
    try:
        low, high = (float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--tau takes LOW,HIGH (e.g. 0.005,0.01), got {text!r}") from None
    return low, high


def _shard(text: str) -> tuple[int, int]:
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard takes I/N (e.g. 0/2), got {text!r}") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"--shard I/N needs 0 <= I < N, got {text!r}")
    return index, count


def add_calibrate_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``hf-structkv calibrate`` (after the shared ``--model`` / ``--dtype``)."""
    from ..eval.bfcl import CATEGORIES

    parser.add_argument("--benchmark", default="bfcl", choices=["bfcl"], help="calibration data (BFCL v4)")
    parser.add_argument(
        "--out", help="folder for policy_table.json, prefill_policy.json, report (required unless --references-only)"
    )
    parser.add_argument("--categories", nargs="+", default=["simple_python", "multiple"], choices=CATEGORIES)
    parser.add_argument(
        "--calibration-cases", type=int_option(1), help="cases per category of the calibration partition"
    )
    parser.add_argument("--dev-cases", type=int_option(1), help="cases per category of the development partition")
    parser.add_argument(
        "--max-dev-candidates",
        type=int_option(1),
        help="candidates evaluated per greedy path: the cheapest first, then bisection for the cheapest within alpha "
        "(default 3; --paper-sizes: all)",
    )
    parser.add_argument("--max-new-tokens", type=int_option(1), help="generation cap (default 128; --paper-sizes: 192)")
    parser.add_argument(
        "--paper-sizes",
        action="store_true",
        help="the paper's sizes (whole partitions, every candidate evaluated): for a GPU",
    )
    parser.add_argument("--tau", type=_tau, action="append", help="threshold pair LOW,HIGH (repeatable)")
    parser.add_argument("--alpha-decode", type=float, default=0.05)
    parser.add_argument("--alpha-prefill", type=float, default=0.02)
    parser.add_argument("--window", type=int_option(1), default=None, help="recent window of the table (default 32)")
    stages = parser.add_mutually_exclusive_group()
    stages.add_argument("--decode-only", action="store_true", help="skip the prefill companion")
    stages.add_argument(
        "--prefill-only",
        action="store_true",
        help="calibrate the prefill companion only (it runs with decode all-high either way): writes "
        "prefill_policy.json and the report, no decode table",
    )
    parser.add_argument(
        "--tag-view",
        default="full",
        choices=TAG_VIEWS,
        help="structural ablation (PASK Fig. 5): calibrate and serve with the role, the class, or the parser state "
        "and lookahead removed from the tags, or (position_bins) with each token tagged by its position bin instead "
        "of the parser's transitions (default: full tags)",
    )
    parser.add_argument(
        "--layer-groups",
        type=int,
        default=3,
        choices=GROUP_COUNTS,
        help="3: PASK's lower / middle / upper groups; 1: the no-layer-groups ablation (PASK Fig. 5), one action "
        "per token for every layer (with --decode-only)",
    )
    parser.add_argument(
        "--sensitivity",
        default="verdict",
        choices=SENSITIVITIES,
        help="Runtime-V by generated verdicts (the paper's protocol), by the teacher-forced likelihood loss of the "
        "reference replies (one forward per intervention; development selection by likelihood, confirmed by "
        "verdicts), or by replayed verdicts (the verdicts, each intervention generated only where its teacher-forced "
        "greedy reply leaves the reference)",
    )
    parser.add_argument(
        "--max-confirmations",
        type=int_option(1),
        default=3,
        help="with --sensitivity likelihood: candidates passing by likelihood confirmed by development verdicts, "
        "cheapest first, before the all-high fallback",
    )
    parser.add_argument(
        "--curve-pairs",
        type=int_option(1),
        default=96,
        help="with --sensitivity likelihood: Runtime-V interventions per stage also generated and scored, to fit the "
        "loss curve that reads development likelihood losses as an expected change of the error rate",
    )
    parser.add_argument(
        "--int4-keys",
        choices=INT4_KEY_LAYOUTS,
        default="row",
        help="INT4 key layout of the L action in every run of the calibration and in the calibrated policies "
        "(centred: each row's keys centred and scaled per channel by the prompt's mean and range); the stores of a "
        "centred run are kept apart from a row run's in one --cache-dir, the reference trajectories are shared",
    )
    parser.add_argument("--seed", type=int, default=0, help="split and torch seed")
    parser.add_argument(
        "--cache-dir",
        help="cache of reference trajectories, Runtime-V verdicts and development cases: a stopped run started "
        "again resumes from it "
        "(default ~/.cache/hf_structkv/calibration)",
    )
    parser.add_argument("--threads", type=int_option(1), help="torch CPU threads")
    parser.add_argument(
        "--test-reserved",
        type=int_option(0),
        help="top each category's calibration cases up to --calibration-cases from its test partition after its "
        "first N cases (keep N >= the test cases bfcl_budget.py evaluates, 56 per category on the results page); "
        "default: the calibration partition only",
    )
    parser.add_argument(
        "--references-only",
        action="store_true",
        help="generate the reference trajectories of the calibration and development cases into --cache-dir and "
        "stop (for background runs in pieces; --out is not written)",
    )
    parser.add_argument(
        "--shard",
        type=_shard,
        default=(0, 1),
        help="with --references-only or --runtime-v-only: I/N takes every N-th case from the I-th (0-based), so N "
        "processes sharing one --cache-dir split the work",
    )
    parser.add_argument(
        "--runtime-v-only",
        action="store_true",
        help="measure the Runtime-V interventions of the --shard's calibration cases into --cache-dir and stop "
        "(a later full run reads them back; --out is not written)",
    )


def run_calibrate(args: argparse.Namespace, load_model) -> int:
    """Load the model (``load_model(name)``) and the BFCL partitions, run `calibrate`, save the result in ``--out``."""
    from ..eval.bfcl import bfcl_calibration_cases, bfcl_split
    from ..policy.table import DEFAULT_WINDOW
    from .bfcl_task import BfclTask
    from .floors import DEFAULT_THRESHOLDS
    from .references import reference_trajectories
    from .runner import calibrate
    from .settings import CalibrationSettings

    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = dict(PAPER_SIZES if args.paper_sizes else CPU_SIZES)
    for name in sizes:
        if getattr(args, name) is not None:
            sizes[name] = getattr(args, name)
    settings = CalibrationSettings(
        max_new_tokens=sizes["max_new_tokens"],
        window=args.window or DEFAULT_WINDOW,
        thresholds=tuple(args.tau or DEFAULT_THRESHOLDS),
        alpha_decode=args.alpha_decode,
        alpha_prefill=args.alpha_prefill,
        max_dev_candidates=sizes["max_dev_candidates"],
        stages=("decode",) if args.decode_only else ("prefill",) if args.prefill_only else ("decode", "prefill"),
        seed=args.seed,
        tag_view=args.tag_view,
        layer_groups=args.layer_groups,
        sensitivity=args.sensitivity,
        max_confirmations=args.max_confirmations,
        curve_pairs=args.curve_pairs,
        int4_keys=args.int4_keys,
    )
    if not args.out and not (args.references_only or args.runtime_v_only):
        raise ValueError("--out is required: the folder the calibrated policies and the report are written to")
    if args.references_only and args.runtime_v_only:
        raise ValueError("--references-only and --runtime-v-only are two passes: run them one after the other")
    if args.shard != (0, 1) and not (args.references_only or args.runtime_v_only):
        raise ValueError(
            "--shard splits the reference or Runtime-V pass: pass it with --references-only or --runtime-v-only"
        )
    calibration = bfcl_calibration_cases(
        args.categories, seed=args.seed, limit=sizes["calibration_cases"], test_reserved=args.test_reserved
    )
    development = bfcl_split(args.categories, "development", seed=args.seed, limit=sizes["dev_cases"])
    model, tokenizer = load_model(args.model)
    cache_dir = Path(args.cache_dir) if args.cache_dir else Path.home() / ".cache" / "hf_structkv" / "calibration"
    if args.references_only:
        index, count = args.shard
        cases = (calibration + development)[index::count]
        reference_trajectories(
            model,
            tokenizer,
            BfclTask(),
            cases,
            settings.max_new_tokens,
            settings.window,
            settings.sink_tokens,
            cache_dir=cache_dir,
            progress=True,
        )
        print(f"{len(cases)} reference trajectories in {cache_dir}")
        return 0
    data = {
        "benchmark": "BFCL v4 (bfcl-eval)",
        "categories": list(args.categories),
        "split_seed": args.seed,
        "calibration_cases_per_category": sizes["calibration_cases"],
        "test_cases_reserved_per_category": args.test_reserved,
        "development_cases_per_category": sizes["dev_cases"],
        "model": args.model,
    }
    shard = args.shard if args.runtime_v_only else None
    result = calibrate(
        model,
        tokenizer,
        calibration,
        development,
        settings,
        cache_dir=cache_dir,
        progress=True,
        data=data,
        runtime_v_shard=shard,
    )
    if shard is not None:
        print(json.dumps(result.report))
        return 0
    result.save_pretrained(args.out)
    if result.table is not None:
        decode = result.report["decode"]["selected"]
        print(json.dumps({"decode_budget": result.table.budget, "decode_selected": decode}, indent=1))
    if result.prefill_policy is not None:
        selected = result.report["prefill"]["selected"]
        print(json.dumps({"prefill_budget": result.prefill_policy.budget, "prefill_selected": selected}, indent=1))
    print(f"saved -> {args.out}")
    return 0
