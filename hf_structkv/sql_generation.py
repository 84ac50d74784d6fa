"""One call for PASK text-to-SQL: a query under one database's SQL grammar (xgrammar) on a structured mixed-precision
cache, with the prompt that shows the schema as ``CREATE TABLE`` statements.

The SQL twin of `generate_calls`: the same `generate_structured` core, a `SqlGrammarAdapter` in the
`StructuralLogitsProcessor`, and a `PolicyTable` of the ``"sql"`` family (e.g. ``PolicyTable.all_high(model,
family="sql")``). Needs the optional ``xgrammar`` package (``pip install "hf-structkv[sql]"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .policy.table import PolicyTable
from .structure.processor import StructuralLogitsProcessor
from .structure.sql_grammar import DatabaseSchema, identifier
from .structured_generation import StructuredOutput, generate_structured, left_padded_batch

__all__ = ["SQL_INSTRUCTION", "SqlGeneration", "generate_sql", "schema_ddl", "sql_chat", "sql_processor", "sql_prompt"]

SQL_INSTRUCTION = (
    "You are a SQLite expert. Given the database schema below, answer the question with one SQL query and nothing "
    "else. Write keywords in upper case and alias joined tables as T1, T2, ..."
)
_SQL_TYPES = {"number": "NUMERIC", "text": "TEXT", "time": "DATETIME", "boolean": "BOOLEAN", "others": "TEXT"}


@dataclass
class SqlGeneration(StructuredOutput):
    """What `generate_sql` produced: a `StructuredOutput` plus ``queries``, per sequence the generated query, or
    ``None`` when generation stopped at ``max_new_tokens`` before the grammar allowed a stop token."""

    queries: list[str | None]


def schema_ddl(schema: DatabaseSchema) -> str:
    """The schema as SQLite ``CREATE TABLE`` statements: columns with their types (Spider's type names mapped to
    SQLite ones), then ``PRIMARY KEY`` and ``FOREIGN KEY ... REFERENCES`` lines, names written as the grammar
    writes them."""
    if not isinstance(schema, DatabaseSchema):
        raise TypeError(f"schema must be a DatabaseSchema (DatabaseSchema.from_spider), got {type(schema).__name__}")
    statements = []
    for table_index, table in enumerate(schema.tables):
        indices = [i for i, (owner, _) in enumerate(schema.columns) if owner == table_index]
        lines = [
            f"  {identifier(schema.columns[i][1])} {_SQL_TYPES.get(schema.column_types[i], 'TEXT')}" for i in indices
        ]
        keys = [identifier(schema.columns[i][1]) for i in schema.primary_keys if i in indices]
        if keys:
            lines.append(f"  PRIMARY KEY ({', '.join(keys)})")
        for column, referenced in schema.foreign_keys:
            if column in indices:
                target_table, target = schema.columns[referenced]
                lines.append(
                    f"  FOREIGN KEY ({identifier(schema.columns[column][1])}) REFERENCES "
                    f"{identifier(schema.tables[target_table])}({identifier(target)})"
                )
        statements.append(f"CREATE TABLE {identifier(table)} (\n" + ",\n".join(lines) + "\n);")
    return "\n\n".join(statements)


def sql_chat(question: str, schema: DatabaseSchema) -> list[dict[str, str]]:
    """The chat of one question: `SQL_INSTRUCTION` as system message, the schema's DDL and the question as user
    message."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"question must be a non-empty string, got {question!r}")
    return [
        {"role": "system", "content": SQL_INSTRUCTION},
        {"role": "user", "content": f"{schema_ddl(schema)}\n\nQuestion: {question}"},
    ]


def sql_prompt(tokenizer: PreTrainedTokenizerBase, question: str, schema: DatabaseSchema) -> str:
    """The chat-template text of `sql_chat` (with the generation prompt), as `generate_sql` feeds it."""
    return tokenizer.apply_chat_template(sql_chat(question, schema), add_generation_prompt=True, tokenize=False)


def sql_processor(tokenizer: PreTrainedTokenizerBase, schema: DatabaseSchema, policy) -> StructuralLogitsProcessor:
    """A `StructuralLogitsProcessor` over ``schema``'s SQL grammar (xgrammar) that emits the tags in ``policy``'s view
    (``tag_view``, ``position_bins``: any `RetentionPolicy`), as the cache serving ``policy`` requires."""
    from .structure.xgrammar_sql import SqlGrammarAdapter  # xgrammar is optional: imported on first use

    adapter = SqlGrammarAdapter(tokenizer, schema)
    return StructuralLogitsProcessor(
        tokenizer, adapter=adapter, tag_view=policy.tag_view, position_bins=policy.position_bins
    )


def generate_sql(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    questions: str | Sequence[str],
    schema: DatabaseSchema,
    policy: PolicyTable,
    max_new_tokens: int = 128,
    prefill_plan: torch.Tensor | None = None,
    **generate_kwargs,
) -> SqlGeneration:
    """Answer each question with a SQL query over ``schema`` under its grammar, on a mixed-precision cache.

    The prompt is the tokenizer's chat template of `sql_chat`; a batch of questions is left-padded. Greedy unless
    ``generate_kwargs`` say otherwise.

    Args:
        questions: one question or a list of them (batch), all about ``schema``'s database.
        schema: the database (`DatabaseSchema.from_spider`).
        policy: a `PolicyTable` of the ``"sql"`` family (``PolicyTable.all_high(model, family="sql")``).
        prefill_plan: optional prompt actions for the cache (``[B, P, 3]``).
        generate_kwargs: passed to ``model.generate`` (not ``logits_processor`` / ``past_key_values`` / ``cache``).

    Raises:
        ValueError: empty ``questions``; ``policy`` not a `PolicyTable` of the ``"sql"`` family.
        ImportError: xgrammar is not installed.
    """
    if not isinstance(policy, PolicyTable) or policy.family != "sql":
        got = f"family {policy.family!r}" if isinstance(policy, PolicyTable) else type(policy).__name__
        raise ValueError(
            f"policy must be a PolicyTable of the 'sql' family (e.g. PolicyTable.all_high(model, family='sql')), "
            f"got {got}"
        )
    if isinstance(questions, str):
        questions = [questions]
    if not questions:
        raise ValueError("questions must be a non-empty string or a non-empty list of strings")
    batch = left_padded_batch(
        tokenizer, [sql_prompt(tokenizer, question, schema) for question in questions], model.device
    )
    processor = sql_processor(tokenizer, schema, policy)
    output = generate_structured(
        model, tokenizer, batch, processor, policy, max_new_tokens, prefill_plan=prefill_plan, **generate_kwargs
    )
    generated = output.sequences[:, output.prompt_length :].tolist()
    stopped = [any(token in processor.adapter.stop_token_ids for token in row) for row in generated]
    queries = [text.strip() if done else None for text, done in zip(output.texts, stopped)]
    return SqlGeneration(**vars(output), queries=queries)
