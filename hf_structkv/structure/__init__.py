"""Structural tags from the grammar engine (PASK §3.3): tool schemas, grammar adapters, the tagging processor."""

from .adapter import GrammarAdapter, GrammarSequence
from .function_calls import function_call_schema, parameter_schema
from .lmfe import JsonSchemaAdapter
from .processor import StructuralLogitsProcessor
from .prompt_spans import PROMPT_LABELS, label_prompt, token_labels
from .tags import NEXT, ROLES, STATES, TAG_CLASSES, StructuralTag

__all__ = [
    "NEXT",
    "PROMPT_LABELS",
    "ROLES",
    "STATES",
    "TAG_CLASSES",
    "GrammarAdapter",
    "GrammarSequence",
    "JsonSchemaAdapter",
    "StructuralLogitsProcessor",
    "StructuralTag",
    "function_call_schema",
    "label_prompt",
    "parameter_schema",
    "token_labels",
]
