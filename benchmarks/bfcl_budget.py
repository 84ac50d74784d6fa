"""BFCL accuracy against the measured total KV budget B: PASK and the decode-time baselines on the same
mixed-precision cache, the same ledger (B.3) and the same held-out cases (PASK Table 1 / Fig. 3 protocol, CPU-sized).

1. Development split only: Full KV answers the first ``--dev-cases`` cases of each category; their prompt and decoded
   lengths fix each baseline's budget knob by its knob arithmetic (`for_budget`: StreamingLLM's recent prompt tokens,
   SnapKV's and CriticalKV's prompt ratio, H2O's and MiKV's heavy ratio; the other Table 8 knobs at the stated
   defaults, the recent window equal to PASK's). Nothing is chosen on the test split. A run of Full KV and PASK at
   equal stage budgets alone uses no lengths and skips this step (``dev_cases_per_category`` 0 in its JSON).
2. Test split: every method answers the first ``--cases`` test cases of each category greedily under the tools' JSON
   schema (`evaluate_bfcl`, batch 1), scored by BFCL's AST checker, at each target B < 1 (B = 1 keeps everything:
   that row is Full KV, run once). PASK runs its decode table and prefill policy with both budgets (``B_D``, ``B_P``)
   set to the target; floors are never crossed, so its measured B can exceed the target. Without ``--pask-policy``
   PASK is the shipped **illustrative** (hand-written, not calibrated) decode + prefill pair, labelled so.
   ``--pask-prefill`` swaps in the prefill policy of another shipped pair or folder (a stage swap, labelled so).
   ``--split development`` answers the development partition instead (Full KV and PASK rows only): PASK pairs are
   chosen between there, at the served budget, never on the test split.
3. Reported per method x target: measured total B (Σ scheduled payload / Σ Full-KV payload over the cases), mean
   per-case B, accuracy overall and per category, physical bytes after generation next to a DynamicCache of the same
   tokens, wall time; ``--out`` JSON, a Table-1-like printout and ``--plot`` (accuracy vs measured B).

    python benchmarks/bfcl_budget.py --out benchmarks/results/bfcl_budget.json --plot docs/img/bfcl_budget.png
    python benchmarks/bfcl_budget.py --full ...          # the paper's sizes: every test case, 8 categories
    python benchmarks/bfcl_budget.py --tiny ...          # smoke test: random tiny model, byte tokenizer
    python benchmarks/bfcl_budget.py --cases 8 --first-case 8 --out more.json    # the next 8 cases per category
    python benchmarks/bfcl_budget.py --merge first.json more.json --out all.json   # one table over both runs
    python benchmarks/bfcl_budget.py --compare all.json:full_kv other.json:pask    # paired, case for case

``--compare`` runs nothing: the rows named (``FILE:LABEL``, or ``FILE:LABEL@B`` where a file has the label at several
targets) are compared case for case with the first one: cases lost and gained, replies with the same text, and the
exact McNemar p-value of the difference (`hf_structkv.eval.paired`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import transformers

from hf_structkv.eval.bfcl import CATEGORIES, bfcl_split, evaluate_bfcl, summarise
from hf_structkv.eval.paired import paired_comparison
from hf_structkv.models import load_default_model, tiny_byte_tokenizer, tiny_model
from hf_structkv.policy import (
    H2O,
    CriticalKV,
    GroupCosts,
    MiKV,
    PolicyTable,
    PrefillPolicy,
    SnapKV,
    StreamingLLM,
    calibrated_policy,
    calibrated_prefill_policy,
    illustrative_policy,
    illustrative_prefill_policy,
)
from hf_structkv.policy.prefill import PREFILL_POLICY_NAME
from hf_structkv.policy.shipped import CALIBRATED, SHIPPED_PAIRS
from hf_structkv.quant import INT4_KEY_LAYOUTS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bfcl_accuracy import print_table  # noqa: E402
from results_json import write_json  # noqa: E402

BUDGETS = (0.25, 0.33, 0.5, 1.0)
BASELINES = {"streaming_llm": StreamingLLM, "h2o": H2O, "snapkv": SnapKV, "mikv": MiKV, "criticalkv": CriticalKV}
METHODS = ("full_kv", *BASELINES, "pask")
BASELINE_KNOBS = {  # Table 8 knobs other than the budget knob (the recent window is PASK's)
    "streaming_llm": {},
    "h2o": {"sink_tokens": 4},
    "snapkv": {"observation_window": 16, "pooling": "max", "kernel": 7},
    "mikv": {"sink_tokens": 4},
    "criticalkv": {"observation_window": 16, "pooling": "max", "kernel": 7, "first_stage_ratio": 0.5},
}


def load_model(tiny: bool):
    if tiny:
        tokenizer = tiny_byte_tokenizer()
        return tiny_model("qwen2", vocab_size=len(tokenizer), num_hidden_layers=3), tokenizer
    return load_default_model()


def load_pask(path: str | None, model, tiny: bool = False) -> tuple[PolicyTable, PrefillPolicy, str]:
    """The decode table and prefill policy of a policy folder (``policy_table.json``, optionally
    ``prefill_policy.json``; the illustrative prefill policy when absent), ``"calibrated"`` or a name of
    `SHIPPED_PAIRS`: that shipped calibrated pair (`calibrated_policy`, `calibrated_prefill_policy`), or the shipped
    illustrative pair (with ``tiny``: its entries on the tiny model's layer groups); and a label naming their
    provenance."""
    if path == CALIBRATED or path in SHIPPED_PAIRS:
        table, prefill = calibrated_policy(model, path), load_prefill(path, model)
    elif path is None and tiny:
        costs = GroupCosts.from_config(model.config)
        table = dataclasses.replace(illustrative_policy(), costs=costs, fingerprint=None)
        prefill = dataclasses.replace(illustrative_prefill_policy(), costs=costs, fingerprint=None)
    elif path is None:
        table, prefill = illustrative_policy(model), illustrative_prefill_policy(model)
    else:
        table = PolicyTable.from_pretrained(path, model=model)
        prefill = load_prefill(path, model) if is_prefill_source(path) else illustrative_prefill_policy(model)
    return table, prefill, pair_provenance(table, prefill)


def pair_provenance(table, prefill) -> str:
    """The provenance of a decode table and prefill policy served together: theirs, or both joined by ``+``."""
    return table.provenance if table.provenance == prefill.provenance else f"{table.provenance}+{prefill.provenance}"


def is_prefill_source(path: str) -> bool:
    """Whether ``path`` names a prefill policy: ``"calibrated"``, a name of `SHIPPED_PAIRS`, or a folder holding
    ``prefill_policy.json``."""
    return path == CALIBRATED or path in SHIPPED_PAIRS or (Path(path) / PREFILL_POLICY_NAME).is_file()


def load_prefill(path: str, model) -> PrefillPolicy:
    """The prefill policy of ``path`` (`is_prefill_source`; ValueError otherwise): a shipped pair's, or the
    folder's."""
    if not is_prefill_source(path):
        raise ValueError(f"--pask-prefill {path!r} is neither a shipped pair nor a folder with {PREFILL_POLICY_NAME}")
    if path == CALIBRATED or path in SHIPPED_PAIRS:
        return calibrated_prefill_policy(model, path)
    return PrefillPolicy.from_pretrained(path, model=model)


STAGE_SPLITS = ("equal", "calibrated_decode")


def pask_at(
    table: PolicyTable,
    prefill: PrefillPolicy,
    target: float,
    split: str = "equal",
    lengths: list[tuple[int, int]] | None = None,
) -> tuple[PolicyTable, PrefillPolicy]:
    """The same tables served at total budget ``target``.

    ``split="equal"``: ``B_D = B_P = target``. ``split="calibrated_decode"``: the decode table keeps the ``B_D``
    Algorithm 1 selected and the prefill budget takes the rest of the target on the development ``lengths``
    (``(prompt_tokens, decoded_tokens)`` per case, the baselines' knob arithmetic): ``B_P = (target (ΣP + ΣD) -
    B_D ΣD) / ΣP``, clipped to [0, 1].
    """
    if split == "equal":
        return dataclasses.replace(table, budget=target), dataclasses.replace(prefill, budget=target)
    if split != "calibrated_decode":
        raise ValueError(f"split must be one of {STAGE_SPLITS}, got {split!r}")
    if not lengths:
        raise ValueError("split='calibrated_decode' needs the development lengths")
    prompt, decoded = sum(p for p, _ in lengths), sum(d for _, d in lengths)
    prefill_budget = (target * (prompt + decoded) - table.budget * decoded) / prompt
    return table, dataclasses.replace(prefill, budget=min(1.0, max(0.0, prefill_budget)))


def development_lengths(records: list[dict], costs: GroupCosts) -> list[tuple[int, int]]:
    """``(prompt_tokens, decoded_tokens)`` of each development case: cached tokens from the Full-KV payload."""
    lengths = []
    for record in records:
        cached = round(record["full_payload_bytes"] * 8 / costs.full)
        lengths.append((record["prompt_tokens"], cached - record["prompt_tokens"]))
    return lengths


def summarise_budget(records: list[dict]) -> dict:
    """`summarise` of `evaluate_bfcl`'s per-case records plus the workload-weighted measured total B (Σ payload / Σ
    Full-KV payload) and, Table 17 style, the same ratio over the prompt tokens (``measured_B_P``) and over the
    generated tokens (``measured_B_D``)."""

    def pooled(payload: str, full: str) -> float:
        total = sum(r[full] for r in records)
        return sum(r[payload] for r in records) / total if total else 1.0

    return {
        **summarise(records),
        "measured_B": pooled("scheduled_payload_bytes", "full_payload_bytes"),
        "measured_B_P": pooled("prefill_payload_bytes", "prefill_full_bytes"),
        "measured_B_D": pooled("decode_payload_bytes", "decode_full_bytes"),
    }


def method_record(row: dict, records: list[dict], seconds: float) -> dict:
    """One output record: ``row`` (method, label, target_B, knobs, provenance), the budget summary of the per-case
    ``records`` and the records themselves."""
    summary = summarise_budget(records)
    return {
        **{key: row[key] for key in ("method", "label", "target_B")},
        "measured_B": summary["measured_B"],
        "measured_B_P": summary["measured_B_P"],
        "measured_B_D": summary["measured_B_D"],
        "mean_case_B": summary["mean_budget_ratio"],
        "accuracy": summary["accuracy"],
        "per_category": summary["per_category"],
        "cases": summary["cases"],
        "nbytes": summary["nbytes"],
        "full_nbytes": summary["full_nbytes"],
        "seconds": seconds,
        "knobs": row["knobs"],
        "provenance": row["provenance"],
        "records": records,
    }


SHARED_SETTINGS = ("model", "seed", "split", "window", "max_new_tokens", "torch", "transformers")
ANSWERED_SPLITS = ("test", "development")
"""``--split``: the partitions a run may answer (a result file without ``split`` answered the test split)."""


def _with_key_layout(knobs: dict) -> dict:
    """``knobs`` with the INT4 key layout: a row written before ``--int4-keys`` recorded none and served row keys."""
    return {"int4_keys": "row", **knobs}


def _setting(payload: dict, key: str):
    """A run's setting ``key`` (`SHARED_SETTINGS`); a file written before ``--split`` answered the test split."""
    return payload.get(key, "test" if key == "split" else None)


def merge_runs(payloads: list[dict]) -> dict:
    """One result from runs over disjoint cases (``--first-case``) or categories, with the same settings.

    Records join by (label, target B): their cases concatenate and the summary is recomputed over the union. Every
    joined row must cover the same cases as the others, so the merged table still compares methods case for case,
    and a method's knobs must agree between runs (baselines' knobs come from the development lengths of the run's
    categories: run the baselines over the same categories in every run).

    Raises:
        ValueError: fewer than two runs, settings that differ, a case twice in a row, rows over different cases, or
            one method with different knobs.
    """
    if len(payloads) < 2:
        raise ValueError(f"--merge needs at least two result files, got {len(payloads)}")
    for key in SHARED_SETTINGS:
        values = {json.dumps(_setting(p, key), sort_keys=True) for p in payloads}
        if len(values) > 1:
            raise ValueError(f"the runs differ in {key!r} ({sorted(values)}): merge only runs with the same settings")
    baseline_knobs: dict[str, dict] = {}  # the script's table of each run (it grew with the methods)
    for payload in payloads:
        for method, knobs in payload.get("baseline_knobs", {}).items():
            if baseline_knobs.setdefault(method, knobs) != knobs:
                raise ValueError(f"the runs ran {method} with different knobs ({baseline_knobs[method]} vs {knobs})")
    joined: dict[tuple[str, float], dict] = {}
    for payload in payloads:
        for record in payload["records"]:
            key = (record["label"], record["target_B"])
            knobs = _with_key_layout(record["knobs"])
            row = joined.setdefault(key, {**record, "knobs": knobs, "records": [], "seconds": 0.0})
            if row["knobs"] != knobs:
                raise ValueError(
                    f"{record['label']} at B={record['target_B']} has different knobs in two runs ({row['knobs']} vs "
                    f"{record['knobs']}): run it over the same categories in every run"
                )
            row["records"] += record["records"]
            row["seconds"] += record["seconds"]
    case_sets = {}
    for (label, target), row in joined.items():
        ids = [case["id"] for case in row["records"]]
        if len(ids) != len(set(ids)):
            raise ValueError(f"{label} at B={target} answers a case twice: the runs must cover disjoint cases")
        case_sets[(label, target)] = frozenset(ids)
    if len(set(case_sets.values())) > 1:
        sizes = {f"{label}@{target}": len(ids) for (label, target), ids in case_sets.items()}
        raise ValueError(f"the merged rows cover different cases ({sizes}): every method must answer every case")
    categories = list(dict.fromkeys(c for p in payloads for c in p["categories"]))
    return {
        **{key: _setting(payloads[0], key) for key in SHARED_SETTINGS},
        "categories": categories,
        "baseline_knobs": baseline_knobs,
        "merged_from": [
            {
                key: p.get(key)
                for key in ("categories", "first_case", "cases_per_category", "dev_lengths", "threads", "provenance")
            }
            for p in payloads
        ],
        "records": [method_record(row, row["records"], row["seconds"]) for row in joined.values()],
    }


def knobs_of(policy) -> dict:
    return {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy) if f.name != "costs"}


def plot(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for method in dict.fromkeys(r["label"] for r in records):
        rows = sorted((r for r in records if r["label"] == method), key=lambda r: r["measured_B"])
        style = "*" if method == "full_kv" else "o-"
        ax.plot([r["measured_B"] for r in rows], [100 * r["accuracy"] for r in rows], style, label=method)
    ax.set_xlabel("measured total KV budget B (scheduled payload / Full KV)")
    ax.set_ylabel("BFCL accuracy (%)")
    ax.set_title(f"BFCL test cases ({records[0]['cases']} per method x budget)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--categories", nargs="+", default=list(CATEGORIES[:4]), choices=CATEGORIES)
    parser.add_argument("--cases", type=int, default=1, help="test cases per category (the split's seeded sample)")
    parser.add_argument(
        "--first-case",
        type=int,
        default=0,
        help="skip this many test cases per category: runs with --first-case 0 --cases N, then --first-case N cover "
        "disjoint cases, joined by --merge",
    )
    parser.add_argument("--dev-cases", type=int, default=1, help="development cases per category for the knobs")
    parser.add_argument(
        "--split",
        default="test",
        choices=ANSWERED_SPLITS,
        help="the partition answered (--cases / --first-case count in it): 'development' compares PASK pairs at a "
        "target budget to choose between them, never on the test split; baselines, whose knobs come from the "
        "development cases, are refused there",
    )
    parser.add_argument("--budgets", nargs="+", type=float, default=list(BUDGETS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument(
        "--pask-policy",
        default=None,
        help="policy folder, 'calibrated' for the shipped calibrated decode + prefill pair, or an earlier shipped "
        f"pair by name ({', '.join(SHIPPED_PAIRS)}) (default: the shipped illustrative pair)",
    )
    parser.add_argument(
        "--pask-prefill",
        default=None,
        help="serve the --pask-policy decode table with the prefill policy of this shipped pair (by name) or policy "
        "folder instead of its own (a stage swap: its row is labelled 'pask +prefill NAME')",
    )
    parser.add_argument(
        "--pask-stage-split",
        choices=STAGE_SPLITS,
        default="equal",
        help="how PASK's rows split the target between the stages: equal (B_D = B_P = target) or calibrated_decode "
        "(the table's calibrated B_D, the prefill budget the rest of the target on the development lengths)",
    )
    parser.add_argument(
        "--ablation-policy", action="append", default=[], metavar="NAME=PATH", help="extra PASK rows (Fig. 5)"
    )
    parser.add_argument(
        "--int4-keys",
        choices=INT4_KEY_LAYOUTS,
        default=None,
        help="how the caches store the keys of INT4 tokens (StructuredMixedPrecisionCache's int4_keys): row (PASK "
        "B.5) or centred (by the prompt's per-channel centre and spread); default: each policy's own (row but for "
        "a pair shipped centred); rows served centred are labelled '... [centred keys]'",
    )
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--seed", type=int, default=0, help="split seed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--full", action="store_true", help="paper sizes: all 8 categories, every test case")
    parser.add_argument("--tiny", action="store_true", help="random tiny model and byte tokenizer (smoke test)")
    parser.add_argument(
        "--out",
        default=None,
        help="result JSON (default benchmarks/results/bfcl_budget.json; with --compare: written only when given)",
    )
    parser.add_argument("--plot", default=None)
    parser.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="FILE",
        help="run nothing: join the result files of runs over disjoint cases or categories (same settings) into "
        "--out, the table and --plot",
    )
    parser.add_argument(
        "--drop",
        action="append",
        default=[],
        metavar="FILE:LABEL",
        help="with --merge: leave out the rows labelled LABEL of the result file FILE (e.g. a superseded PASK row)",
    )
    parser.add_argument(
        "--compare",
        nargs="+",
        default=None,
        metavar="FILE:LABEL[@B]",
        help="run nothing: compare these rows of result files case for case with the first (lost / gained cases, "
        "same replies, exact McNemar p-value)",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.drop and not args.merge:
        parser.error("--drop only applies with --merge")
    if args.compare:
        if args.merge or len(args.compare) < 2:
            parser.error("--compare takes at least two FILE:LABEL rows and no --merge")
        return compare_rows(parser, args.compare, args.out, started)
    args.out = args.out or "benchmarks/results/bfcl_budget.json"
    if args.merge:
        payloads = {path: json.loads(Path(path).read_text()) for path in args.merge}
        for item in args.drop:
            path, sep, label = item.rpartition(":")
            if not sep or path not in payloads or label not in {r["label"] for r in payloads[path]["records"]}:
                parser.error(f"--drop takes FILE:LABEL with a --merge file and one of its row labels, got {item!r}")
            payloads[path] = {
                **payloads[path],
                "records": [r for r in payloads[path]["records"] if r["label"] != label],
            }
        payload = merge_runs(list(payloads.values()))
        print(f"merged {len(args.merge)} runs: {payload['records'][0]['cases']} cases per method x budget")
    else:
        payload = run_methods(parser, args)
    records, categories = payload["records"], payload["categories"]
    print_table([{"policy": f"{r['label']} @{r['target_B']}", "summary": _row_summary(r)} for r in records], categories)
    payload = write_json(args.out, payload, started=started)
    print(f"wrote {args.out}")
    if args.plot:
        plot(records, args.plot)
        print(f"wrote {args.plot}")
    return payload


def run_methods(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """Every method of ``args`` on the test cases: the result payload (settings and one record per method x B)."""
    if any(not 0 < b <= 1 for b in args.budgets):
        parser.error(f"--budgets must lie in (0, 1], got {args.budgets}")
    ablations = []
    for item in args.ablation_policy:
        name, sep, path = item.partition("=")
        if not sep or not name or not Path(path).is_dir():
            parser.error(f"--ablation-policy takes NAME=PATH with a policy folder, got {item!r}")
        ablations.append((name, path))
    if args.split == "development" and (any(m in BASELINES for m in args.methods) or args.pask_stage_split != "equal"):
        parser.error(
            "--split development answers full_kv and pask rows with --pask-stage-split equal only: the "
            "baselines' knobs and the other stage splits are fitted on the development cases"
        )
    if args.pask_prefill is not None and "pask" not in args.methods:
        parser.error("--pask-prefill serves the pask row: add pask to --methods")
    if args.pask_prefill is not None and not is_prefill_source(args.pask_prefill):
        shipped = [CALIBRATED, *SHIPPED_PAIRS]
        parser.error(f"--pask-prefill takes one of {shipped} or a folder with {PREFILL_POLICY_NAME}")
    categories = list(CATEGORIES) if args.full else args.categories
    limit = None if args.full else args.cases

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.tiny)
    costs = GroupCosts.from_config(model.config)
    run = dict(max_new_tokens=args.max_new_tokens, progress=not args.tiny, int4_keys=args.int4_keys)
    window = PolicyTable.all_high(model).window

    dev_entries, dev, lengths = (), None, []
    if any(m in BASELINES for m in args.methods) or args.pask_stage_split != "equal":  # a method uses the lengths
        dev_entries = bfcl_split(categories, "development", seed=args.seed, limit=args.dev_cases)
        dev = evaluate_bfcl(model, tokenizer, dev_entries, PolicyTable.all_high(model), **run)
        lengths = development_lengths(dev.records, costs)
    test_entries = bfcl_split(categories, args.split, seed=args.seed, limit=limit, start=args.first_case)

    def evaluate(method: str, label: str, target: float, policy, prefill=None, provenance=None) -> dict:
        start = time.perf_counter()
        evaluation = evaluate_bfcl(model, tokenizer, test_entries, policy, prefill_policy=prefill, **run)
        if isinstance(policy, PolicyTable):
            knobs = {"B_D": policy.budget, "B_P": None if prefill is None else prefill.budget}
        else:
            knobs = knobs_of(policy)
        if method in BASELINES:
            knobs["expected_B_on_development"] = policy.expected_budget(lengths)
        if method != "full_kv":
            knobs["int4_keys"] = args.int4_keys or policy.int4_keys
            label = label if knobs["int4_keys"] == "row" else f"{label} [{knobs['int4_keys']} keys]"
        row = {"method": method, "label": label, "target_B": target, "knobs": knobs, "provenance": provenance}
        record = method_record(row, evaluation.records, seconds=time.perf_counter() - start)
        print(
            f"{label} at B={target}: accuracy {record['accuracy']:.1%}, measured B {record['measured_B']:.3f} "
            f"(B_P {record['measured_B_P']:.3f}, B_D {record['measured_B_D']:.3f})"
        )
        return record

    records = []
    if "full_kv" in args.methods:
        records.append(evaluate("full_kv", "full_kv", 1.0, PolicyTable.all_high(model), provenance="reference"))
    pask_rows = [("pask", args.pask_policy)] if "pask" in args.methods else []
    pask_rows += [(f"pask:{name}", path) for name, path in ablations]
    for target in (b for b in args.budgets if b < 1):
        for method in (m for m in args.methods if m in BASELINES):
            policy = BASELINES[method].for_budget(model, target, lengths, window=window, **BASELINE_KNOBS[method])
            records.append(evaluate(method, method, target, policy))
        for name, path in pask_rows:
            table, prefill, provenance = load_pask(path, model, args.tiny)
            if name == "pask" and args.pask_prefill is not None:
                prefill = load_prefill(args.pask_prefill, model)
                provenance = pair_provenance(table, prefill)  # the swapped-out policy's provenance is not served
                name = f"pask +prefill {args.pask_prefill}"
            label = name if provenance == "calibrated" else f"{name} ({provenance})"
            if args.pask_stage_split != "equal":
                label = f"{label} [{args.pask_stage_split}]"
            served = pask_at(table, prefill, target, args.pask_stage_split, lengths)
            records.append(evaluate("pask", label, target, *served, provenance=provenance))

    print(
        f"BFCL v4 {args.split} split (seed {args.seed}), {len(test_entries)} cases, knobs from {len(dev_entries)} "
        f"development cases, {args.threads} thread(s)"
    )
    return {
        "model": type(model).__name__ + (" (tiny, random)" if args.tiny else f" {model.config.name_or_path}"),
        "categories": categories,
        "seed": args.seed,
        "split": args.split,
        "cases_per_category": limit,
        "first_case": args.first_case,
        "dev_cases_per_category": args.dev_cases if dev else 0,
        "dev_lengths": lengths,
        "dev_full_kv_accuracy": dev.summary["accuracy"] if dev else None,
        "window": window,
        "baseline_knobs": BASELINE_KNOBS,
        "max_new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "records": records,
    }


def find_row(path: str, payload: dict, spec: str) -> dict:
    """The record of ``payload`` (the result file ``path``) named by ``spec``: ``LABEL`` or ``LABEL@B``.

    Raises:
        ValueError: no such row, or a label at several targets without ``@B``.
    """
    label, _, target = spec.partition("@")
    rows = [r for r in payload["records"] if r["label"] == label and (not target or r["target_B"] == float(target))]
    if len(rows) != 1:
        have = sorted({f"{r['label']}@{r['target_B']}" for r in payload["records"]})
        problem = "no row" if not rows else "several rows (add @B)"
        raise ValueError(f"{path} has {problem} for {spec!r}; its rows: {have}")
    return rows[0]


def compare_rows(parser: argparse.ArgumentParser, specs: list[str], out: str | None, started: float) -> dict:
    """``--compare``: every row against the first, case for case (module docstring); printed, and written to ``out``
    when given (``started``: the run's ``time.perf_counter()`` start, for the file's provenance)."""
    rows = []
    for spec in specs:
        path, sep, name = spec.rpartition(":")
        if not sep or not Path(path).is_file():
            parser.error(f"--compare takes FILE:LABEL[@B] with an existing result file, got {spec!r}")
        try:
            rows.append((spec, find_row(path, json.loads(Path(path).read_text()), name)))
        except ValueError as error:
            parser.error(str(error))
    (reference_spec, reference), others = rows[0], rows[1:]
    cases = {case["id"]: case for case in reference["records"]}
    comparisons = []
    print(f"reference {reference_spec}: {sum(c['valid'] for c in cases.values())}/{len(cases)} cases")
    width = max(len(spec) for spec, _ in others)
    print(f"{'row':<{width}} {'correct':>8} {'B':>6} {'lost':>5} {'gained':>7} {'same text':>10} {'McNemar p':>10}")
    for spec, row in others:
        theirs = {case["id"]: case for case in row["records"]}
        try:
            paired = paired_comparison(
                {i: c["valid"] for i, c in cases.items()}, {i: c["valid"] for i, c in theirs.items()}
            )
        except ValueError as error:
            parser.error(f"{spec}: {error}")
        same = sum(theirs[i]["text"] == case["text"] for i, case in cases.items())
        comparisons.append(
            {
                "row": spec,
                "measured_B": row["measured_B"],
                "same_text": same,
                **dataclasses.asdict(paired),
                "lost": list(paired.lost),
                "gained": list(paired.gained),
            }
        )
        print(
            f"{spec:<{width}} {paired.other_correct:>4}/{paired.cases:<3} {row['measured_B']:>6.3f} "
            f"{len(paired.lost):>5} {len(paired.gained):>7} {same:>10} {paired.p_value:>10.3f}"
        )
    result = {"reference": reference_spec, "comparisons": comparisons}
    if out:
        result = write_json(out, result, started=started)
        print(f"wrote {out}")
    return result


def _row_summary(record: dict) -> dict:
    """A record in the shape `print_table` reads (its "mean B" column shows the measured total B)."""
    return {
        "cases": record["cases"],
        "accuracy": record["accuracy"],
        "per_category": record["per_category"],
        "mean_budget_ratio": record["measured_B"],
        "nbytes": record["nbytes"],
        "full_nbytes": record["full_nbytes"],
        "seconds": record["seconds"],
    }


if __name__ == "__main__":
    main()
