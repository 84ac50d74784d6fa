"""Prompt span labels (PASK A.3, Table 6) on the embedded model's real chat-template prompt, and their token labels."""

import json

import pytest

from hf_structkv.structure.prompt_spans import PROMPT_LABELS, label_prompt, token_labels
from hf_structkv.structured_generation import CALL_INSTRUCTION

TOOLS = [  # BFCL style: Python type names, descriptions, an enum, required entries
    {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "dict",
            "properties": {
                "city": {"type": "string", "description": "The city name, e.g. Oslo."},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit."},
            },
            "required": ["city"],
        },
    },
    {
        "name": "math.gcd",
        "description": "Greatest common divisor of two integers.",
        "parameters": {
            "type": "dict",
            "properties": {
                "a": {"type": "integer", "description": "First number."},
                "b": {"type": "integer", "description": "Second number."},
            },
            "required": ["a", "b"],
        },
    },
]
QUESTION = "What's the weather in Oslo in celsius?"
# The first tool exactly as the Qwen2.5 template writes it, cut into its labelled runs.
GOLDEN_FIRST_TOOL = [
    ('{"name": "', "schema_scaffold"),
    ("get_weather", "function_name"),
    ('", "description": "', "schema_scaffold"),
    ("Current weather in a city.", "schema_description"),
    ('", "parameters": {"type": "', "schema_scaffold"),
    ("dict", "type_constraint"),
    ('", "properties": {"', "schema_scaffold"),
    ("city", "parameter_key"),
    ('": {"type": "', "schema_scaffold"),
    ("string", "type_constraint"),
    ('", "description": "', "schema_scaffold"),
    ("The city name, e.g. Oslo.", "schema_description"),
    ('"}, "', "schema_scaffold"),
    ("unit", "parameter_key"),
    ('": {"type": "', "schema_scaffold"),
    ("string", "type_constraint"),
    ('", "enum": ["', "schema_scaffold"),
    ("celsius", "enum_constraint"),
    ('", "', "schema_scaffold"),
    ("fahrenheit", "enum_constraint"),
    ('"], "description": "', "schema_scaffold"),
    ("Temperature unit.", "schema_description"),
    ('"}}, "required": ["', "schema_scaffold"),
    ("city", "parameter_key"),
    ('"]}}', "schema_scaffold"),
]


@pytest.fixture(scope="module")
def prompt(tokenizer):
    messages = [{"role": "system", "content": CALL_INSTRUCTION}, {"role": "user", "content": QUESTION}]
    return tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)


def _runs(text, spans):
    return [(text[start:end], label) for start, end, label in spans]


def _char_labels(text, spans):
    labels = [None] * len(text)
    for start, end, label in spans:
        labels[start:end] = [label] * (end - start)
    return labels


def test_golden_labels_of_the_real_chat_template_prompt(prompt):
    spans = label_prompt(prompt, TOOLS)
    assert spans[0][0] == 0 and spans[-1][1] == len(prompt)
    assert all(a[1] == b[0] and a[2] != b[2] for a, b in zip(spans, spans[1:]))  # a partition into maximal runs
    assert {label for _, _, label in spans} == set(PROMPT_LABELS)
    first = prompt.index('{"name": "get_weather"')
    index = next(i for i, span in enumerate(spans) if span[0] == first)
    assert _runs(prompt, spans[index : index + len(GOLDEN_FIRST_TOOL)]) == GOLDEN_FIRST_TOOL
    # The instructions, the template text, the newline between tools and the question stay protected content.
    assert spans[index - 1] == (0, first, "protected_content")
    assert _runs(prompt, spans[index + len(GOLDEN_FIRST_TOOL) : index + len(GOLDEN_FIRST_TOOL) + 1]) == [
        ("\n", "protected_content")
    ]
    tail = prompt[spans[-1][0] :]
    assert spans[-1][2] == "protected_content" and tail.startswith("\n</tools>") and QUESTION in tail
    # Exact spans in the second tool.
    name = prompt.index("math.gcd")
    assert (name, name + len("math.gcd"), "function_name") in spans
    required = prompt.index('"required": ["a", "b"]') + len('"required": ["')
    assert (required, required + 1, "parameter_key") in spans
    assert (required + 5, required + 6, "parameter_key") in spans
    # The instruction's JSON-like example is not a tool: it keeps the default label.
    example = prompt.index('{"name": <tool name>')
    assert _char_labels(prompt, spans)[example] == "protected_content"


def test_token_labels_follow_the_offsets_and_cross_boundaries(tokenizer, prompt):
    spans = label_prompt(prompt, TOOLS)
    labels = token_labels(tokenizer, prompt, spans)
    encoding = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
    assert len(labels) == len(encoding["input_ids"])
    chars = _char_labels(prompt, spans)
    texts = []
    for (start, end), got in zip(encoding["offset_mapping"], labels):
        assert got == tuple(label for label in PROMPT_LABELS if label in set(chars[start:end]))
        texts.append(prompt[start:end])
    crossing = {(text, got) for text, got in zip(texts, labels) if len(got) > 1}
    assert crossing == {
        ('.",', ("schema_scaffold", "schema_description")),  # the end of a description and its closing quote
        ('."', ("schema_scaffold", "schema_description")),
        ("}}\n", ("protected_content", "schema_scaffold")),  # the end of a tool and the newline after it
    }
    assert sum(got == ("protected_content", "schema_scaffold") for got in labels) == 2
    by_text = dict(zip(texts, labels))
    assert by_text["get"] == ("function_name",) and by_text["_weather"] == ("function_name",)
    assert by_text["ahrenheit"] == ("enum_constraint",) and by_text["integer"] == ("type_constraint",)


def test_openai_tools_nested_schemas_any_whitespace_and_key_order():
    tool = {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {
                "type": "object",
                "properties": {
                    "type": {"type": ["string", "null"], "description": "Kind."},
                    "rooms": {"type": "array", "items": {"type": "integer", "enum": [1, 2.5]}},
                    "when": {"anyOf": [{"type": "string"}, {"type": "object", "properties": {"day": {"type": "int"}}}]},
                },
                "required": ["type"],
                "default": "x",
            },
        },
    }
    reordered = json.dumps(dict(reversed(list(tool.items()))), indent=2)
    text = "before " + reordered + " after"
    runs = [run for run in _runs(text, label_prompt(text, [tool])) if run[1] != "schema_scaffold"]
    assert runs == [
        ("before ", "protected_content"),
        ("book", "function_name"),
        ("object", "type_constraint"),
        ("type", "parameter_key"),  # a property named "type" is a key; its value a schema
        ("string", "type_constraint"),
        ("null", "type_constraint"),
        ("Kind.", "schema_description"),
        ("rooms", "parameter_key"),
        ("array", "type_constraint"),
        ("integer", "type_constraint"),
        ("1", "enum_constraint"),
        ("2.5", "enum_constraint"),
        ("when", "parameter_key"),
        ("string", "type_constraint"),
        ("object", "type_constraint"),
        ("day", "parameter_key"),
        ("int", "type_constraint"),
        ("type", "parameter_key"),
        (" after", "protected_content"),
    ]
    assert '"function"' in "".join(
        t for t, label in _runs(text, label_prompt(text, [tool])) if label == "schema_scaffold"
    )
    # A template that writes only the inner function object is matched too.
    inner = json.dumps(tool["function"])
    assert ("book", "function_name") in _runs(inner, label_prompt(inner, [tool]))


def test_invalid_or_unrecognised_json_keeps_the_default_label():
    tool = TOOLS[0]
    other = dict(tool, name="get_time")  # valid JSON, but not one of the tools
    broken = json.dumps(tool)[:-1]  # does not parse
    for text in (json.dumps(other), broken, "no json at all {", ""):
        spans = label_prompt(text, [tool])
        assert all(label == "protected_content" for _, _, label in spans)
        assert sum(end - start for start, end, _ in spans) == len(text)
    two = json.dumps(tool) + " and again " + json.dumps(tool)
    names = [run for run in _runs(two, label_prompt(two, [tool])) if run[1] == "function_name"]
    assert names == [("get_weather", "function_name")] * 2


def test_bad_arguments_are_named(tokenizer):
    with pytest.raises(TypeError, match="text must be"):
        label_prompt(b"bytes", TOOLS)
    with pytest.raises(TypeError, match="tools must be a list"):
        label_prompt("x", TOOLS[0])
    with pytest.raises(TypeError, match=r"tools\[0\] must be a dict"):
        label_prompt("x", [print])
    with pytest.raises(ValueError, match="label"):
        token_labels(tokenizer, "abc", [(0, 2, "keyword")])
    with pytest.raises(ValueError, match="0 <= start < end"):
        token_labels(tokenizer, "abc", [(1, 9, "schema_scaffold")])
    with pytest.raises(ValueError, match="triples"):
        token_labels(tokenizer, "abc", [(0, 1)])

    class Slow:
        is_fast = False

    with pytest.raises(TypeError, match="fast tokenizer"):
        token_labels(Slow(), "abc", [])
    assert token_labels(tokenizer, "hello world", []) == [("protected_content",)] * 2
