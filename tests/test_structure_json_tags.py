"""The tagging rules of json_tags on plain lm-format-enforcer parsers (no tokenizer): tokens are given as strings."""

import pytest
from lmformatenforcer import JsonSchemaParser
from lmformatenforcer.characterlevelparser import ForceStopParser
from lmformatenforcer.consts import WHITESPACE_CHARACTERS

from hf_structkv.structure import json_tags
from hf_structkv.structure.function_calls import function_call_schema
from hf_structkv.structure.json_tags import advance_characters, token_tags
from hf_structkv.structure.tags import ROLES, STATES, TAG_CLASSES, StructuralTag

_SHORT = {
    "PS": "pure_scaffold",
    "SB": "schema_bearing",
    "FG": "free_generation",
    "sep": "scaffold_separator",
    "req": "required",
    "opt": "optional",
    "DK": "dispatch_key",
    "bnd": "boundary",
    "CRIT": "critical",
    "LA": "lookahead_critical",
    "-": "no_lookahead",
}

TOOLS = [
    {
        "name": "find",
        "parameters": {
            "type": "dict",
            "properties": {
                "limit": {"type": "integer"},
                "limit_kind": {"type": "string", "enum": ["hard", "soft"]},
                "query": {"type": "string"},
                "extra": {"type": "any"},
                "levels": {"type": "array", "items": {"type": "integer", "enum": [1, 2]}},
                "where": {"type": "dict", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            },
            "required": ["limit", "where"],
        },
    },
    {"name": "fetch", "parameters": {"type": "dict", "properties": {"url": {"type": "string"}}, "required": ["url"]}},
]


def tag(short: str) -> StructuralTag:
    return StructuralTag(*(_SHORT[field] for field in short.split()))


def run(schema: dict, pieces: list[str]) -> list[tuple[StructuralTag, ...]]:
    parser = JsonSchemaParser(schema)
    out = []
    for piece in pieces:
        parser, tags = token_tags(parser, piece)
        for t in tags:
            t.validate("function_calling")
        out.append(tags)
    return out


def expect(schema: dict, rows: list[tuple[str, list[str]]]) -> None:
    got = run(schema, [piece for piece, _ in rows])
    for (piece, shorts), tags in zip(rows, got):
        assert tags == canonical(shorts), piece


def canonical(shorts: list[str]) -> tuple[StructuralTag, ...]:
    """Tags in the canonical (Table 5) order token_tags returns them in."""
    order = {**{v: i for i, v in enumerate(TAG_CLASSES)}, **{v: i for i, v in enumerate(ROLES["function_calling"])}}
    order.update({v: i for i, v in enumerate(STATES["function_calling"])})
    return tuple(sorted((tag(s) for s in shorts), key=lambda t: (order[t.tag_class], order[t.role], order[t.state])))


def test_call_roles_states_and_lookahead():
    expect(
        function_call_schema(TOOLS),
        [
            ("[", ["PS sep bnd -"]),
            ('{"name"', ["PS sep bnd -"]),
            (": ", ["PS sep bnd LA"]),  # the frontier expects the dispatch value
            ('"fi', ["PS DK CRIT LA", "SB DK CRIT LA"]),
            ('nd",', ["SB DK CRIT -", "PS DK CRIT -", "PS sep bnd -"]),  # next from the frontier after the token
            (' "arguments": {', ["PS sep bnd -"]),
            ('"limit', ["PS sep bnd -", "PS req bnd -", "PS opt bnd -"]),  # limit or limit_kind: both candidates
            ('"', ["PS req bnd -"]),  # the closing quote settles the key
            (":", ["PS sep bnd LA"]),  # a required value comes next
            (" 5", ["PS sep bnd LA", "FG req CRIT LA"]),  # a number may continue
            (', "limit_kind": ', ["PS sep bnd LA", "PS opt bnd LA"]),  # an enum value comes next
            ('"soft"', ["PS opt CRIT -", "SB opt CRIT -"]),  # quotes of a closed-set value are critical too
            (', "query": "a\\"b"', ["PS sep bnd -", "PS opt bnd -", "FG opt bnd -"]),  # escapes are content
            (', "where": {"city": "Rome"}}}', ["PS sep bnd -", "PS req bnd -", "PS req CRIT -", "FG req CRIT -"]),
            ("]", ["PS sep bnd -"]),
        ],
    )


def test_bfcl_any_arrays_and_numeric_enums():
    prefix = '[{"name": "find", "arguments": {"limit": 1, "where": {"city": "x"}, '
    parser = advance_characters(JsonSchemaParser(function_call_schema(TOOLS)), prefix)
    cases = {
        '"extra": true': ["PS opt bnd -", "SB opt CRIT -"],  # true / false / null: a closed set
        '"extra": 12': ["PS opt bnd -", "FG opt bnd -"],
        '"extra": "t"': ["PS opt bnd -", "FG opt bnd -"],
        '"levels": [2': ["PS opt bnd -", "SB opt CRIT -"],  # numeric enum items; the list itself is scaffold
    }
    for text, shorts in cases.items():
        assert token_tags(parser, text)[1] == canonical(["PS sep bnd -", *shorts]), text
    # a BFCL-any value may be a closed-set literal, so after the colon the frontier looks critical
    assert token_tags(parser, '"extra":')[1][-1].next == "lookahead_critical"


def test_arguments_before_name_keep_every_tool_as_a_candidate():
    parser = advance_characters(JsonSchemaParser(function_call_schema(TOOLS)), '[{"arguments": {')
    _, tags = token_tags(parser, '"')
    assert tags == (tag("PS sep bnd -"),)
    parser = advance_characters(parser, '"')
    _, tags = token_tags(parser, "l")  # only find has keys starting with l: limit (required), limit_kind
    assert tags == (tag("PS req bnd -"), tag("PS opt bnd -"))
    _, tags = token_tags(parser, "u")  # fetch.url is required
    assert tags == (tag("PS req bnd -"),)


def test_plain_schema_without_call_objects_uses_the_outer_object():
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
        "required": ["answer"],
    }
    expect(
        schema,
        [
            ('{"answer": "4', ["PS sep bnd LA", "PS req bnd LA", "PS req CRIT LA", "FG req CRIT LA"]),
            (
                '2", "confidence": 0.5}',
                ["FG req CRIT -", "PS req CRIT -", "PS sep bnd -", "PS opt bnd -", "FG opt bnd -"],
            ),
        ],
    )


def test_forbidden_token_is_unresolved_and_stays_so():
    parser = JsonSchemaParser(function_call_schema(TOOLS))
    parser, tags = token_tags(parser, '{"')  # the output is a list
    assert tags == () and isinstance(parser, ForceStopParser)
    assert token_tags(parser, "[")[1] == ()


def test_empty_token_continues_the_string_it_is_inside():
    parser = advance_characters(
        JsonSchemaParser(function_call_schema(TOOLS)), '[{"name": "fetch", "arguments": {"url": "'
    )
    after, tags = token_tags(parser, "")
    assert tags == (tag("FG req CRIT LA"),) and after is parser
    outside = advance_characters(JsonSchemaParser(function_call_schema(TOOLS)), "[")
    assert token_tags(outside, "")[1] == ()


@pytest.mark.parametrize(
    "text",
    [
        '[{"name": "find", "arguments": {"limit": 12, "limit_kind": "hard", "query": "a b", "extra": [1, {"k": null}],'
        ' "levels": [1, 2], "where": {"city": "Oslo"}}}, {"name": "fetch", "arguments": {"url": "u\\n"}}]',
        '[ {"arguments": {"url": "x"}, "name": "fetch"} ]',
    ],
)
def test_lookahead_equals_brute_force_over_every_next_character(text):
    """``next`` checks one representative character per stack entry; brute force classifies every character."""
    parser = JsonSchemaParser(function_call_schema(TOOLS))
    for character in text:
        parser, tags = token_tags(parser, character)
        accepted = [c for c in parser.get_allowed_characters() if c not in WHITESPACE_CHARACTERS]
        critical = any(state == "critical" for c in accepted for _, _, state in json_tags._character_triples(parser, c))
        assert tags[0].next == ("lookahead_critical" if critical else "no_lookahead"), character
