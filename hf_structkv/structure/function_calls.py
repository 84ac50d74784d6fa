"""JSON schema for function calls, built from BFCL- or OpenAI-style tool definitions.

The output grammar is a JSON list of calls ``[{"name": ..., "arguments": {...}}, ...]`` (at least one call). Each
item is an ``anyOf`` over the tools: branch ``k`` fixes ``name`` to a one-value enum (tool ``k``'s name) and
``arguments`` to tool ``k``'s parameter object, so the arguments are tied to the called tool. lm-format-enforcer
parses ``anyOf`` of objects by forking one parser per branch; the branches whose name no longer matches drop out
while the name is generated, so after the name only the called tool's branch is alive (a discriminated union).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ARGUMENTS_KEY", "DISPATCH_KEY", "function_call_schema", "parameter_schema"]

DISPATCH_KEY = "name"
"""Key of a call object whose value selects the tool (the ``dispatch_key`` role)."""
ARGUMENTS_KEY = "arguments"
"""Key of a call object whose value holds the tool's arguments (``required`` / ``optional`` roles)."""

# BFCL writes Python type names; JSON Schema names pass through unchanged.
_TYPE_NAMES = {
    "dict": "object",
    "float": "number",
    "tuple": "array",
    "object": "object",
    "number": "number",
    "array": "array",
    "integer": "integer",
    "string": "string",
    "boolean": "boolean",
    "null": "null",
}
_ANY_TYPES = ("string", "number", "boolean", "null", "object", "array")
# Constraint keywords lm-format-enforcer enforces and that are copied as they are. Everything else
# (description, default, title, format, minimum, ...) is informational or not enforceable and is dropped.
_COPIED_KEYWORDS = ("minItems", "maxItems", "minLength", "maxLength")


def function_call_schema(tools: Sequence[Mapping[str, Any]]) -> dict:
    """JSON schema of a non-empty list of calls to ``tools``.

    Args:
        tools: tool definitions, each BFCL style ``{"name", "description", "parameters": {"type": "dict",
            "properties", "required"}}`` or OpenAI style ``{"type": "function", "function": {...}}``. BFCL types
            ``dict``, ``float``, ``tuple`` and ``any`` are converted to JSON Schema.

    Returns:
        ``{"type": "array", "minItems": 1, "items": {"anyOf": [call_0, call_1, ...]}}`` with
        ``call_k = {"type": "object", "properties": {"name": {"type": "string", "enum": [name_k]},
        "arguments": parameters_k}, "required": ["name", "arguments"]}``.

    Raises:
        TypeError: ``tools`` or a definition in it has the wrong type.
        ValueError: no tools, a tool without a name, duplicate names, or a malformed parameter schema (the message
            names the tool and the path inside it).
    """
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise TypeError(f"tools must be a list of tool definitions (dicts), got {type(tools).__name__}")
    if not tools:
        raise ValueError("tools must contain at least one tool definition")
    calls = []
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        name, parameters = _unwrap_tool(tool, index)
        if name in seen:
            raise ValueError(f"tools[{index}]: duplicate tool name {name!r}; tool names must be unique")
        seen.add(name)
        arguments = parameter_schema(parameters, f"tools[{index}] ({name}).parameters")
        if arguments.get("type") != "object":
            raise ValueError(f"tools[{index}] ({name}).parameters must be an object schema (type dict / object)")
        calls.append(
            {
                "type": "object",
                "properties": {
                    DISPATCH_KEY: {"type": "string", "enum": [name]},
                    ARGUMENTS_KEY: arguments,
                },
                "required": [DISPATCH_KEY, ARGUMENTS_KEY],
            }
        )
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}


def _unwrap_tool(tool: Any, index: int) -> tuple[str, Mapping[str, Any]]:
    """``(name, parameters)`` of a BFCL or OpenAI tool definition; a tool without parameters takes none."""
    if not isinstance(tool, Mapping):
        raise TypeError(f"tools[{index}] must be a dict, got {type(tool).__name__}")
    if tool.get("type") == "function" and "function" in tool:
        tool = tool["function"]
        if not isinstance(tool, Mapping):
            raise TypeError(f"tools[{index}]['function'] must be a dict, got {type(tool).__name__}")
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"tools[{index}] needs a non-empty string 'name', got {name!r}")
    parameters = tool.get("parameters", {"type": "object", "properties": {}})
    return name, parameters


def parameter_schema(spec: Any, path: str = "parameters") -> dict:
    """Convert one BFCL / OpenAI parameter schema to the JSON Schema subset lm-format-enforcer enforces.

    Keeps ``type`` (BFCL names mapped: ``dict`` -> object, ``float`` -> number, ``tuple`` -> array, ``any`` -> any
    JSON value), ``properties``, ``required``, ``items``, ``enum``, ``anyOf`` and the length / item-count bounds;
    drops descriptions, defaults and keywords the engine cannot enforce.

    Raises:
        TypeError: ``spec`` (or a nested schema) is not a dict.
        ValueError: unknown type, ``required`` naming a missing property, or an enum that is empty or mixes
            strings with numbers; the message names ``path``.
    """
    if not isinstance(spec, Mapping):
        raise TypeError(f"{path} must be a dict (a JSON schema), got {type(spec).__name__}")
    if "anyOf" in spec:
        options = spec["anyOf"]
        if not isinstance(options, Sequence) or isinstance(options, (str, bytes)) or not options:
            raise ValueError(f"{path}.anyOf must be a non-empty list of schemas")
        return {"anyOf": [parameter_schema(option, f"{path}.anyOf[{i}]") for i, option in enumerate(options)]}
    out: dict[str, Any] = {}
    json_type = _json_type(spec, path)
    if json_type == "any":
        return {"anyOf": [{"type": t} for t in _ANY_TYPES]}
    if json_type is not None:
        out["type"] = json_type
    if "enum" in spec:
        out["enum"] = _enum_values(spec["enum"], f"{path}.enum")
    if json_type == "object" and "properties" in spec:
        out.update(_object_fields(spec, path))
    if json_type == "array" and "items" in spec:
        out["items"] = parameter_schema(spec["items"], f"{path}.items")
    out.update({key: spec[key] for key in _COPIED_KEYWORDS if key in spec})
    return out


def _json_type(spec: Mapping[str, Any], path: str) -> str | list[str] | None:
    """The JSON Schema type of ``spec`` (``"any"`` for BFCL's any), inferred as object from ``properties``;
    ``None`` only for a pure enum."""
    raw = spec.get("type")
    if raw is None:
        if "properties" in spec:
            return "object"
        if "enum" in spec:
            return None
        raise ValueError(f"{path} needs a 'type' (or 'enum', 'properties' or 'anyOf')")
    if isinstance(raw, list):
        types = [_one_type(t, path) for t in raw]
        if "any" in types or not types:
            raise ValueError(f"{path}.type list {raw!r} must be non-empty and must not contain 'any'")
        return types
    return _one_type(raw, path)


def _one_type(raw: Any, path: str) -> str:
    if raw == "any":
        return "any"
    if raw not in _TYPE_NAMES:
        raise ValueError(f"{path}.type {raw!r} is not supported; use one of {sorted(_TYPE_NAMES) + ['any']}")
    return _TYPE_NAMES[raw]


def _enum_values(values: Any, path: str) -> list:
    """Enum values as a list: all strings or all numbers (lm-format-enforcer supports no other enums)."""
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)) or not values:
        raise ValueError(f"{path} must be a non-empty list, got {values!r}")
    if all(isinstance(v, str) for v in values):
        return list(values)
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return list(values)
    raise ValueError(f"{path} must hold only strings or only numbers, got {list(values)!r}")


def _object_fields(spec: Mapping[str, Any], path: str) -> dict:
    """``properties`` (converted) and ``required`` (checked against them) of an object schema."""
    properties = spec["properties"]
    if not isinstance(properties, Mapping):
        raise TypeError(f"{path}.properties must be a dict, got {type(properties).__name__}")
    required = spec.get("required", [])
    if isinstance(required, (str, bytes)) or not isinstance(required, Sequence):
        raise ValueError(f"{path}.required must be a list of property names, got {required!r}")
    missing = [key for key in required if key not in properties]
    if missing:
        raise ValueError(f"{path}.required names {missing} that are not in its properties {list(properties)}")
    return {
        "properties": {key: parameter_schema(value, f"{path}.properties.{key}") for key, value in properties.items()},
        "required": list(required),
    }
