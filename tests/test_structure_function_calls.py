"""function_call_schema / parameter_schema: BFCL and OpenAI tools -> the JSON schema lm-format-enforcer enforces."""

import json

import pytest
from lmformatenforcer import JsonSchemaParser
from lmformatenforcer.characterlevelparser import ForceStopParser

from hf_structkv.structure.function_calls import function_call_schema, parameter_schema
from hf_structkv.structure.json_tags import advance_characters

BFCL_TOOL = {
    "name": "calculate_triangle_area",
    "description": "Area of a triangle.",
    "parameters": {
        "type": "dict",
        "properties": {
            "base": {"type": "integer", "description": "The base."},
            "height": {"type": "float", "description": "The height."},
            "unit": {"type": "string", "enum": ["cm", "m"], "default": "cm"},
            "corners": {"type": "tuple", "items": {"type": "integer"}},
            "extra": {"type": "any"},
        },
        "required": ["base", "height"],
    },
}
OPENAI_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def accepts(schema: dict, text: str) -> bool:
    """True if lm-format-enforcer accepts ``text`` as a complete output under ``schema``."""
    parser = JsonSchemaParser(schema)
    for character in text:
        if character not in parser.get_allowed_characters():
            return False
        parser = advance_characters(parser, character)
    return not isinstance(parser, ForceStopParser) and parser.can_end()


def test_schema_shape_and_bfcl_type_conversion():
    schema = function_call_schema([BFCL_TOOL, OPENAI_TOOL])
    assert schema["type"] == "array" and schema["minItems"] == 1
    first, second = schema["items"]["anyOf"]
    assert first["required"] == ["name", "arguments"]
    assert first["properties"]["name"] == {"type": "string", "enum": ["calculate_triangle_area"]}
    assert second["properties"]["name"]["enum"] == ["get_weather"]
    arguments = first["properties"]["arguments"]
    assert arguments["type"] == "object" and arguments["required"] == ["base", "height"]
    props = arguments["properties"]
    assert props["base"] == {"type": "integer"}  # description dropped
    assert props["height"] == {"type": "number"}
    assert props["unit"] == {"type": "string", "enum": ["cm", "m"]}  # default dropped
    assert props["corners"] == {"type": "array", "items": {"type": "integer"}}
    assert {option["type"] for option in props["extra"]["anyOf"]} == {
        "string",
        "number",
        "boolean",
        "null",
        "object",
        "array",
    }
    json.dumps(schema)  # plain JSON


def test_engine_accepts_valid_calls_and_rejects_invalid_ones():
    schema = function_call_schema([BFCL_TOOL, OPENAI_TOOL])
    assert accepts(schema, '[{"name": "get_weather", "arguments": {"city": "Paris"}}]')
    assert accepts(
        schema,
        '[{"name": "calculate_triangle_area", "arguments": {"base": 3, "height": 2.5, "unit": "m", '
        '"corners": [1, 2], "extra": {"k": [null, true]}}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]',
    )
    assert not accepts(schema, "[]")  # at least one call
    assert not accepts(schema, '[{"name": "get_time", "arguments": {}}]')  # unknown tool
    assert not accepts(schema, '[{"name": "get_weather", "arguments": {"base": 3}}]')  # another tool's argument
    assert not accepts(schema, '[{"name": "get_weather", "arguments": {}}]')  # required argument missing
    assert not accepts(schema, '[{"name": "calculate_triangle_area", "arguments": {"base": 1.5, "height": 1}}]')
    assert not accepts(
        schema, '[{"name": "calculate_triangle_area", "arguments": {"base": 1, "height": 1, "unit": "km"}}]'
    )


def test_tool_without_parameters_takes_an_empty_object():
    schema = function_call_schema([{"name": "now"}])
    assert accepts(schema, '[{"name": "now", "arguments": {}}]')
    assert not accepts(schema, '[{"name": "now", "arguments": {"x": 1}}]')


def test_parameter_schema_keeps_enforceable_keywords_and_unions():
    spec = {
        "anyOf": [{"type": "string", "minLength": 2, "maxLength": 5, "format": "x"}, {"type": ["integer", "null"]}],
    }
    assert parameter_schema(spec) == {
        "anyOf": [{"type": "string", "minLength": 2, "maxLength": 5}, {"type": ["integer", "null"]}]
    }
    assert parameter_schema({"enum": [1, 2.5]}) == {"enum": [1, 2.5]}
    assert parameter_schema({"properties": {"a": {"type": "boolean"}}}) == {
        "type": "object",
        "properties": {"a": {"type": "boolean"}},
        "required": [],
    }
    assert parameter_schema({"type": "dict"}) == {"type": "object"}  # free-form dictionary
    assert parameter_schema({"type": "array", "minItems": 1}) == {"type": "array", "minItems": 1}


@pytest.mark.parametrize(
    ("tools", "error", "match"),
    [
        ("get_weather", TypeError, "list of tool definitions"),
        ({"name": "x"}, TypeError, "list of tool definitions"),
        ([], ValueError, "at least one tool"),
        (["x"], TypeError, r"tools\[0\] must be a dict"),
        ([{"description": "no name"}], ValueError, "non-empty string 'name'"),
        ([{"name": "f"}, {"name": "f"}], ValueError, "duplicate tool name 'f'"),
        ([{"type": "function", "function": "f"}], TypeError, r"\['function'\] must be a dict"),
        ([{"name": "f", "parameters": {"type": "string"}}], ValueError, "must be an object schema"),
        ([{"name": "f", "parameters": {"type": "dict", "properties": {"a": {"type": "str"}}}}], ValueError, "'str'"),
        (
            [{"name": "f", "parameters": {"type": "dict", "properties": {}, "required": ["a"]}}],
            ValueError,
            r"required names \['a'\]",
        ),
        ([{"name": "f", "parameters": {"type": "dict", "properties": {"a": {"enum": []}}}}], ValueError, "non-empty"),
        (
            [{"name": "f", "parameters": {"type": "dict", "properties": {"a": {"enum": ["x", 1]}}}}],
            ValueError,
            "only strings or only numbers",
        ),
        ([{"name": "f", "parameters": {"type": "dict", "properties": {"a": {}}}}], ValueError, "needs a 'type'"),
        ([{"name": "f", "parameters": {"type": "dict", "properties": {"a": 3}}}], TypeError, r"properties\.a must"),
        ([{"name": "f", "parameters": {"type": "dict", "properties": []}}], TypeError, "properties must be a dict"),
        ([{"name": "f", "parameters": {"type": "dict", "properties": {"a": {"type": ["any"]}}}}], ValueError, "'any'"),
        ([{"name": "f", "parameters": {"anyOf": []}}], ValueError, "anyOf must be a non-empty list"),
    ],
)
def test_malformed_tools_raise_with_the_path(tools, error, match):
    with pytest.raises(error, match=match):
        function_call_schema(tools)
