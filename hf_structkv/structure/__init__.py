"""Structural tags from the grammar engine (PASK §3.3): tool schemas, grammar adapters, the tagging processor.

The xgrammar adapters live in `hf_structkv.structure.xgrammar_sql` (SQL) and `hf_structkv.structure.xgrammar_json`
(function calls; ``StructuralLogitsProcessor(..., engine="xgrammar")``), not imported here: xgrammar is optional.
"""

from .adapter import GrammarAdapter, GrammarSequence
from .function_calls import function_call_schema, parameter_schema
from .lmfe import JsonSchemaAdapter
from .processor import ENGINES, StructuralLogitsProcessor, resolve_engine
from .prompt_spans import PROMPT_LABELS, label_prompt, token_labels
from .sql_grammar import DatabaseSchema, SqlGrammar, normalise_sql, sql_grammar
from .sql_tags import SqlTagger
from .tag_source import TagSource
from .tags import (
    NEXT,
    ROLES,
    STATES,
    TAG_CLASSES,
    TAG_VIEWS,
    StructuralTag,
    position_bin_starts,
    position_tag,
    view_tags,
    view_vocabulary,
)

__all__ = [
    "ENGINES",
    "NEXT",
    "PROMPT_LABELS",
    "ROLES",
    "STATES",
    "TAG_CLASSES",
    "TAG_VIEWS",
    "DatabaseSchema",
    "GrammarAdapter",
    "GrammarSequence",
    "JsonSchemaAdapter",
    "SqlGrammar",
    "SqlTagger",
    "StructuralLogitsProcessor",
    "StructuralTag",
    "TagSource",
    "function_call_schema",
    "label_prompt",
    "normalise_sql",
    "parameter_schema",
    "position_bin_starts",
    "position_tag",
    "resolve_engine",
    "sql_grammar",
    "token_labels",
    "view_tags",
    "view_vocabulary",
]
