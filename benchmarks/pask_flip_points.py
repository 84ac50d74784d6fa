"""Where PASK's greedy replies leave the all-high reference, and which stage makes them (issue 32): first flips of
the teacher-forced replays on the development split.

Each development case's all-high reference trajectory (the calibration's cached references, `--cache-dir`; made
there when missing) is replayed under four schedules of one PASK pair served at ``--budget`` (``B_D = B_P``, as
``bfcl_budget.py --pask-stage-split equal``): ``all_high`` (the control: its flips are the replay's float noise),
``pair`` (the decode table and the prefill plan), ``decode_only`` (the table, the prompt all-high) and
``prefill_only`` (the prefill plan, decode all-high). ``--schedules`` picks others (``all_high`` is always replayed:
the losses are measured against it), among them two halves of the prefill plan that say whether its releases or its
INT4 tokens move a reply: ``prefill_releases_only`` (the plan's ``L`` tokens kept ``H``) and ``prefill_int4_only``
(its ``R`` tokens kept ``H``), decode all-high in both; ``prefill_releases_group_G`` keeps only the releases of layer
group ``G`` (every other token ``H``), which says in which layers, and so for which labels, the releases matter.
Per schedule and case: the first flip (`hf_structkv.calibration.greedy_flips.first_flip`: the first step whose
grammar-masked argmax is not the reference's token, where greedy constrained decoding under the schedule leaves the
reference), the tokens there and the reply text before it, and the likelihood loss (`likelihood_loss` from step 1,
the calibration's sensitivity).

``--int4-keys`` serves the pair with another INT4 key layout than the one it was calibrated with (e.g.
``centred-g128`` for a ``centred`` pair: what the layout alone changes).

``--generate-flipped`` answers the pair's development accuracy at the price of its flips: each case whose ``pair``
(or ``all_high``) replay flips is generated under the pair and scored by BFCL's AST checker (appended to
``<out>.flipped.jsonl``, resumable); every other case writes the reference's reply (the flip's prediction, exact up to
float ties) and keeps its verdict. The summary's ``pair_accuracy`` is reported once every flipped case is generated;
with ``--generated`` it is also compared, case by case, with that row's verdicts (``vs_generated``, exact McNemar),
e.g. the same pair generated under another key layout (whose ``pair_vs_generated`` then says nothing: it checks the
prediction against replies of the same cache).

``--stop-after SECONDS`` stops replaying after that long and reports the cases measured so far (``complete``: false;
the log resumes); ``--compare OUT`` counts, per schedule both runs replayed, the cases flipped in this run, in the
run written to ``OUT`` (its ``OUT.cases.jsonl``: another layout or pair on the same cases), and in both.

``--generated FILE:LABEL`` names the row of a ``bfcl_budget.py --split development`` result that served the same pair
at the same budget: its replies are then compared with the prediction (no flip under ``pair`` ⇔ the reply is the
reference's text), and its verdicts with the reference's where the reply flipped.

Resumable: each case's record is appended to ``<out>.cases.jsonl`` (settings on its first line) as soon as it is
measured; a rerun skips them. ``--out`` JSON and a printed table.

    OMP_NUM_THREADS=1 python benchmarks/pask_flip_points.py --pask-policy calibrated --budget 0.33 --threads 1 \\
        --generated benchmarks/results/bfcl_budget_dev/likelihood_int4_centred_128cases.json:"pask [centred keys]" \\
        --out benchmarks/results/pask_flip_points_dev.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import transformers

from hf_structkv.attention.registry import enable
from hf_structkv.calibration.bfcl_task import BfclTask
from hf_structkv.calibration.greedy_flips import first_flip, reference_masks
from hf_structkv.calibration.likelihood import CaseReplay, candidate_plan, likelihood_loss
from hf_structkv.calibration.references import reference_trajectories
from hf_structkv.eval.bfcl import bfcl_split, evaluate_bfcl
from hf_structkv.eval.paired import paired_comparison
from hf_structkv.models import load_default_model
from hf_structkv.policy.costs import Action
from hf_structkv.policy.shipped import pair_name
from hf_structkv.policy.table import PolicyTable
from hf_structkv.quant import INT4_KEY_LAYOUTS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bfcl_budget import find_row, load_pask, pask_at  # noqa: E402
from results_json import write_json  # noqa: E402

SCHEDULES = ("all_high", "pair", "decode_only", "prefill_only")
"""The schedules replayed by default."""
PLAN_HALVES = ("prefill_releases_only", "prefill_int4_only", *(f"prefill_releases_group_{g}" for g in range(3)))
"""The prefill plan's releases alone, its INT4 tokens alone, and the releases of one layer group alone (module
docstring)."""
CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple")


def schedules(
    table: PolicyTable, plan: torch.Tensor, all_high: PolicyTable, names: tuple[str, ...] = SCHEDULES
) -> dict[str, tuple]:
    """``{name: (decode policy, prefill plan or None)}`` of ``names`` (`SCHEDULES`, `PLAN_HALVES`), in that order;
    ``plan``: int ``[1, P, groups]`` prompt actions."""
    high = torch.full_like(plan, int(Action.H))
    every = {
        "all_high": (all_high, None),
        "pair": (table, plan),
        "decode_only": (table, None),
        "prefill_only": (all_high, plan),
        "prefill_releases_only": (all_high, torch.where(plan == int(Action.L), high, plan)),
        "prefill_int4_only": (all_high, torch.where(plan == int(Action.R), high, plan)),
    }
    for group in range(plan.shape[-1]):
        released = (plan == int(Action.R)) & (torch.arange(plan.shape[-1]) == group)
        every[f"prefill_releases_group_{group}"] = (all_high, torch.where(released, plan, high))
    return {name: every[name] for name in names}


def case_record(model, tokenizer, case, reference, table, prefill, all_high, names=SCHEDULES) -> dict:
    """One case's flips and likelihood losses under the schedules ``names`` (``all_high`` first)."""
    task = BfclTask()
    replay = CaseReplay(model, reference, all_high)
    plan = candidate_plan(reference, table, prefill)
    prompt = len(reference.prompt_ids)
    tokens, targets = replay.tokens[0, prompt:].tolist(), replay.tokens[0, prompt + 1 :, None]  # [T], [T - 1, 1]
    reference_log_probs = None
    record = {"id": reference.case_id, "category": reference.category, "reference_valid": reference.valid}
    record |= {"reference_text": reference.text, "reply_tokens": len(tokens)}
    allowed = reference_masks(replay, task.processor(tokenizer, case, all_high))  # [T, V]
    for name, (policy, prefill_plan) in schedules(table, plan, all_high, names).items():
        rows = replay.reply_logits(replay.prompt_cache.with_schedule(policy, prefill_plan))
        log_probs = torch.cat([replay.first_log_prob, torch.log_softmax(rows, -1).gather(-1, targets)[:, 0]])  # [T]
        reference_log_probs = log_probs if name == "all_high" else reference_log_probs
        flip = first_flip(replay, rows, allowed)
        entry = {"loss": likelihood_loss(reference_log_probs, log_probs, 1), "flip": None}
        if flip is not None:
            entry["flip"] = {
                **dataclasses.asdict(flip),
                "reference_piece": tokenizer.decode([flip.reference_token]),
                "chosen_piece": tokenizer.decode([flip.chosen_token]),
                "before": tokenizer.decode(tokens[: flip.index])[-48:],
            }
        record[name] = entry
    return record


def read_log(path: Path, settings: dict) -> dict[str, dict]:
    """The case records of an earlier run with the same ``settings`` (``{}`` when there is none)."""
    if not path.exists():
        return {}
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines or lines[0] != {"settings": settings}:
        raise SystemExit(f"{path} holds a run with other settings: move it away or rerun with them")
    return {record["id"]: record for record in lines[1:]}


def summarise(records: list[dict], generated: dict[str, dict] | None, names: tuple[str, ...] = SCHEDULES) -> dict:
    """Per schedule of ``names``: cases flipped, the mean likelihood loss, the commonest (reference -> chosen)
    pieces; with ``generated`` (case id -> reply record), the prediction against the replies and verdicts."""
    out = {}
    for name in names:
        flips = [r[name]["flip"] for r in records if r[name]["flip"] is not None]
        pieces = Counter(f"{f['reference_piece']!r} -> {f['chosen_piece']!r}" for f in flips)
        out[name] = {
            "cases": len(records),
            "flipped": len(flips),
            "mean_loss": sum(r[name]["loss"] for r in records) / max(1, len(records)),
            "flipped_valid_references": sum(r[name]["flip"] is not None and r["reference_valid"] for r in records),
            "commonest_flips": pieces.most_common(8),
        }
    if generated is not None:
        table = Counter()
        for record in records:
            reply = generated.get(record["id"])
            if reply is None:
                continue
            same = reply["text"].strip() == record["reference_text"].strip()
            flipped = record["pair"]["flip"] is not None
            table[f"{'flip' if flipped else 'no flip'}, {'same' if same else 'other'} reply"] += 1
            if flipped:
                verdict = (
                    "kept"
                    if reply["valid"] == record["reference_valid"]
                    else "lost"
                    if record["reference_valid"]
                    else "gained"
                )
                table[f"flip, verdict {verdict}"] += 1
        out["pair_vs_generated"] = dict(sorted(table.items()))
    return out


def compare_runs(records: list[dict], others: dict[str, dict], names: tuple[str, ...]) -> dict:
    """Per schedule replayed by both runs, on the cases both measured: flips in this run, in the other, in both, and
    the same three counts among cases whose reference was valid."""
    common = [r for r in records if r["id"] in others]
    out = {}
    for name in names:
        if not common or name not in others[common[0]["id"]]:
            continue
        here = {r["id"] for r in common if r[name]["flip"] is not None}
        there = {r["id"] for r in common if others[r["id"]][name]["flip"] is not None}
        valid = {r["id"] for r in common if r["reference_valid"]}
        out[name] = {
            "cases": len(common),
            "flipped_here": len(here),
            "flipped_there": len(there),
            "flipped_both": len(here & there),
            "valid_flipped_here": len(here & valid),
            "valid_flipped_there": len(there & valid),
            "valid_flipped_both": len(here & there & valid),
        }
    return out


def must_generate(record: dict) -> bool:
    """Whether a case's pair reply may differ from its reference: its ``pair`` or its ``all_high`` replay flips."""
    return record["pair"]["flip"] is not None or record["all_high"]["flip"] is not None


def pair_accuracy(records: list[dict], flipped: dict[str, dict]) -> dict | None:
    """The pair's development verdicts: the generated verdict (``flipped``: case id -> ``{"valid", ...}``) where
    `must_generate`, else the reference's; ``None`` while a flipped case is not generated."""
    generate = [r for r in records if must_generate(r)]
    if any(r["id"] not in flipped for r in generate):
        return None

    def verdict(record: dict) -> bool:
        return flipped[record["id"]]["valid"] if must_generate(record) else record["reference_valid"]

    per_category: dict[str, list[int]] = {}
    for r in records:
        counts = per_category.setdefault(r["category"], [0, 0])
        counts[0] += verdict(r)
        counts[1] += 1
    return {
        "cases": len(records),
        "correct": sum(verdict(r) for r in records),
        "generated": len(generate),
        "replayed": len(records) - len(generate),
        "reference_correct": sum(r["reference_valid"] for r in records),
        "per_category": {c: {"correct": n, "cases": m} for c, (n, m) in sorted(per_category.items())},
        "verdicts": {r["id"]: bool(verdict(r)) for r in records},
    }


def against_generated(accuracy: dict, generated: dict[str, dict]) -> dict:
    """`pair_accuracy`'s verdicts against the replies of a generated row (``--generated``: e.g. the same pair in
    another key layout) on the cases both have, paired: ``other`` is this run."""
    verdicts = {case: valid for case, valid in accuracy["verdicts"].items() if case in generated}
    compared = paired_comparison({case: bool(generated[case]["valid"]) for case in verdicts}, verdicts)
    return {
        "cases": compared.cases,
        "generated_correct": compared.reference_correct,
        "this_correct": compared.other_correct,
        "lost": list(compared.lost),
        "gained": list(compared.gained),
        "p_value": compared.p_value,
    }


def generate_flipped(model, tokenizer, cases, done: dict, table, prefill, max_new_tokens: int, path: Path) -> dict:
    """Generate (`evaluate_bfcl` under the pair) every measured case that `must_generate` and is not in ``path`` yet;
    each reply appended as ``{"id", "valid", "text", "budget_ratio", "seconds"}``. Returns case id -> line."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    flipped = {line["id"]: line for line in lines}
    for case in cases:
        record = done.get(case.id)
        if record is None or not must_generate(record) or case.id in flipped:
            continue
        reply = evaluate_bfcl(model, tokenizer, [case], table, max_new_tokens, prefill_policy=prefill).records[0]
        flipped[case.id] = {key: reply[key] for key in ("id", "valid", "text", "budget_ratio", "seconds")}
        with path.open("a") as handle:
            handle.write(json.dumps(flipped[case.id]) + "\n")
        print(f"{case.id}: generated, valid {reply['valid']}")
    return flipped


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pask-policy", default="calibrated", help="a shipped pair by name, or a policy folder")
    parser.add_argument("--budget", type=float, default=0.33, help="B_D = B_P served")
    parser.add_argument(
        "--int4-keys", choices=INT4_KEY_LAYOUTS, help="serve the pair with this INT4 key layout (default: its own)"
    )
    parser.add_argument("--categories", nargs="+", default=list(CATEGORIES), choices=CATEGORIES)
    parser.add_argument("--dev-cases", type=int, default=32, help="development cases per category")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--cache-dir", default="benchmarks/results/calibration_cache", help="the references' cache")
    parser.add_argument("--generated", metavar="FILE:LABEL", help="a bfcl_budget.py --split development row")
    parser.add_argument(
        "--schedules",
        nargs="+",
        default=list(SCHEDULES),
        choices=SCHEDULES + PLAN_HALVES,
        help="the schedules replayed (all_high always)",
    )
    parser.add_argument("--stop-after", type=float, help="stop replaying after this many seconds and report")
    parser.add_argument("--compare", metavar="OUT", help="another run's --out: paired flips on the common cases")
    parser.add_argument(
        "--generate-flipped", action="store_true", help="generate the flipped cases: the pair's development accuracy"
    )
    parser.add_argument("--seed", type=int, default=0, help="split seed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/pask_flip_points_dev.json")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 < args.budget <= 1:
        parser.error(f"--budget must lie in (0, 1], got {args.budget}")
    names = ("all_high", *(n for n in dict.fromkeys(args.schedules) if n != "all_high"))
    if (args.generate_flipped or args.generated) and "pair" not in names:
        parser.error("--generate-flipped and --generated check the pair's flips: add pair to --schedules")
    if args.compare and not Path(f"{args.compare}.cases.jsonl").is_file():
        parser.error(f"--compare {args.compare}: no log {args.compare}.cases.jsonl")
    generated = None
    if args.generated:
        path, sep, label = args.generated.partition(":")
        if not sep or not Path(path).is_file():
            parser.error(f"--generated takes FILE:LABEL with a result file, got {args.generated!r}")
        generated = {r["id"]: r for r in find_row(path, json.loads(Path(path).read_text()), label)["records"]}
    torch.set_num_threads(args.threads)
    model, tokenizer = load_default_model()
    enable(model)
    table, prefill, provenance = load_pask(args.pask_policy, model)
    table, prefill = pask_at(table, prefill, args.budget)
    if args.int4_keys:
        table = dataclasses.replace(table, int4_keys=args.int4_keys)
        prefill = prefill if prefill is None else dataclasses.replace(prefill, int4_keys=args.int4_keys)
    all_high = PolicyTable.all_high(
        model, window=table.window, sink_tokens=table.sink_tokens, int4_keys=table.int4_keys
    )
    cases = bfcl_split(args.categories, "development", seed=args.seed, limit=args.dev_cases)
    references = reference_trajectories(
        model,
        tokenizer,
        BfclTask(),
        cases,
        args.max_new_tokens,
        table.window,
        table.sink_tokens,
        cache_dir=args.cache_dir,
        progress=True,
    )
    policy_name = args.pask_policy if Path(args.pask_policy).is_dir() else pair_name(args.pask_policy)
    settings = {
        "pask_policy": policy_name,
        "budget": args.budget,
        "categories": args.categories,
        "dev_cases": args.dev_cases,
        "max_new_tokens": args.max_new_tokens,
        "seed": args.seed,
        **({} if names == SCHEDULES else {"schedules": list(names)}),  # the default four: recorded as before
        **({"int4_keys": args.int4_keys} if args.int4_keys else {}),  # a run in the pair's own layout records none
    }
    log = Path(f"{args.out}.cases.jsonl")
    done = read_log(log, settings)
    if not log.exists():
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(json.dumps({"settings": settings}) + "\n")
    start = time.perf_counter()
    for case, reference in zip(cases, references, strict=True):
        if reference.case_id in done or not reference.tokens:
            continue
        if args.stop_after is not None and time.perf_counter() - start > args.stop_after:
            break
        done[reference.case_id] = case_record(model, tokenizer, case, reference, table, prefill, all_high, names)
        with log.open("a") as handle:
            handle.write(json.dumps(done[reference.case_id]) + "\n")
        flips = {name: done[reference.case_id][name]["flip"] for name in names}
        print(f"{reference.case_id}: " + ", ".join(f"{n} {'-' if f is None else f['index']}" for n, f in flips.items()))
    records = [done[r.case_id] for r in references if r.case_id in done]
    summary = summarise(records, generated, names)
    if args.compare:
        other = Path(f"{args.compare}.cases.jsonl")
        others = [json.loads(line) for line in other.read_text().splitlines()[1:] if line.strip()]
        summary["compared"] = {"run": args.compare, **compare_runs(records, {r["id"]: r for r in others}, names)}
        print("paired flips against", args.compare, json.dumps(summary["compared"]))
    if args.generate_flipped:
        path = Path(f"{args.out}.flipped.jsonl")
        flipped = generate_flipped(model, tokenizer, cases, done, table, prefill, args.max_new_tokens, path)
        summary["pair_accuracy"] = pair_accuracy(records, flipped)
        if generated is not None and summary["pair_accuracy"] is not None:
            summary["pair_accuracy"]["vs_generated"] = against_generated(summary["pair_accuracy"], generated)
        print("pair's development accuracy (generated where a replay flips):", summary["pair_accuracy"])
    print(f"{policy_name} ({provenance}) at B_D = B_P = {args.budget}, {len(records)} development cases")
    print(f"{'schedule':<14} {'flipped':>8} {'of valid refs':>14} {'mean loss':>10}  commonest flips")
    for name in names:
        row = summary[name]
        flips = "; ".join(f"{p} x{n}" for p, n in row["commonest_flips"][:4])
        print(
            f"{name:<14} {row['flipped']:>8} {row['flipped_valid_references']:>14} {row['mean_loss']:>10.4f}  {flips}"
        )
    if generated is not None:
        print("pair against its generated replies:", summary["pair_vs_generated"])
    payload = {
        **settings,
        "policy_provenance": provenance,
        "generated": args.generated,
        "generate_flipped": args.generate_flipped,
        "complete": len(records) == sum(bool(r.tokens) for r in references),
        "seconds_this_run": time.perf_counter() - start,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "summary": summary,
        "records": records,
    }
    payload = write_json(args.out, payload, started=start)
    return payload


if __name__ == "__main__":
    main()
