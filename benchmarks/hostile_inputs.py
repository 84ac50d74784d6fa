"""Issue 34's hostile-input count: a fixed, seeded catalogue of bad inputs against the saved formats, the API and the
command line (tiny models, offline), each sorted into one outcome class: refused with a clear error (ValueError /
TypeError, or exit 2 with one ``error:`` line, naming the field or argument), handled correctly (loads and
round-trips, a correct result), silently accepted wrong (loads something else than the file, does not round-trip,
serves NaN), unhelpful error (another exception, a traceback, or a message naming neither), resource exhaustion
(MemoryError, more than 256 MiB of resident memory or 30 s). Target: 0 silent, 0 unhelpful, 0 exhausted.

The catalogue and the classifier are the fuzz suite's (``tests/fuzz/hostile_*.py``: the formats' field edits,
whole-file replacements, safetensors headers, raw bytes and stored numbers; every argument of the public API; the
``hf-structkv`` commands run in-process with the tiny Llama); its tests assert the same outcomes.

    .venv/bin/python benchmarks/hostile_inputs.py --out benchmarks/results/hostile_inputs.json
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local typo must never reach the Hub; nothing here downloads
TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "fuzz"), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from hostile_api import api_cases  # noqa: E402
from hostile_artifacts import Artifacts  # noqa: E402
from hostile_cli import cli_cases  # noqa: E402
from hostile_formats import format_cases  # noqa: E402
from hostile_outcomes import OUTCOME_TITLES, OUTCOMES, Case, Result, run_case  # noqa: E402
from results_json import write_json  # noqa: E402


def catalogue(arts: Artifacts, work: Path, seed: int) -> list[Case]:
    """Every case, in a fixed order: formats, API, CLI (each category's own folder under ``work``)."""
    return [
        *format_cases(arts, work / "formats", seed),
        *api_cases(arts, work / "api"),
        *cli_cases(arts, work / "cli"),
    ]


def tally(results: list[Result], key) -> dict[str, dict[str, int]]:
    """``{key(result): {outcome: count}}`` (every outcome listed, 0 included)."""
    table: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for result in results:
        table[key(result)][result.outcome] += 1
    return {name: {outcome: counts[outcome] for outcome in OUTCOMES} for name, counts in table.items()}


def markdown_table(rows: dict[str, dict[str, int]]) -> str:
    header = "| | cases | " + " | ".join(OUTCOME_TITLES[o] for o in OUTCOMES) + " |"
    lines = [header, "|---|---:|" + "---:|" * len(OUTCOMES)]
    for name, counts in rows.items():
        lines.append(f"| {name} | {sum(counts.values())} | " + " | ".join(str(counts[o]) for o in OUTCOMES) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampled format edits (default 0)")
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory(prefix="hostile-inputs-") as tmp:
        work = Path(tmp)
        arts = Artifacts.build(work / "originals")
        results = [run_case(case) for case in catalogue(arts, work, args.seed)]
    by_category = tally(results, lambda r: r.case.category)
    totals = tally(results, lambda r: "all")["all"]
    print(markdown_table({**by_category, "all": totals}))
    print()
    print(markdown_table(tally(results, lambda r: f"{r.case.category}: {r.case.target}")))
    bad = [r for r in results if r.outcome not in ("refused", "handled")]
    for result in bad:
        print(f"{result.outcome}: {result.case.target} | {result.case.name}: {result.detail}")
    payload = {
        "seed": args.seed,
        "cases": len(results),
        "outcome_titles": OUTCOME_TITLES,
        "totals": totals,
        "by_category": by_category,
        "by_target": tally(results, lambda r: f"{r.case.category}: {r.case.target}"),
        "not_refused_or_handled": [
            {
                "category": r.case.category,
                "target": r.case.target,
                "case": r.case.name,
                "outcome": r.outcome,
                "detail": r.detail,
            }
            for r in bad
        ],
        "slowest_seconds": max(r.seconds for r in results),
        "largest_memory_growth_mib": max(r.memory_growth for r in results) / 2**20,
        "cases_listed": [
            {"category": r.case.category, "target": r.case.target, "case": r.case.name, "outcome": r.outcome}
            for r in results
        ],
    }
    return write_json(args.out, payload, started=started)


if __name__ == "__main__":
    main()
