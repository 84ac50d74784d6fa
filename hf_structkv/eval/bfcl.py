"""BFCL v4 function-calling cases read offline from the ``bfcl-eval`` package, the paper's splits, and an evaluation
loop that generates under the tools' schema on the mixed-precision cache and scores with BFCL's own AST checker.

Data: ``bfcl_eval/data/BFCL_v4_<category>.json`` (one JSON object a line: ``id``, ``question`` = turns of chat
messages, ``function`` = BFCL function definitions) and ``bfcl_eval/data/possible_answer/BFCL_v4_<category>.json``
(``id``, ``ground_truth``), for the single-turn AST categories in `CATEGORIES`.

Splits (PASK Appendix C.1): within each category, a seeded 1:1:3 calibration / development / test split in which every
complete normalised tool set lies in one partition: entries whose tools normalise to the same set (`tool_set_key`)
are one group, the groups are shuffled by a seeded generator and each goes to the partition furthest below its
share, so the partitions hold 1/5, 1/5 and 3/5 of the entries up to one group. **The test split is for final
reporting only**: calibration fits policies on ``calibration``, every choice (thresholds, baseline knobs, the
cheapest controller within tolerance) is made on ``development``, and nothing is chosen by looking at ``test``.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import random
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from tqdm.auto import tqdm

from ..structure.function_calls import parameter_schema
from ..structured_generation import generate_calls
from ..validation import check_int
from .bfcl_checker import check_calls

__all__ = [
    "CATEGORIES",
    "SPLITS",
    "SPLIT_WEIGHTS",
    "BfclEntry",
    "BfclEvaluation",
    "bfcl_calibration_cases",
    "bfcl_split",
    "evaluate_bfcl",
    "load_bfcl",
    "split_bfcl",
    "summarise",
    "tool_set_key",
]

CATEGORIES = (
    "simple_python",
    "multiple",
    "parallel",
    "parallel_multiple",
    "live_simple",
    "live_multiple",
    "live_parallel",
    "live_parallel_multiple",
)
"""The single-turn BFCL v4 categories scored by the AST checker (non-live, then their live counterparts)."""
SPLITS = ("calibration", "development", "test")
SPLIT_WEIGHTS = (1, 1, 3)
"""Shares of `SPLITS` within each category (PASK Appendix C.1)."""

_INSTALL_HINT = 'pip install --no-deps "bfcl-eval==2026.3.23" (see scripts/setup.sh)'


@dataclass(frozen=True)
class BfclEntry:
    """One BFCL case.

    Attributes:
        id: BFCL's id (``simple_python_0``, ``live_multiple_12-4-0``, ...).
        category: one of `CATEGORIES`.
        messages: the chat messages of its single turn (``{"role", "content"}``; a few live cases open with a
            ``system`` message).
        tools: the BFCL function definitions offered (BFCL types ``dict``, ``float``, ``tuple``, ``any``).
        ground_truth: the possible answer, ``[{name: {param: [accepted values]}}]`` (``""`` marks an omittable
            optional parameter).
    """

    id: str
    category: str
    messages: tuple[dict, ...]
    tools: tuple[dict, ...]
    ground_truth: tuple[dict, ...]


@cache
def _read_lines(relative_path: str) -> tuple[dict, ...]:
    try:
        resource = importlib.resources.files("bfcl_eval") / "data" / relative_path
    except ModuleNotFoundError as err:
        raise ImportError(f"BFCL data comes from the bfcl-eval package: {_INSTALL_HINT}") from err
    text = resource.read_text(encoding="utf-8")
    return tuple(json.loads(line) for line in text.splitlines() if line.strip())


def load_bfcl(category: str) -> tuple[BfclEntry, ...]:
    """All cases of ``category`` in file order, each with its ground truth.

    Raises:
        ValueError: ``category`` is not one of `CATEGORIES`, or the package's question and answer files disagree.
    """
    if category not in CATEGORIES:
        raise ValueError(f"category must be one of {list(CATEGORIES)}, got {category!r}")
    questions = _read_lines(f"BFCL_v4_{category}.json")
    answers = {row["id"]: row["ground_truth"] for row in _read_lines(f"possible_answer/BFCL_v4_{category}.json")}
    entries = []
    for row in questions:
        if row["id"] not in answers:
            raise ValueError(f"bfcl-eval data: {row['id']!r} has no possible answer in {category}")
        if len(row["question"]) != 1:
            raise ValueError(f"bfcl-eval data: {row['id']!r} has {len(row['question'])} turns; expected one")
        entries.append(
            BfclEntry(
                id=row["id"],
                category=category,
                messages=tuple(row["question"][0]),
                tools=tuple(row["function"]),
                ground_truth=tuple(answers[row["id"]]),
            )
        )
    return tuple(entries)


def tool_set_key(tools: Sequence[Mapping[str, Any]]) -> str:
    """A hash of the complete normalised tool set: each tool's name and parameter schema in the JSON Schema form the
    grammar enforces (`parameter_schema`: BFCL type names mapped, descriptions and defaults dropped), canonical
    JSON, sorted over the tools. Cases offering the same tools (up to wording and order) share the key."""
    normalised = sorted(
        json.dumps({"name": tool["name"], "parameters": parameter_schema(tool["parameters"])}, sort_keys=True)
        for tool in tools
    )
    return hashlib.sha256("\n".join(normalised).encode()).hexdigest()


def split_bfcl(entries: Iterable[BfclEntry], seed: int = 0) -> dict[str, tuple[BfclEntry, ...]]:
    """The seeded 1:1:3 calibration / development / test split, made within each category, tool sets kept whole.

    Within a category, entries with the same `tool_set_key` form a group; the groups (sorted by key) are shuffled by
    ``random.Random(f"bfcl-split/{seed}/{category}")`` and each, in that order, joins the partition whose count is
    furthest below its share of the entries placed so far (ties: calibration, development, test). The result depends
    only on the entries and ``seed``. Within a partition, entries follow the shuffled group order, so its first ``n``
    entries are a seeded sample.

    Returns:
        ``{"calibration": ..., "development": ..., "test": ...}``, the categories in their first-seen order.
    """
    by_category: dict[str, dict[str, list[BfclEntry]]] = {}
    for entry in entries:
        if not isinstance(entry, BfclEntry):
            raise TypeError(f"entries must be BfclEntry objects (load_bfcl), got {type(entry).__name__}")
        by_category.setdefault(entry.category, {}).setdefault(tool_set_key(entry.tools), []).append(entry)
    parts: dict[str, list[BfclEntry]] = {name: [] for name in SPLITS}
    shares = [weight / sum(SPLIT_WEIGHTS) for weight in SPLIT_WEIGHTS]
    for category, groups in by_category.items():
        keys = sorted(groups)
        random.Random(f"bfcl-split/{seed}/{category}").shuffle(keys)
        counts, placed = [0] * len(SPLITS), 0
        for key in keys:
            placed += len(groups[key])
            deficits = [share * placed - count for share, count in zip(shares, counts)]
            target = deficits.index(max(deficits))
            counts[target] += len(groups[key])
            parts[SPLITS[target]].extend(groups[key])
    return {name: tuple(part) for name, part in parts.items()}


def _check_categories(categories) -> None:
    if isinstance(categories, str) or not categories:
        raise ValueError(f"categories must be a non-empty list of names from {list(CATEGORIES)}, got {categories!r}")


def bfcl_split(
    categories: Sequence[str], split: str, seed: int = 0, limit: int | None = None, start: int = 0
) -> tuple[BfclEntry, ...]:
    """The ``split`` partition of each category in ``categories`` (`split_bfcl`), at most ``limit`` entries of each
    from its ``start``-th on (its seeded sample: the partition's entries ``start .. start + limit - 1``; runs with
    ``start`` 0, ``limit``, then ``start`` = ``limit`` cover disjoint cases)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {list(SPLITS)}, got {split!r}")
    check_int("limit", limit, 1, counts="cases per category", none_ok=True)
    check_int("start", start, 0, counts="cases skipped per category")
    _check_categories(categories)
    chosen: list[BfclEntry] = []
    for category in categories:
        chosen.extend(split_bfcl(load_bfcl(category), seed)[split][start : None if limit is None else start + limit])
    return tuple(chosen)


def bfcl_calibration_cases(
    categories: Sequence[str], seed: int = 0, limit: int | None = None, test_reserved: int | None = None
) -> tuple[BfclEntry, ...]:
    """The calibration partition of each category (`bfcl_split`), topped up to ``limit`` entries from the same
    category's test partition after its first ``test_reserved`` entries, which stay untouched for testing.

    PASK's 1:1:3 split leaves 40 calibration cases in ``multiple`` / ``parallel`` / ``parallel_multiple``; a
    calibration of 64 per category takes the rest from test entries ``test_reserved ..`` (``bfcl_budget.py`` tests on
    the first ``--cases`` of each test partition: with ``test_reserved`` at least that, the two never share a case).
    ``test_reserved=None`` takes nothing from the test partition (`bfcl_split`'s calibration partition).
    """
    check_int("test_reserved", test_reserved, 0, counts="test cases per category kept for testing", none_ok=True)
    if test_reserved is None:
        return bfcl_split(categories, "calibration", seed=seed, limit=limit)
    check_int("limit", limit, 1, counts="cases per category", none_ok=True)
    _check_categories(categories)
    chosen: list[BfclEntry] = []
    for category in categories:
        parts = split_bfcl(load_bfcl(category), seed)
        pool = parts["calibration"] + parts["test"][test_reserved:]
        chosen.extend(pool[:limit])
    return tuple(chosen)


@dataclass
class BfclEvaluation:
    """What `evaluate_bfcl` measured.

    Attributes:
        records: one dict per entry: ``id``, ``category``, ``valid``, ``error_type``, ``error``, ``text`` (the
            generated text), ``calls`` (parsed, or ``None``), ``prompt_tokens``, ``generated_tokens``, every
            `StructuredGeneration.bytes_report` number (``nbytes``, ``full_nbytes``, ``scheduled_payload_bytes``,
            ``full_payload_bytes``, ``budget_ratio`` = the measured payload ratio B, and its per-stage parts) and
            ``seconds``.
        summary: ``cases``, ``correct``, ``accuracy``, ``per_category`` (cases / correct / accuracy each),
            ``mean_budget_ratio`` (mean B over entries), ``nbytes`` and ``full_nbytes`` (sums over entries; the
            physical bytes after generation vs a ``DynamicCache`` of the same tokens) and ``seconds``.
    """

    records: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)


def evaluate_bfcl(
    model,
    tokenizer,
    entries: Sequence[BfclEntry],
    policy,
    max_new_tokens: int = 256,
    progress: bool = False,
    prefill_policy=None,
    int4_keys: str | None = None,
) -> BfclEvaluation:
    """Answer each entry with `generate_calls` (greedy, batch 1, the entry's tools as the grammar and in the chat
    template) on a mixed-precision cache under ``policy``, and score the calls with BFCL's AST checker.

    Args:
        entries: cases from `load_bfcl` / `bfcl_split`.
        policy: the `PolicyTable` (``PolicyTable.all_high(model)``, ``illustrative_policy(model)``, a calibrated one).
        max_new_tokens: generation cap; a text cut off by it is incomplete JSON and scored invalid
            (``ast_decoder:decoder_failed``).
        progress: show a tqdm bar over the entries.
        prefill_policy: optional `PrefillPolicy` for the prompt tokens (`generate_calls`).
        int4_keys: the cache's INT4 key layout, ``"row"``, ``"centred"`` or ``"centred-g128"`` (`generate_calls`;
            ``None``: the policy's).
    """
    if isinstance(entries, BfclEntry) or not entries:
        raise ValueError("entries must be a non-empty list of BfclEntry objects (load_bfcl / bfcl_split)")
    if not all(isinstance(entry, BfclEntry) for entry in entries):
        raise TypeError("entries must hold only BfclEntry objects (load_bfcl / bfcl_split)")
    check_int("max_new_tokens", max_new_tokens, 1)
    records = []
    for entry in tqdm(entries, desc="bfcl", unit="case", disable=not progress):
        start = time.perf_counter()
        result = generate_calls(
            model,
            tokenizer,
            list(entry.messages),
            entry.tools,
            policy,
            max_new_tokens=max_new_tokens,
            prefill_policy=prefill_policy,
            int4_keys=int4_keys,
        )
        seconds = time.perf_counter() - start
        calls = result.calls[0]
        verdict = check_calls(entry.category, entry.tools, entry.ground_truth, calls)
        generated = result.sequences[0, result.prompt_length :]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        records.append(
            {
                "id": entry.id,
                "category": entry.category,
                "valid": verdict["valid"],
                "error_type": None if verdict["valid"] else verdict["error_type"],
                "error": verdict["error"],
                "text": result.texts[0],
                "calls": calls,
                "prompt_tokens": result.prompt_length,
                "generated_tokens": int((generated != pad).sum()),
                **result.bytes_report(),
                "seconds": seconds,
            }
        )
    return BfclEvaluation(records=records, summary=summarise(records))


def summarise(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Accuracy overall (instance-weighted) and per category, mean B, summed physical and Full-KV bytes, time."""
    per_category: dict[str, dict[str, Any]] = {}
    for record in records:
        row = per_category.setdefault(record["category"], {"cases": 0, "correct": 0})
        row["cases"] += 1
        row["correct"] += int(record["valid"])
    for row in per_category.values():
        row["accuracy"] = row["correct"] / row["cases"]
    correct = sum(int(record["valid"]) for record in records)
    return {
        "cases": len(records),
        "correct": correct,
        "accuracy": correct / len(records),
        "per_category": per_category,
        "mean_budget_ratio": sum(record["budget_ratio"] for record in records) / len(records),
        "nbytes": sum(record["nbytes"] for record in records),
        "full_nbytes": sum(record["full_nbytes"] for record in records),
        "seconds": sum(record["seconds"] for record in records),
    }
