"""Semantic span labels of a prompt that embeds tool schemas (PASK §3.6, A.3, Table 6): the prefill companion's keys.

All text starts as ``protected_content``. A JSON object in the prompt text that parses and equals one of the tools
(as given, or the ``function`` of an OpenAI-style ``{"type": "function", "function": {...}}`` tool) is a validated
schema span: Qwen2.5's chat template writes each tool with ``tojson`` inside ``<tools>...</tools>``; any template
that writes a tool as JSON (any whitespace, any key order) is matched the same way. Inside a validated span:

* ``function_name``: the characters of the tool's ``name`` string (between its quotes);
* ``parameter_key``: the names in a ``properties`` object and the entries of a ``required`` list;
* ``type_constraint``: ``type`` values of the parameter schemas (a string or each string of a list);
* ``enum_constraint``: each value of an ``enum`` list (string characters, or the number / literal);
* ``schema_description``: the characters of ``description`` strings (of the tool and of its parameters);
* ``schema_scaffold``: everything else (braces, brackets, quotes, separators, keys such as ``"type"``, the
  OpenAI wrapper's ``"function"`` value, ``default`` / ``format`` / bounds values).

Nested schemas (``properties``, ``items``, ``anyOf`` / ``oneOf`` / ``allOf``, ``prefixItems``, an object-valued
``additionalProperties``) follow the same rules. JSON that does not parse, or parses but is not one of the tools, keeps
the default label. Matching is by these serialisation patterns only (no annotation, no model); a new serialisation (a
DDL schema, say) needs new patterns.

`token_labels` maps the character spans to tokens through the tokenizer's offset mapping: a token gets every label
of the characters it covers (a token that crosses a span boundary gets several; the prefill plan combines them
conservatively, eq. 12).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

__all__ = ["DEFAULT_LABEL", "PROMPT_LABELS", "label_prompt", "token_labels"]

PROMPT_LABELS = (
    "protected_content",
    "schema_scaffold",
    "function_name",
    "parameter_key",
    "type_constraint",
    "enum_constraint",
    "schema_description",
)
"""The semantic labels of Table 6, in this fixed order (the order of a token's labels in `token_labels`)."""
DEFAULT_LABEL = "protected_content"
SCAFFOLD_LABEL = "schema_scaffold"

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_LITERAL = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")
_WHITESPACE = re.compile(r"[ \t\n\r]*")

# What a JSON value is inside a tool definition. Container roles say how their members are read; leaf roles are the
# label of a string's characters or of a scalar literal (inside a list too).
_WRAPPER, _FUNCTION, _SCHEMA, _PROPERTIES, _SCHEMA_LIST = "wrapper", "function", "schema", "properties", "schemas"
_FUNCTION_KEYS = {"name": "function_name", "description": "schema_description", "parameters": _SCHEMA}
_SCHEMA_KEYS = {
    "type": "type_constraint",
    "description": "schema_description",
    "enum": "enum_constraint",
    "required": "parameter_key",
    "properties": _PROPERTIES,
    "items": _SCHEMA,
    "additionalProperties": _SCHEMA,
    "anyOf": _SCHEMA_LIST,
    "oneOf": _SCHEMA_LIST,
    "allOf": _SCHEMA_LIST,
    "prefixItems": _SCHEMA_LIST,
}
_LEAF_LABELS = frozenset(PROMPT_LABELS) - {DEFAULT_LABEL, SCAFFOLD_LABEL}


def label_prompt(text: str, tools: Sequence[Mapping[str, Any]]) -> list[tuple[int, int, str]]:
    """Label every character of ``text`` with one semantic label of Table 6.

    Args:
        text: the prompt as a string (e.g. ``tokenizer.apply_chat_template(..., tools=tools, tokenize=False)``).
        tools: the tool definitions the prompt embeds (BFCL-style ``{"name", "description", "parameters"}`` or
            OpenAI-style ``{"type": "function", "function": {...}}`` dicts).

    Returns:
        ``(start, end, label)`` character spans, sorted, covering ``text`` exactly once, adjacent spans with
        different labels (maximal runs); ``[]`` for an empty text.

    Raises:
        TypeError: ``text`` is not a str, or ``tools`` is not a list of dicts.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be the prompt as a str, got {type(text).__name__}")
    kinds = _tool_kinds(tools)
    leaves: list[tuple[int, int, str]] = []
    schema_spans: list[tuple[int, int]] = []
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            value = None
        kind = _tool_kind(value, kinds)
        if kind is None:
            start = text.find("{", start + 1)
            continue
        _Scanner(text, leaves).value(start, kind)
        schema_spans.append((start, end))
        start = text.find("{", end)
    return _partition(len(text), schema_spans, leaves)


def token_labels(tokenizer: PreTrainedTokenizerBase, text: str, spans) -> list[tuple[str, ...]]:
    """The labels of each token of ``text`` (tokenised without special tokens, as a chat-template prompt is).

    Args:
        tokenizer: a fast tokenizer (it provides the offset mapping).
        text: the prompt.
        spans: ``(start, end, label)`` character spans (`label_prompt`); characters in no span are
            ``protected_content``.

    Returns:
        Per token, the labels of the characters it covers, in `PROMPT_LABELS` order (several for a token crossing
        a span boundary). A token with an empty offset range takes the labels of the character it starts at.

    Raises:
        TypeError: a slow tokenizer, or ``text`` not a str.
        ValueError: a span outside the text, empty, or with a label not in `PROMPT_LABELS`.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(
            "tokenizer must be a fast tokenizer (it provides return_offsets_mapping): load it with "
            "AutoTokenizer.from_pretrained(..., use_fast=True)"
        )
    if not isinstance(text, str):
        raise TypeError(f"text must be the prompt as a str, got {type(text).__name__}")
    bits = np.zeros(len(text) + 1, dtype=np.uint8)  # one bit per label; the extra slot serves end-of-text offsets
    for span in spans:
        if not (isinstance(span, (tuple, list)) and len(span) == 3):
            raise ValueError(f"spans must be (start, end, label) triples, got {span!r}")
        start, end, label = span
        if label not in PROMPT_LABELS:
            raise ValueError(f"span {span!r} has label {label!r}; labels are {PROMPT_LABELS}")
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= len(text)):
            raise ValueError(f"span {span!r} must satisfy 0 <= start < end <= len(text) = {len(text)}")
        bits[start:end] |= 1 << PROMPT_LABELS.index(label)
    bits[bits == 0] = 1 << PROMPT_LABELS.index(DEFAULT_LABEL)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    labels = []
    for start, end in offsets:
        mask = int(np.bitwise_or.reduce(bits[start:end])) if end > start else int(bits[start])
        labels.append(tuple(label for i, label in enumerate(PROMPT_LABELS) if mask >> i & 1))
    return labels


def _tool_kinds(tools: Any) -> dict[str, str]:
    """Canonical JSON of each tool definition -> the role its top-level object has (wrapper or function); an
    OpenAI-style tool also contributes its ``function`` object (a template may write only that)."""
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise TypeError(f"tools must be a list of tool definitions (dicts), got {type(tools).__name__}")
    kinds = {}
    for index, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise TypeError(f"tools[{index}] must be a dict (a JSON tool definition), got {type(tool).__name__}")
        if tool.get("type") == "function" and isinstance(tool.get("function"), Mapping):
            kinds[_canonical(tool)] = _WRAPPER
            kinds[_canonical(tool["function"])] = _FUNCTION
        else:
            kinds[_canonical(tool)] = _FUNCTION
    return kinds


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, allow_nan=False)


def _tool_kind(value: Any, kinds: dict[str, str]) -> str | None:
    if not isinstance(value, dict):
        return None
    return kinds.get(_canonical(value))


class _Scanner:
    """Walks one validated JSON value of ``text`` and appends the leaf spans ``(start, end, label)`` to ``leaves``."""

    def __init__(self, text: str, leaves: list[tuple[int, int, str]]):
        self.text = text
        self.leaves = leaves

    def skip(self, i: int) -> int:
        return _WHITESPACE.match(self.text, i).end()

    def value(self, i: int, role: str) -> int:
        """Scan the value starting at ``i`` (no leading whitespace) read as ``role``; returns its end."""
        char = self.text[i]
        if char == "{":
            return self.members(i, role)
        if char == "[":
            return self.elements(i, role)
        match = (_STRING if char == '"' else _LITERAL).match(self.text, i)
        start, end = (i + 1, match.end() - 1) if char == '"' else (i, match.end())
        if role in _LEAF_LABELS and end > start:
            self.leaves.append((start, end, role))
        return match.end()

    def members(self, i: int, role: str) -> int:
        """An object at ``i``: its keys and values, read by ``role``."""
        i = self.skip(i + 1)
        while self.text[i] != "}":
            key_end = _STRING.match(self.text, i).end()
            key = json.loads(self.text[i:key_end])
            if role == _PROPERTIES and key_end - 1 > i + 1:
                self.leaves.append((i + 1, key_end - 1, "parameter_key"))
            i = self.skip(self.skip(key_end) + 1)  # past the colon
            i = self.skip(self.value(i, _member_role(role, key)))
            if self.text[i] == ",":
                i = self.skip(i + 1)
        return i + 1

    def elements(self, i: int, role: str) -> int:
        """A list at ``i``: leaf roles label each element, a schema list holds schemas, anything else is scaffold."""
        element_role = _SCHEMA if role == _SCHEMA_LIST else role if role in _LEAF_LABELS else SCAFFOLD_LABEL
        i = self.skip(i + 1)
        while self.text[i] != "]":
            i = self.skip(self.value(i, element_role))
            if self.text[i] == ",":
                i = self.skip(i + 1)
        return i + 1


def _member_role(role: str, key: str) -> str:
    """The role of the value under ``key`` in an object read as ``role``."""
    if role == _WRAPPER:
        return _FUNCTION if key == "function" else SCAFFOLD_LABEL
    if role == _FUNCTION:
        return _FUNCTION_KEYS.get(key, SCAFFOLD_LABEL)
    if role == _SCHEMA:
        return _SCHEMA_KEYS.get(key, SCAFFOLD_LABEL)
    if role == _PROPERTIES:
        return _SCHEMA
    return SCAFFOLD_LABEL


def _partition(length: int, schema_spans: list[tuple[int, int]], leaves: list[tuple[int, int, str]]):
    """Maximal runs covering ``[0, length)``: protected content outside schema spans, scaffold inside them except
    the leaves."""
    labels = [DEFAULT_LABEL] * length
    for start, end in schema_spans:
        labels[start:end] = [SCAFFOLD_LABEL] * (end - start)
    for start, end, label in leaves:
        labels[start:end] = [label] * (end - start)
    runs = []
    for i, label in enumerate(labels):
        if runs and runs[-1][2] == label:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1, label])
    return [tuple(run) for run in runs]
