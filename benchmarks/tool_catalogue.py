"""BFCL function calls after a compacted tool catalogue (issue 33, part 1): one catalogue of BFCL's own function
docs is the system prompt of every case; Full KV against the catalogue compacted 2x / 4x / 10x in bytes (KV-Surgeon
in the model's dtype, KV-Surgeon with INT4 heads, query-free baselines) and against a compacted catalogue with PASK
managing the rest at B = 0.33, scored by BFCL's AST checker.

- Cases: the BFCL test split (seed ``--seed``) of ``simple_python`` / ``multiple`` / ``live_multiple``, taken in turn
  from each category (a seeded sample), ``--cases`` in all. A case whose chat opens with its own system message is
  skipped (the catalogue is the system turn), as is one whose functions share a name with a different definition
  already in the catalogue (one name must mean one function).
- Catalogues: the cases are cut in order into groups whose own functions take at most ``--own-share`` of
  ``--catalogue-tokens`` (`group_cases`; 64 cases' functions take about 13.7K tokens, so a 4K catalogue serves a
  group of a few cases and a 16K one all 64). Each group's catalogue (`build_catalogue`) holds every function of its
  cases, then functions of the other cases of the same categories (all splits, one definition per name, seeded
  order) while `catalogue_text` of the whole stays within ``--catalogue-tokens`` tokens; the whole list in a seeded
  order. Every row compacts every group's catalogue. Each case is answered with `generate_calls(...,
  context=)`: the grammar and the chat template see the whole catalogue, the checker scores the calls against the
  case's own functions (a call to another catalogue function is wrong).
- Rows: ``full_kv`` (the catalogue kept whole: every entry, bias 0, which answers token for token what the full
  prompt answers, tests/test_tool_catalogue.py); ``full_kv_int4`` (every entry kept, bias 0, stored in INT4 with no
  fit: `WHOLE_INT4_COMPACTION`; its byte ratio is INT4's against the model's dtype, about 7x for FP32 and half that
  for BF16) and ``full_kv_int4+pask@0.33`` (that catalogue with PASK as below); per ``--ratios`` r,
  ``kv_surgeon@rx`` (`compact_catalogue`, ``storage="bf16"``: kept entries in the model's dtype, calibrated by the
  repeat pass), ``kv_surgeon_int4@rx``
  (``storage="int4"``: the ratio is a byte ratio), with ``--task-questions N`` also ``kv_surgeon_tasks@rx`` and
  ``kv_surgeon_int4_tasks@rx`` (the same two calibrated by the self-study tier with up to N task questions per
  catalogue, ``compact_catalogue(..., questions=)``: see below), each ``--baselines`` method ``@rx`` (query-free,
  model dtype) and ``kv_surgeon_int4@rx+pask@0.33`` (that catalogue, the shipped calibrated PASK decode table and
  prefill policy served at B_D = B_P = 0.33 on the conversation and the reply). Decode is all-high on the other rows.
- Task questions (``--task-questions N``), chosen per catalogue (`catalogue_questions`): the first N cases of BFCL's
  **calibration** partition (the same seed, the categories in turn, each in its seeded order) that open without a
  system message and whose functions all lie in that catalogue (same name, same definition), so that they use the
  catalogue as the evaluated cases do; fewer when fewer exist (none: the self-study conversations alone). Never an
  evaluated case: those come from the test partition, which is disjoint. Each ``*_tasks`` catalogue is calibrated
  with the repetition, the four self-study conversations (each a user turn of the chat template after the catalogue,
  `catalogue_self_study`) and one conversation per question: the question's turn as ``generate_calls`` feeds it after
  that catalogue, then the model's sampled reply. The question ids of each catalogue are in its saved metadata
  (``task_questions``), its line of the case log and the JSON (``task_questions``, per group).
- Reported per row: accuracy (overall, per category), the paired exact McNemar p-value against ``full_kv``
  (`paired_comparison`, as ``bfcl_budget.py --compare``), the catalogue's stored bytes and their ratio to the whole
  catalogue's, the mean bytes of the cache after each case (catalogue + conversation + reply) and wall time per case,
  the compaction's wall time; the best query-free baseline per ratio is marked. ``--out`` JSON, a printed table,
  ``--plot`` (accuracy against mean cache bytes per case).
- Resumable: every answered case is appended to ``<out>.cases.jsonl`` (the run's settings on its first line; a rerun
  with other settings is refused, except that a key of `ADDED_SETTINGS` missing from the log or from the rerun is not
  compared, so a log written without ``--task-questions`` resumes with it; the settings record N and the rule
  `TASK_QUESTION_RULE`, which with the seed and the catalogues fix each catalogue's questions) and compacted catalogues
  are saved under ``<out>.catalogues/`` (not results: do not commit them); a rerun skips what is done and reloads the
  catalogues (a ``*_tasks`` catalogue only when its saved question ids are this run's).
  Rows, ratios and baselines are not settings: a rerun may add some.

The runs of issue 33 (embedded model, float32 on CPU, 1 thread; hours). The 4K run resumes the committed partial
``tool_catalogue_4k.cases.jsonl``, started without ``--task-questions`` (tests/test_agent_benchmarks.py checks it):

    python benchmarks/tool_catalogue.py --cases 64 --catalogue-tokens 4096 --threads 1 --ratios 4 --baselines \\
        --task-questions 8 --out benchmarks/results/tool_catalogue_4k.json --plot docs/img/tool_catalogue_4k.png
    python benchmarks/tool_catalogue.py --cases 64 --catalogue-tokens 16384 --threads 1 --task-questions 8 \\
        --out benchmarks/results/tool_catalogue_16k.json --plot docs/img/tool_catalogue_16k.png

``--rows`` runs and reports some rows only (``full_kv`` always), from the same log: a table of the rows done so far
(``... --rows kv_surgeon@4x``), or two processes on different rows of one run.

Smoke run (minutes; numbers meaningless): ``--cases 2 --ratios 4 --catalogue-tokens 1024 --baselines streaming_llm
--task-questions 2 --max-new-tokens 48 --out /tmp/tool_catalogue_smoke.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from itertools import islice
from pathlib import Path

import torch
import transformers

from hf_structkv import CompactedCache
from hf_structkv.compaction import prefill_context
from hf_structkv.compaction.catalogue import compact_catalogue
from hf_structkv.eval.bfcl import BfclEntry, bfcl_split, load_bfcl, summarise
from hf_structkv.eval.bfcl_checker import check_calls
from hf_structkv.eval.paired import paired_comparison
from hf_structkv.models import load_default_model
from hf_structkv.persistence import model_fingerprint
from hf_structkv.policy import PolicyTable
from hf_structkv.structured_generation import catalogue_metadata, catalogue_text, generate_calls

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bfcl_budget import load_pask, pask_at  # noqa: E402
from results_json import write_json  # noqa: E402

CATEGORIES = ("simple_python", "multiple", "live_multiple")
RATIOS = (2.0, 4.0, 10.0)
QUERY_FREE = ("streaming_llm", "key_norm", "q_filters", "random")
PASK_BUDGET = 0.33
FULL = "full_kv"
WHOLE_INT4 = "full_kv_int4"
WHOLE_INT4_COMPACTION = {"ratio": 1.0, "method": "streaming_llm", "budgets": "uniform"}
"""How `WHOLE_INT4`'s catalogue is made: ratio 1 owes every KV head the bytes of all its entries in the model's dtype,
more than its whole head costs in INT4, so the query-free method keeps every entry (bias 0, no fit) and
``storage="int4"`` rounds them (keys per channel, values per row, FP16 scales)."""
ADDED_SETTINGS = ("task_questions",)
"""Settings keys added after logs were written (`same_settings`): ``task_questions`` (``{"per_catalogue": N, "rule":
TASK_QUESTION_RULE}``, present only with ``--task-questions``)."""
TASK_QUESTION_RULE = (
    "per catalogue, the first N calibration-partition cases of the categories in turn (seeded order) that open "
    "without a system message and whose functions all lie in the catalogue (same name, same definition)"
)


@dataclass(frozen=True)
class Row:
    """One method: ``method`` None = the catalogue kept whole (in INT4 with ``storage="int4"``:
    `WHOLE_INT4_COMPACTION`); ``storage`` of `compact`; ``pask`` = served with the
    calibrated PASK pair at `PASK_BUDGET` (else all-high); ``tasks`` = calibrated with the task questions."""

    label: str
    method: str | None = None
    ratio: float | None = None
    storage: str = "bf16"
    pask: bool = False
    tasks: bool = False

    @property
    def catalogue_label(self) -> str:
        """The catalogue this row serves (rows with and without PASK share it)."""
        return self.label.split("+")[0]


def method_rows(ratios: Sequence[float], baselines: Sequence[str], tasks: bool = False) -> list[Row]:
    """Full KV, the catalogue whole in INT4 (without and with PASK), then per ratio KV-Surgeon (model dtype, INT4),
    with ``tasks`` the same two calibrated with the task questions, the baselines and KV-Surgeon INT4 + PASK."""
    rows = [
        Row(FULL),
        Row(WHOLE_INT4, storage="int4"),
        Row(f"{WHOLE_INT4}+pask@{PASK_BUDGET:g}", storage="int4", pask=True),
    ]
    for r in ratios:
        name = f"{r:g}x"
        rows += [Row(f"kv_surgeon@{name}", "kv_surgeon", r), Row(f"kv_surgeon_int4@{name}", "kv_surgeon", r, "int4")]
        if tasks:
            rows += [
                Row(f"kv_surgeon_tasks@{name}", "kv_surgeon", r, tasks=True),
                Row(f"kv_surgeon_int4_tasks@{name}", "kv_surgeon", r, "int4", tasks=True),
            ]
        rows += [Row(f"{method}@{name}", method, r) for method in baselines]
        rows.append(Row(f"kv_surgeon_int4@{name}+pask@{PASK_BUDGET:g}", "kv_surgeon", r, "int4", pask=True))
    return rows


def run_rows(args: argparse.Namespace) -> list[Row]:
    """`method_rows` of a run's ratios, baselines and task questions."""
    return method_rows(args.ratios, args.baselines, tasks=args.task_questions > 0)


def selected_rows(args: argparse.Namespace) -> list[Row]:
    """The rows a run answers: `run_rows`, only ``full_kv`` and ``--rows`` when given."""
    return [row for row in run_rows(args) if not args.rows or row.label == FULL or row.label in args.rows]


def cases_in_turn(
    categories: Sequence[str], split: str, seed: int, accept: Callable[[BfclEntry], bool]
) -> Iterator[BfclEntry]:
    """The cases of the ``split`` partition (`bfcl_split`) that ``accept`` takes, one category after the other in
    turn: each turn takes the next accepted case of each category (in its seeded order) until none is left."""
    queues = {c: list(bfcl_split([c], split, seed=seed)) for c in categories}
    while any(queues.values()):
        for category in categories:
            while queues[category]:
                entry = queues[category].pop(0)
                if accept(entry):
                    yield entry
                    break


def pick_cases(categories: Sequence[str], count: int, seed: int) -> list[BfclEntry]:
    """The evaluated cases: ``count`` cases of the test partition, the categories in turn (`cases_in_turn`), leaving
    out cases that open with a system message or whose functions contradict an earlier case's (same name, other
    definition)."""
    known: dict[str, dict] = {}

    def usable(entry: BfclEntry) -> bool:
        if entry.messages[0]["role"] == "system" or any(known.get(t["name"], t) != t for t in entry.tools):
            return False
        known.update({tool["name"]: tool for tool in entry.tools})
        return True

    chosen = list(islice(cases_in_turn(categories, "test", seed, usable), count))
    if len(chosen) < count:
        raise ValueError(f"only {len(chosen)} usable test cases in {list(categories)}, asked for {count}")
    return chosen


def catalogue_questions(tools: Sequence[dict], categories: Sequence[str], count: int, seed: int) -> list[BfclEntry]:
    """A catalogue's task questions (`TASK_QUESTION_RULE`): the first ``count`` cases of the calibration partition,
    the categories in turn (`cases_in_turn`), that open without a system message and whose functions all lie in
    ``tools`` (same name, same definition); fewer when fewer exist. The calibration partition shares no case with the
    test partition the evaluated cases come from."""
    held = {tool["name"]: tool for tool in tools}

    def fits(entry: BfclEntry) -> bool:
        return entry.messages[0]["role"] != "system" and all(held.get(t["name"]) == t for t in entry.tools)

    return list(islice(cases_in_turn(categories, "calibration", seed, fits), count))


def other_tools(cases: Sequence[BfclEntry], categories: Sequence[str], rng: random.Random) -> list[dict]:
    """The functions of ``categories`` (every case of every split, the first definition of each name) not named by
    ``cases``, in ``rng``'s order: the pool a catalogue is filled from."""
    names = {tool["name"] for case in cases for tool in case.tools}
    others: dict[str, dict] = {}
    for category in categories:
        for entry in load_bfcl(category):
            for tool in entry.tools:
                if tool["name"] not in names:
                    others.setdefault(tool["name"], tool)
    pool = [others[name] for name in sorted(others)]
    rng.shuffle(pool)
    return pool


def catalogue_rng(seed: int) -> random.Random:
    return random.Random(f"tool-catalogue/{seed}")


def build_catalogue(
    tokenizer, cases: Sequence[BfclEntry], categories: Sequence[str], max_tokens: int, seed: int
) -> list[dict]:
    """The catalogue's tools (module docstring): every function of ``cases``, then the longest run of `other_tools`
    (in the order of `catalogue_rng`) that keeps ``catalogue_text`` within ``max_tokens`` tokens (found by bisection:
    the token count grows with each tool), the whole list then shuffled by the same generator.

    Raises:
        ValueError: the cases' own functions alone exceed ``max_tokens``.
    """
    rng = catalogue_rng(seed)
    own = list({tool["name"]: tool for case in cases for tool in case.tools}.values())
    pool = other_tools(cases, categories, rng)

    def tokens(tools: list[dict]) -> int:
        return len(tokenizer(catalogue_text(tokenizer, tools), add_special_tokens=False)["input_ids"])

    if tokens(own) > max_tokens:
        raise ValueError(
            f"the {len(cases)} cases' own {len(own)} functions take {tokens(own)} catalogue tokens, more than "
            f"--catalogue-tokens {max_tokens}: raise it or lower --cases"
        )
    low, high = 0, len(pool)
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if tokens(own + pool[:middle]) <= max_tokens else (low, middle - 1)
    catalogue = own + pool[:low]
    rng.shuffle(catalogue)
    return catalogue


def group_cases(tokenizer, cases: Sequence[BfclEntry], max_own_tokens: int) -> list[list[BfclEntry]]:
    """``cases`` in order, cut into consecutive groups whose own functions' `catalogue_text` stays within
    ``max_own_tokens`` tokens (a case whose functions alone exceed it is a group of its own): each group gets its own
    catalogue, so a catalogue of ``--catalogue-tokens`` holds its cases' functions and others."""
    groups: list[list[BfclEntry]] = []
    for case in cases:
        if groups:
            tools = list({t["name"]: t for c in [*groups[-1], case] for t in c.tools}.values())
            if (
                len(tokenizer(catalogue_text(tokenizer, tools), add_special_tokens=False)["input_ids"])
                <= max_own_tokens
            ):
                groups[-1].append(case)
                continue
        groups.append([case])
    return groups


def keep_all_catalogue(model, tokenizer, tools: list[dict]) -> CompactedCache:
    """The catalogue prefilled and kept whole (every entry of every global layer, bias 0), recorded as a catalogue."""
    ids = tokenizer(catalogue_text(tokenizer, tools), return_tensors="pt", add_special_tokens=False).input_ids
    full = prefill_context(model, ids, prefill_chunk_tokens=1024)
    indices = [
        None if layer.is_sliding else [torch.arange(layer.keys.shape[-2])] * layer.keys.shape[1]
        for layer in full.layers
    ]
    metadata = {"fingerprint": model_fingerprint(model, tokenizer), "catalogue": catalogue_metadata(tokenizer, tools)}
    return CompactedCache.from_selection(full, indices, metadata=metadata)


def same_settings(logged: dict, settings: dict) -> bool:
    """Whether a log's ``logged`` settings fit a run's ``settings``: equal on every key, except a key of
    `ADDED_SETTINGS` that one of them lacks (a log written before the key existed, or a run that does not use it)."""
    skipped = {key for key in ADDED_SETTINGS if key not in logged or key not in settings}
    return all(logged.get(key) == settings.get(key) for key in (set(logged) | set(settings)) - skipped)


class CaseLog:
    """The run's JSONL (``<out>.cases.jsonl``): the settings on the first line, then one line per answered case
    (``row``, ``id``, its record), per made catalogue (``catalogue``, its compaction seconds) or per run that
    brought keys of `ADDED_SETTINGS` the log lacked (``added_settings``: those keys, compared from then on)."""

    def __init__(self, path: Path, settings: dict):
        self.path, self.cases, self.catalogues = path, {}, {}
        if path.is_file():
            lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            logged = lines[0].get("settings") if lines else None
            for line in lines[1:]:
                if "added_settings" in line:
                    logged = {**(logged or {}), **line["added_settings"]}
                elif "catalogue" in line:
                    self.catalogues[line["catalogue"]] = line
                else:
                    self.cases[(line["row"], line["id"])] = line
            if not isinstance(logged, dict) or not same_settings(logged, settings):
                raise ValueError(
                    f"{path} holds a run with other settings ({logged or 'none'}): choose another --out, or delete "
                    "it to start over"
                )
            added = {key: settings[key] for key in ADDED_SETTINGS if key in settings and key not in logged}
            if added:
                self._append({"added_settings": added})
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._append({"settings": settings})

    def _append(self, line: dict) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(line) + "\n")

    def add_case(self, row: str, record: dict) -> None:
        self.cases[(row, record["id"])] = line = {"row": row, **record}
        self._append(line)

    def add_catalogue(self, label: str, seconds: float, questions: list[str] | None = None) -> None:
        """Log a made catalogue: its compaction ``seconds`` and, for a ``*_tasks`` row, its task ``questions``' ids."""
        line = {"catalogue": label, "seconds": seconds}
        if questions is not None:
            line["task_questions"] = questions
        self.catalogues[label] = line
        self._append(line)


def catalogue_for(
    model, tokenizer, tools, row: Row, group: int, folder: Path, log: CaseLog, args, questions: list[BfclEntry]
) -> CompactedCache:
    """The row's catalogue of case group ``group``: kept whole (Full KV; prefilled again on each run), else loaded from
    ``folder`` or compacted (and saved there, its seconds logged under ``<catalogue label>/g<group>``); a ``tasks``
    row's calibrated by the self-study tier with the group's task ``questions`` (their chat messages; none: the
    self-study conversations alone), whose ids go to the catalogue's metadata and log line (``task_questions``).

    Raises:
        ValueError: a saved ``tasks`` catalogue was calibrated with other questions than ``questions``.
    """
    if row.method is None and row.storage == "bf16":
        return keep_all_catalogue(model, tokenizer, tools)
    label = f"{row.catalogue_label}/g{group}"
    saved = folder / re.sub(r"[^\w.@-]", "_", label)
    ids = [question.id for question in questions] if row.tasks else None
    if saved.is_dir() and label in log.catalogues:
        cache = CompactedCache.from_pretrained(saved, model=model)
        if cache.metadata.get("task_questions") != ids:
            raise ValueError(
                f"{saved} was calibrated with task questions {cache.metadata.get('task_questions')}, this run's are "
                f"{ids}: delete it to compact it again"
            )
        return cache
    tasks = {}
    if row.tasks:
        tasks = {"queries": "self_study", "questions": [list(question.messages) for question in questions] or None}
    start = time.perf_counter()
    cache = compact_catalogue(
        model,
        tokenizer,
        tools,
        **({"ratio": row.ratio, "method": row.method} if row.method else WHOLE_INT4_COMPACTION),
        storage=row.storage,
        seed=args.seed,
        on_policy=args.on_policy,
        query_cap=args.query_cap,
        progress=False,
        **tasks,
    )
    seconds = time.perf_counter() - start
    if row.tasks:
        cache.metadata["task_questions"] = ids
    cache.save_pretrained(saved)
    log.add_catalogue(label, seconds, ids)
    return cache


def answer(model, tokenizer, entry: BfclEntry, tools, context, policy, prefill, max_new_tokens: int) -> dict:
    """One case answered after the catalogue and scored against the case's own functions."""
    start = time.perf_counter()
    result = generate_calls(
        model,
        tokenizer,
        list(entry.messages),
        tools,
        policy,
        max_new_tokens=max_new_tokens,
        prefill_policy=prefill,
        context=context,
    )
    seconds = time.perf_counter() - start
    calls = result.calls[0]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    verdict = check_calls(entry.category, entry.tools, entry.ground_truth, calls)
    report = result.bytes_report()
    return {
        "id": entry.id,
        "category": entry.category,
        "valid": verdict["valid"],
        "error_type": None if verdict["valid"] else verdict["error_type"],
        "text": result.texts[0],
        "calls": calls,
        "conversation_tokens": result.prompt_length - context.original_length,
        "generated_tokens": int((result.sequences[0, result.prompt_length :] != pad).sum()),
        "nbytes": report["nbytes"],
        "full_nbytes": report["full_nbytes"],
        "catalogue_nbytes": context.nbytes(),
        "budget_ratio": report["budget_ratio"],
        "seconds": seconds,
    }


def row_summary(row: Row, records: list[dict], full: list[dict] | None, log: CaseLog) -> dict:
    """A row's numbers (module docstring) over its ``records``; ``full``: Full KV's records of the same cases (their
    catalogues' bytes are the byte ratio's numerator; catalogue bytes are means over the cases)."""
    summary = summarise(records)
    catalogue = sum(r["catalogue_nbytes"] for r in records) / len(records)
    whole = catalogue if full is None else sum(r["catalogue_nbytes"] for r in full) / len(full)
    seconds = [line["seconds"] for label, line in log.catalogues.items() if label.split("/")[0] == row.catalogue_label]
    out = {
        **asdict(row),
        "cases": summary["cases"],
        "accuracy": summary["accuracy"],
        "per_category": summary["per_category"],
        "catalogue_nbytes": catalogue,
        "catalogue_byte_ratio": whole / catalogue,
        "mean_case_nbytes": summary["nbytes"] / len(records),
        "mean_case_seconds": summary["seconds"] / len(records),
        "mean_budget_ratio": summary["mean_budget_ratio"],
        "compaction_seconds": sum(seconds) if seconds else None,
    }
    if full is not None and row.label != FULL:
        paired = paired_comparison({r["id"]: r["valid"] for r in full}, {r["id"]: r["valid"] for r in records})
        out["vs_full_kv"] = {"lost": list(paired.lost), "gained": list(paired.gained), "p_value": paired.p_value}
    return out


def mark_best_baselines(summaries: list[dict], baselines: Sequence[str]) -> None:
    """Per ratio, ``best_query_free`` = True on the most accurate baseline row (ties: the first in ``baselines``)."""
    for ratio in {s["ratio"] for s in summaries if s["method"] in baselines}:
        rows = [s for s in summaries if s["method"] in baselines and s["ratio"] == ratio]
        best = max(rows, key=lambda s: (s["accuracy"], -baselines.index(s["method"])))
        for s in rows:
            s["best_query_free"] = s is best


def print_table(summaries: list[dict]) -> None:
    print(
        f"{'row':<32} {'accuracy':>9} {'McNemar p':>9} {'catalogue MB':>12} {'bytes ratio':>11} {'cache MB/case':>13} "
        f"{'s/case':>7} {'compact s':>9}"
    )
    for s in summaries:
        p = s.get("vs_full_kv", {}).get("p_value")
        compaction = s["compaction_seconds"]
        label = s["label"] + (" *" if s.get("best_query_free") else "")
        print(
            f"{label:<32} {s['accuracy']:>9.1%} {'' if p is None else f'{p:.3f}':>9} "
            f"{s['catalogue_nbytes'] / 2**20:>12.2f} {s['catalogue_byte_ratio']:>10.2f}x "
            f"{s['mean_case_nbytes'] / 2**20:>13.2f} {s['mean_case_seconds']:>7.1f} "
            f"{'' if compaction is None else f'{compaction:.0f}':>9}"
        )
    print("* the best query-free baseline at that ratio")


def plot(summaries: list[dict], title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.8, 4.6))
    families = dict.fromkeys(re.sub(r"@[\d.]+x", "", s["label"]) for s in summaries)
    for family in families:
        rows = sorted(
            (s for s in summaries if re.sub(r"@[\d.]+x", "", s["label"]) == family), key=lambda s: s["mean_case_nbytes"]
        )
        ax.plot(
            [s["mean_case_nbytes"] / 2**20 for s in rows],
            [100 * s["accuracy"] for s in rows],
            "*" if family == FULL else "o-",
            label=family,
        )
    ax.set_xscale("log")
    ax.set_xlabel("cache bytes per case after the reply (MiB, log)")
    ax.set_ylabel("BFCL accuracy (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def arguments() -> argparse.ArgumentParser:
    """The command line (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=64, help="test cases in all, the categories in turn")
    parser.add_argument("--catalogue-tokens", type=int, default=4096, help="catalogue size (at most), in tokens")
    parser.add_argument(
        "--own-share",
        type=float,
        default=0.5,
        help="at most this share of a catalogue's tokens holds its cases' own functions (cases are grouped so)",
    )
    parser.add_argument("--ratios", nargs="+", type=float, default=list(RATIOS), help="byte compression ratios")
    parser.add_argument("--baselines", nargs="*", default=["streaming_llm", "key_norm"], choices=QUERY_FREE)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--query-cap", type=int, default=2048, help="KV-Surgeon's fitting queries per KV head")
    parser.add_argument("--on-policy", action="store_true", help="KV-Surgeon's on-policy calibration (BlockReplay)")
    parser.add_argument(
        "--task-questions",
        type=int,
        default=0,
        help="add KV-Surgeon rows calibrated by self-study with up to this many questions of BFCL's calibration "
        "partition per catalogue, each using only that catalogue's functions (0: no such rows)",
    )
    parser.add_argument(
        "--rows",
        nargs="+",
        metavar="LABEL",
        help="run and report only these rows of the ratios, baselines and task questions given (labels as the table "
        "prints them, e.g. kv_surgeon_int4@4x; full_kv, the reference, always): processes given different rows "
        "share one log (its lines are whole appends), but rows serving one catalogue (X and X+pask@0.33) belong in "
        "one process, which makes it once; default: every row",
    )
    parser.add_argument("--seed", type=int, default=0, help="split, catalogue and compaction seed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/tool_catalogue.json")
    parser.add_argument("--plot", default=None)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``argv`` parsed and checked (``parser.error`` on a bad value)."""
    args = parser.parse_args(argv)
    for name in ("cases", "catalogue_tokens", "max_new_tokens", "query_cap", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.task_questions < 0:
        parser.error(f"--task-questions must be >= 0, got {args.task_questions}")
    if not 0 < args.own_share <= 1:
        parser.error(f"--own-share must lie in (0, 1], got {args.own_share}")
    if any(not r >= 1 for r in args.ratios):
        parser.error(f"--ratios must be >= 1, got {args.ratios}")
    known = [row.label for row in run_rows(args)]
    unknown = sorted(set(args.rows or ()) - set(known))
    if unknown:
        parser.error(f"--rows {unknown} are not rows of these --ratios / --baselines / --task-questions: {known}")
    return args


@dataclass
class Plan:
    """What a run answers and with what: its cases, their groups, each group's catalogue (tools) and task questions
    (per group; empty lists without ``--task-questions``)."""

    cases: list[BfclEntry]
    groups: list[list[BfclEntry]]
    catalogues: list[list[dict]]
    questions: list[list[BfclEntry]]

    @classmethod
    def make(cls, tokenizer, args: argparse.Namespace) -> Plan:
        """The plan of ``args``: `pick_cases`, `group_cases`, `build_catalogue`, then each catalogue's
        `catalogue_questions` (``--task-questions`` of them at most)."""
        cases = pick_cases(CATEGORIES, args.cases, args.seed)
        groups = group_cases(tokenizer, cases, int(args.own_share * args.catalogue_tokens))
        catalogues = [build_catalogue(tokenizer, g, CATEGORIES, args.catalogue_tokens, args.seed) for g in groups]
        questions = [
            catalogue_questions(tools, CATEGORIES, args.task_questions, args.seed) if args.task_questions else []
            for tools in catalogues
        ]
        return cls(cases, groups, catalogues, questions)

    def settings(self, model_name: str, tokenizer, args: argparse.Namespace) -> dict:
        """The settings a `CaseLog` of this run holds (``task_questions``: N and `TASK_QUESTION_RULE`, only with
        ``--task-questions``; the questions themselves follow from the rule, the seed and the catalogues)."""
        settings = {
            "model": model_name,
            "catalogues": [catalogue_metadata(tokenizer, tools) for tools in self.catalogues],
            "groups": [[case.id for case in group] for group in self.groups],
            **{key: getattr(args, key) for key in ("max_new_tokens", "query_cap", "on_policy", "seed")},
        }
        if args.task_questions:
            settings["task_questions"] = {"per_catalogue": args.task_questions, "rule": TASK_QUESTION_RULE}
        return settings


def main(argv: list[str] | None = None) -> dict:
    parser = arguments()
    args = parse_args(parser, argv)
    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_default_model()
    plan = Plan.make(tokenizer, args)
    cases, groups, catalogues = plan.cases, plan.groups, plan.catalogues
    settings = plan.settings(model.config.name_or_path, tokenizer, args)
    metadata = settings["catalogues"]
    out = Path(args.out)
    try:
        log = CaseLog(out.with_suffix(".cases.jsonl"), settings)
    except ValueError as error:
        parser.error(str(error))
    for group, tools, made, questions in zip(groups, catalogues, metadata, plan.questions, strict=True):
        asked = f", {len(questions)} task questions" if args.task_questions else ""
        print(f"catalogue of {len(group)} cases: {len(tools)} tools, {made['tokens']} tokens{asked}")
    table, prefill, provenance = load_pask("calibrated", model)
    pask = pask_at(table, prefill, PASK_BUDGET)
    all_high = PolicyTable.all_high(model)
    rows = selected_rows(args)
    results: dict[str, list[dict]] = {}
    for row in rows:
        policy, prefill_policy = pask if row.pask else (all_high, None)
        for index, (group, tools) in enumerate(zip(groups, catalogues, strict=True)):
            todo = [case for case in group if (row.label, case.id) not in log.cases]
            if not todo:
                continue
            folder = Path(f"{out}.catalogues")
            questions = plan.questions[index]
            context = catalogue_for(model, tokenizer, tools, row, index, folder, log, args, questions)
            for case in todo:
                record = answer(model, tokenizer, case, tools, context, policy, prefill_policy, args.max_new_tokens)
                log.add_case(row.label, {**record, "group": index})
            context = None  # freed before the next catalogue is made
        results[row.label] = [log.cases[(row.label, case.id)] for case in cases]
        print(f"{row.label}: {sum(r['valid'] for r in results[row.label])}/{len(cases)}")
    summaries = [row_summary(row, results[row.label], results[FULL], log) for row in rows]
    mark_best_baselines(summaries, args.baselines)
    print_table(summaries)
    payload = {
        "settings": settings,
        "categories": list(CATEGORIES),
        "catalogue_tools": [[tool["name"] for tool in tools] for tools in catalogues],
        "task_questions": [[question.id for question in questions] for questions in plan.questions],
        "pask": {"provenance": provenance, "B_D": pask[0].budget, "B_P": pask[1].budget},
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "rows": summaries,
        "records": results,
    }
    payload = write_json(out, payload, started=started)
    print(f"wrote {out}")
    if args.plot:
        tokens = max(made["tokens"] for made in metadata)
        plot(summaries, f"BFCL, {len(cases)} cases after tool catalogues of <= {tokens} tokens", args.plot)
        print(f"wrote {args.plot}")
    return payload


if __name__ == "__main__":
    main()
