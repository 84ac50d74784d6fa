"""The xgrammar engine for function calls (`XgrammarJsonAdapter`, ``StructuralLogitsProcessor(engine=...)``): its tags
are the lm-format-enforcer engine's, its masks differ from them only in the documented ways (each tested on its own
and, over every prefix of the golden outputs, every differing token falls in one of them), batches, crop /
rollback, ``generate_calls`` and the engine resolution."""

import json
import random
import re
import sys
from dataclasses import dataclass, field, replace

import pytest
import torch
from test_structure_golden import CASES, GOLDEN_DIR, RESTAURANTS, STOCK, TRIANGLE, WEATHER, tag_keys
from test_structure_processor import ids_of, run_rows

from hf_structkv.models import tiny_model
from hf_structkv.policy import PolicyTable
from hf_structkv.structure.adapter import unpack_token_bitmask
from hf_structkv.structure.function_calls import function_call_schema
from hf_structkv.structure.lmfe import JsonSchemaAdapter, tokenizer_data
from hf_structkv.structure.processor import ENGINES, StructuralLogitsProcessor, resolve_engine
from hf_structkv.structure.xgrammar_json import XgrammarJsonAdapter, tagging_alphabet
from hf_structkv.structure.xgrammar_matching import split_utf8, xgrammar_compiler
from hf_structkv.structured_generation import generate_calls

WS = " \t\n\r"
TRIP = {
    "name": "plan_trip",
    "parameters": {
        "type": "dict",
        "properties": {
            "stops": {
                "type": "array",
                "items": {
                    "type": "dict",
                    "properties": {"city": {"type": "string"}, "nights": {"type": "integer"}},
                    "required": ["city"],
                },
            },
            "budget": {"type": "any"},
            "seat_class": {"type": "integer", "enum": [1, 2]},
            "refundable": {"type": "boolean"},
        },
        "required": ["stops"],
    },
}
NOTE = {
    "name": "note",
    "parameters": {
        "type": "dict",
        "properties": {"text": {"type": "string"}, "labels": {"type": "array", "items": {"type": "string"}}},
        "required": [],
    },
}
EXTRA_CASES = {
    "nested_any": (
        [TRIP, WEATHER],
        '[{"name": "plan_trip", "arguments": {"stops": [{"city": "Fès", "nights": 3}, {"city": "Oslo"}], '
        '"budget": -1.5e3, "seat_class": 2, "refundable": false}}]',
    ),
    "escapes_optional": (
        [NOTE],
        '[{"name": "note", "arguments": {"text": "tab\\there \\u00e9 \\"q\\" \\\\ end", "labels": []}},'
        '{"name":"note","arguments":{}}]',
    ),
}
ALL_CASES = {**CASES, **EXTRA_CASES}


@pytest.fixture(scope="module")
def token_bytes(tokenizer):
    return xgrammar_compiler(tokenizer)[1]


def token_id(token_bytes, data: bytes) -> int:
    return token_bytes.index(data)


# ------------------------------------------------------------------------------------------------------------- tags
@pytest.mark.parametrize("case", sorted(ALL_CASES))
def test_tags_equal_the_lmfe_engines_token_for_token(tokenizer, case):
    """The golden outputs (whose tags are on file) and two more schemas: nested objects in arrays, BFCL any, enum
    integers, booleans, escapes, an empty argument object, calls without spaces."""
    tools, text = ALL_CASES[case]
    schema = function_call_schema(tools)
    lmfe, xgr = (
        JsonSchemaAdapter(tokenizer, schema).new_sequence(),
        XgrammarJsonAdapter(tokenizer, schema).new_sequence(),
    )
    vocab = len(tokenizer)
    rows = []
    for token in ids_of(tokenizer, text):
        assert lmfe.allowed_token_mask(vocab)[token] and xgr.allowed_token_mask(vocab)[token]
        rows.append((lmfe.advance(token), xgr.advance(token)))
    assert all(xgr_tags == lmfe_tags and xgr_tags for lmfe_tags, xgr_tags in rows)
    assert lmfe.is_complete() and xgr.is_complete()
    if case in CASES:
        golden = json.loads((GOLDEN_DIR / f"{case}.json").read_text())
        assert [tag_keys(tags) for _, tags in rows] == [row["tags"] for row in golden["tokens"]]


def test_tagging_alphabet_is_the_single_character_tokens(tokenizer):
    """lm-format-enforcer's rule on xgrammar's bytes: one character fewer than lm-format-enforcer reads for Qwen2."""
    ours = tagging_alphabet(tokenizer)
    theirs = tokenizer_data(tokenizer, [tokenizer.eos_token_id]).tokenizer_alphabet
    assert len(set(ours)) == len(ours) and set(theirs) - set(ours) == {"\u17d2"} and set(ours) <= set(theirs)
    assert ours.startswith(theirs[:94])  # same order: printable ASCII first, as token ids go


def test_more_than_twenty_calls_stay_tagged(tokenizer, token_bytes):
    """lm-format-enforcer caps arrays without maxItems at 20 items; xgrammar and our walk do not."""
    call = '{"name": "get_stock_price", "arguments": {"ticker": "AAPL"}}'
    text = "[" + ", ".join([call] * 21)
    before = text[: -len(call) - 2]  # the 20th call closed
    schema = function_call_schema([STOCK])
    comma = token_id(token_bytes, b",")
    for adapter, allowed in ((JsonSchemaAdapter, False), (XgrammarJsonAdapter, True)):
        sequence = adapter(tokenizer, schema).new_sequence()
        for token in ids_of(tokenizer, before):
            sequence.advance(token)
        assert bool(sequence.allowed_token_mask(len(tokenizer))[comma]) is allowed
    xgr = XgrammarJsonAdapter(tokenizer, schema).new_sequence()
    assert all(xgr.advance(token) for token in ids_of(tokenizer, text + "]")) and xgr.is_complete()


# ------------------------------------------------------------------------------------------------------------ masks
@dataclass
class Scan:
    """A small JSON lexer's state after some text: containers open, inside a string (a key?), its content so far,
    the last character outside strings; ``control_in_string`` and ``closed_at`` describe the text fed last."""

    stack: list = field(default_factory=list)
    in_string: bool = False
    escaped: bool = False
    key: bool = False
    content: str = ""
    last: str = ""
    control_in_string: bool = False
    closed_at: tuple = ()


def scan(state: Scan, text: str) -> Scan:
    state = replace(state, stack=list(state.stack), control_in_string=False, closed_at=())
    closed = []
    for index, c in enumerate(text):
        if state.in_string:
            state.control_in_string |= ord(c) < 0x20
            if state.escaped:
                state.escaped = False
            elif c == "\\":
                state.escaped = True
            elif c == '"':
                state.in_string, state.last = False, '"'
                closed.append(index)
            else:
                state.content += c
        elif c == '"':
            state.in_string, state.content = True, ""
            state.key = bool(state.stack) and state.stack[-1] == "{" and state.last in "{,"
        elif c not in WS:
            if c in "[{":
                state.stack.append(c)
            elif c in "]}" and state.stack:
                state.stack.pop()
            state.last = c
    state.closed_at = tuple(closed)
    return state


def position_kind(state: Scan, started: bool) -> str:
    if not started:
        return "start"
    if state.in_string:
        return "key" if state.key else "string"
    if not state.stack:
        return "end"
    if state.last in "0123456789.eE-+":
        return "number"
    if state.last in "{,":
        return "key_or_close" if state.stack[-1] == "{" else "value"
    return "value" if state.last in ":[" else "after_value"


def valid_utf8_prefix(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        return err.reason == "unexpected end of data"
    return True


def property_names(schema) -> set[str]:
    if isinstance(schema, dict):
        names = set(schema.get("properties", {}))
        return names.union(*(property_names(value) for value in schema.values()))
    if isinstance(schema, list):
        return set().union(*(property_names(value) for value in schema))
    return set()


def lmfe_only_difference(state: Scan, kind: str, text: str, data: bytes, prefix: bytes, names: set[str]) -> str:
    """Which documented difference makes lm-format-enforcer allow a token xgrammar forbids ('' when none)."""
    after = scan(state, text)
    if (kind == "start" and text[:1] in WS) or (kind == "end" and not text.strip(WS)):
        return "whitespace outside the output"
    if kind == "after_value" and set(text) <= set(WS + "]}") and text[-1] in WS and not after.stack:
        return "whitespace after the output"
    typed = (state.content if kind == "key" else "") + (text if kind == "key" else text.lstrip(WS)[1:])
    if kind in ("key", "key_or_close") and any(name.startswith(typed.split('"')[0]) for name in names):
        return "properties in any order"
    if kind == "key_or_close" and state.last == "," and text.lstrip(WS).startswith("}"):
        return "comma before }"
    if after.control_in_string:
        return "control character in a string"
    if kind == "number" and re.match(r"\.?[eE]", text):
        return "exponent on an integer, or after a bare decimal point"
    if not valid_utf8_prefix(prefix + data):
        return "bytes that cannot continue UTF-8"
    return ""


def xgrammar_only_difference(state: Scan, kind: str, text: str) -> str:
    """Which documented difference makes xgrammar allow a token lm-format-enforcer forbids ('' when none)."""
    if kind in ("string", "key"):
        if "\\" in text:
            return "a backslash in a longer token (lm-format-enforcer's free-string table)"
        closed = scan(state, text).closed_at
        if closed and closed[0] < len(text) - 1:
            return "string characters, the closing quote and more in one token (lm-format-enforcer's free-string table)"
    return ""


@pytest.mark.parametrize("case", sorted(ALL_CASES))
def test_masks_differ_only_in_the_documented_ways(tokenizer, token_bytes, case):
    """At every prefix of the output the two engines' masks are compared; each token only one allows must be a
    documented difference (`hf_structkv.structure.xgrammar_json`), and the differences are counted: where none
    applies (most structural positions) the masks are equal."""
    tools, text = ALL_CASES[case]
    schema = function_call_schema(tools)
    names = property_names(schema)
    lmfe, xgr = (
        JsonSchemaAdapter(tokenizer, schema).new_sequence(),
        XgrammarJsonAdapter(tokenizer, schema).new_sequence(),
    )
    vocab, state, prefix, pending, equal = len(tokenizer), Scan(), b"", b"", 0
    tokens = ids_of(tokenizer, text)
    for step in range(len(tokens) + 1):
        lmfe_mask, xgr_mask = lmfe.allowed_token_mask(vocab), xgr.allowed_token_mask(vocab)
        kind = position_kind(state, step > 0)
        for token in (lmfe_mask & ~xgr_mask).nonzero().flatten().tolist():
            data = token_bytes[token]
            why = lmfe_only_difference(state, kind, data.decode("utf-8", "replace"), data, prefix, names)
            assert why, f"{case}: after {prefix[-30:]!r} ({kind}) only lm-format-enforcer allows {data!r}"
        for token in (xgr_mask & ~lmfe_mask).nonzero().flatten().tolist():
            data = token_bytes[token]
            why = xgrammar_only_difference(state, kind, data.decode("utf-8", "replace"))
            assert why, f"{case}: after {prefix[-30:]!r} ({kind}) only xgrammar allows {data!r}"
        equal += torch.equal(lmfe_mask, xgr_mask)
        if step < len(tokens):
            lmfe.advance(tokens[step])
            xgr.advance(tokens[step])
            prefix += token_bytes[tokens[step]]
            completed, pending = split_utf8(pending + token_bytes[tokens[step]])
            state = scan(state, completed)
    assert equal >= len(tokens) // 4, f"{case}: equal masks at only {equal} of {len(tokens) + 1} prefixes"


TRIANGLE_CALL = '[{"name": "calculate_triangle_area", "arguments": {"base": 10'
DIFFERENCES = [
    # (tools, prefix, token bytes, lm-format-enforcer allows, xgrammar allows)
    ([TRIANGLE], "", b" [", True, False),  # whitespace before the output
    ([TRIANGLE], TRIANGLE_CALL + ', "height": 5}}]', b"\n", True, False),  # whitespace after it
    ([TRIANGLE], '[{"', b"arguments", True, False),  # properties in any order (xgrammar: the schema's)
    ([TRIANGLE], TRIANGLE_CALL + ', "height": 5,', b" }", True, False),  # a comma before }
    ([TRIANGLE], TRIANGLE_CALL + ', "height": 5, "unit":', b'"\n', True, False),  # a newline inside a string
    ([TRIANGLE], TRIANGLE_CALL, b"e", True, False),  # an exponent on an integer
    (
        [RESTAURANTS],
        '[{"name": "search_restaurants", "arguments": {"location": "Rome", "max_price": 25',
        b".e",
        True,
        False,
    ),
    ([TRIANGLE], TRIANGLE_CALL + ', "height": 5, "unit": "', b"\x80", True, False),  # not a UTF-8 start byte
    ([TRIANGLE], TRIANGLE_CALL + ', "height": 5, "unit": "cm', b'."\n', False, True),  # close the string and go on
    ([TRIANGLE], TRIANGLE_CALL + ', "height": 5, "unit": "', b"\\u", False, True),  # a backslash in a longer token
    ([TRIANGLE], TRIANGLE_CALL + ', "height": 5', b",", True, True),  # the same elsewhere
    ([TRIANGLE], TRIANGLE_CALL + ', "height": 5, "unit": "cm"}}', b"]", True, True),
]


@pytest.mark.parametrize(("tools", "prefix", "data", "lmfe_allows", "xgrammar_allows"), DIFFERENCES)
def test_each_documented_difference(tokenizer, token_bytes, tools, prefix, data, lmfe_allows, xgrammar_allows):
    schema = function_call_schema(tools)
    token = token_id(token_bytes, data)
    for adapter, allows in ((JsonSchemaAdapter, lmfe_allows), (XgrammarJsonAdapter, xgrammar_allows)):
        sequence = adapter(tokenizer, schema).new_sequence()
        for t in ids_of(tokenizer, prefix):
            assert sequence.allowed_token_mask(len(tokenizer))[t], (adapter.__name__, prefix)
            sequence.advance(t)
        assert bool(sequence.allowed_token_mask(len(tokenizer))[token]) is allows, adapter.__name__


def test_every_token_xgrammar_allows_is_tagged(tokenizer, token_bytes):
    """Our walk follows xgrammar: at every prefix of the outputs, sampled tokens the mask allows all get tags
    (tokens holding a character outside the tagging alphabet excepted: the documented limitation)."""
    alphabet = set(tagging_alphabet(tokenizer)) | set(WS)
    rng = random.Random(0)
    checked = 0
    for tools, text in ALL_CASES.values():
        sequence = XgrammarJsonAdapter(tokenizer, function_call_schema(tools)).new_sequence()
        pending = b""
        for token in [*ids_of(tokenizer, text), None]:
            allowed = sequence.allowed_token_mask(len(tokenizer)).nonzero().flatten().tolist()
            for candidate in rng.sample(allowed, min(len(allowed), 40)):
                if (
                    candidate == tokenizer.eos_token_id
                    or not set(split_utf8(pending + token_bytes[candidate])[0]) <= alphabet
                ):
                    continue
                assert sequence.advance(candidate), token_bytes[candidate]
                sequence.rollback(1)
                checked += 1
            if token is not None:
                sequence.advance(token)
                pending = split_utf8(pending + token_bytes[token])[1]
    assert checked > 5000


# ---------------------------------------------------------------------------------------- batches, crop, rollback
def test_batch_of_two_calling_different_tools(tokenizer):
    """Two rows of one batch call different tools: each row's masks are a fresh sequence's, its tags the lmfe
    engine's."""
    tools = [WEATHER, RESTAURANTS, STOCK]
    texts = [
        '[{"name": "search_restaurants", "arguments": {"location": "Lyon", "open_now": true}}]',
        '[{"name": "get_stock_price", "arguments": {"ticker": "SAP", "exchange": "NYSE"}}]',
    ]
    rows = [ids_of(tokenizer, text) for text in texts]
    proc = StructuralLogitsProcessor(tokenizer, tools=tools, engine="xgrammar")
    masks = run_rows(proc, torch.tensor([[5, 6], [7, 8]]), rows, len(tokenizer), tokenizer.pad_token_id)
    schema = function_call_schema(tools)
    for row, tokens in enumerate(rows):
        xgr, lmfe = (
            XgrammarJsonAdapter(tokenizer, schema).new_sequence(),
            JsonSchemaAdapter(tokenizer, schema).new_sequence(),
        )
        for step, token in enumerate(tokens):
            assert torch.equal(masks[step][row], xgr.allowed_token_mask(len(tokenizer))), (row, step)
            xgr.advance(token)
        assert proc.tags(row)[: len(tokens)] == [lmfe.advance(token) for token in tokens]


def test_rollback_restores_the_exact_mask_and_tags(tokenizer, token_bytes):
    tools, text = ALL_CASES["parallel_multiple"]
    sequence = XgrammarJsonAdapter(tokenizer, function_call_schema(tools)).new_sequence()
    tokens = ids_of(tokenizer, text)
    masks, tags = [], []
    for token in tokens:
        masks.append(sequence.allowed_token_mask(len(tokenizer)))
        tags.append(sequence.advance(token))
    for keep in (len(tokens) - 1, 40, 17, 0):
        sequence.rollback(sequence.num_tokens - keep)
        assert sequence.num_tokens == keep and torch.equal(sequence.allowed_token_mask(len(tokenizer)), masks[keep])
        assert [sequence.advance(token) for token in tokens[keep:]] == tags[keep:]
        assert sequence.is_complete()
    forbidden = token_id(token_bytes, b"{")  # after the closing bracket
    assert not sequence.allowed_token_mask(len(tokenizer))[forbidden]
    assert sequence.advance(forbidden) == () and not sequence.is_complete()
    assert sequence.allowed_token_mask(len(tokenizer)).nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    sequence.rollback(3)  # the rejected token and two accepted ones
    assert torch.equal(sequence.allowed_token_mask(len(tokenizer)), masks[-2])
    with pytest.raises(ValueError, match="num_tokens"):
        sequence.rollback(len(tokens))


def test_crop_through_the_processor_rolls_the_matcher_back(tokenizer):
    tools, text = ALL_CASES["parallel"]
    tokens = ids_of(tokenizer, text)
    prompt = torch.tensor([[3, 4]])
    proc = StructuralLogitsProcessor(tokenizer, tools=tools, engine="xgrammar")
    fresh = run_rows(
        StructuralLogitsProcessor(tokenizer, tools=tools, engine="xgrammar"), prompt, [tokens], len(tokenizer), 0
    )
    run_rows(proc, prompt, [tokens], len(tokenizer), 0)
    cropped = proc(torch.cat([prompt, torch.tensor([tokens[:12]])], 1), torch.zeros(1, len(tokenizer)))
    assert torch.equal(torch.isfinite(cropped), fresh[12]) and proc.num_tagged(0) == 12
    grown = proc(torch.cat([prompt, torch.tensor([tokens])], 1), torch.zeros(1, len(tokenizer)))
    assert torch.equal(torch.isfinite(grown), fresh[-1])


@pytest.mark.parametrize("limit", [0, 1, 5])
def test_bounded_rollback_keeps_masks_and_tags_and_refuses_to_reach_further(tokenizer, limit):
    # max_rollback_tokens=k: along the whole output the masks and tags are the unbounded sequence's; rolling back
    # up to k tokens restores them exactly (at any point, the end included), one more is refused naming the option
    tools, text = ALL_CASES["parallel_multiple"]
    schema = function_call_schema(tools)
    unbounded = XgrammarJsonAdapter(tokenizer, schema).new_sequence()
    bounded = XgrammarJsonAdapter(tokenizer, schema, max_rollback_tokens=limit).new_sequence()
    tokens = ids_of(tokenizer, text)
    masks, tags = [], []
    for step, token in enumerate(tokens):
        masks.append(unbounded.allowed_token_mask(len(tokenizer)))
        assert torch.equal(bounded.allowed_token_mask(len(tokenizer)), masks[-1])
        tags.append(unbounded.advance(token))
        assert bounded.advance(token) == tags[-1] and bounded.num_tokens == step + 1
        if step in (limit, len(tokens) // 2) and limit:
            bounded.rollback(limit)
            assert torch.equal(bounded.allowed_token_mask(len(tokenizer)), masks[step + 1 - limit])
            assert [bounded.advance(t) for t in tokens[step + 1 - limit : step + 1]] == tags[step + 1 - limit :]
    assert bounded.is_complete()
    masks.append(unbounded.allowed_token_mask(len(tokenizer)))  # after the last token
    with pytest.raises(ValueError, match=f"max_rollback_tokens={limit} only"):
        bounded.rollback(limit + 1)
    bounded.rollback(limit)
    assert bounded.num_tokens == len(tokens) - limit
    assert torch.equal(bounded.allowed_token_mask(len(tokenizer)), masks[len(tokens) - limit])


def test_max_rollback_tokens_through_the_processor(tokenizer):
    tools, text = ALL_CASES["parallel"]
    tokens = ids_of(tokenizer, text)
    prompt = torch.tensor([[3, 4]])
    fresh = run_rows(
        StructuralLogitsProcessor(tokenizer, tools=tools, engine="xgrammar"), prompt, [tokens], len(tokenizer), 0
    )
    proc = StructuralLogitsProcessor(tokenizer, tools=tools, engine="xgrammar", max_rollback_tokens=4)
    assert [torch.equal(a, b) for a, b in zip(run_rows(proc, prompt, [tokens], len(tokenizer), 0), fresh)] == [
        True
    ] * len(fresh)
    cropped = proc(torch.cat([prompt, torch.tensor([tokens[:-4]])], 1), torch.zeros(1, len(tokenizer)))
    assert torch.equal(torch.isfinite(cropped), fresh[len(tokens) - 4])
    with pytest.raises(ValueError, match="max_rollback_tokens=4 only"):
        proc(torch.cat([prompt, torch.tensor([tokens[:-9]])], 1), torch.zeros(1, len(tokenizer)))
    with pytest.raises(ValueError, match='use engine="xgrammar"'):
        StructuralLogitsProcessor(tokenizer, tools=tools, engine="lmfe", max_rollback_tokens=4)
    with pytest.raises(ValueError, match="max_rollback_tokens must be"):
        StructuralLogitsProcessor(tokenizer, tools=tools, engine="xgrammar", max_rollback_tokens=-1)


# --------------------------------------------------------------------------------------------- generate, engines
def test_generate_calls_with_xgrammar_gives_valid_calls_on_a_tiny_model(tokenizer, token_bytes):
    """A random tiny model with the real vocabulary (whitespace tokens suppressed so that it finishes) answers a
    batch of two under the xgrammar engine: complete calls to the tools, every generated token tagged."""
    model = tiny_model("qwen2", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    tools = [
        {
            "name": "ping",
            "parameters": {
                "type": "dict",
                "properties": {"host": {"type": "string", "enum": ["alpha", "beta"]}},
                "required": ["host"],
            },
        },
        {"name": "stop", "parameters": {"type": "dict", "properties": {}}},
    ]
    spaced = [i for i, data in enumerate(token_bytes) if any(c in data for c in WS.encode())]
    result = generate_calls(
        model,
        tokenizer,
        ["Ping alpha", "Stop now please"],
        tools,
        PolicyTable.all_high(model.config),
        max_new_tokens=80,
        engine="xgrammar",
        suppress_tokens=spaced,
        eos_token_id=tokenizer.eos_token_id,
    )
    assert result.processor.engine == "xgrammar" and isinstance(result.processor.adapter, XgrammarJsonAdapter)
    for row, calls in enumerate(result.calls):
        assert calls, result.texts[row]
        for call in calls:
            assert call == {"name": "stop", "arguments": {}} or (
                call["name"] == "ping" and call["arguments"] in ({"host": "alpha"}, {"host": "beta"})
            )
        tags = result.processor.tags(row)
        stop = tags.index(None) if None in tags else len(tags)
        assert all(tags[:stop]) and stop > 10


def test_engine_resolution(tokenizer, monkeypatch):
    assert ENGINES == ("auto", "xgrammar", "lmfe")
    assert resolve_engine("auto") == "xgrammar" and resolve_engine("lmfe") == "lmfe"
    proc = StructuralLogitsProcessor(tokenizer, tools=[STOCK])
    assert proc.engine == "xgrammar" and isinstance(proc.adapter, XgrammarJsonAdapter)
    assert isinstance(StructuralLogitsProcessor(tokenizer, tools=[STOCK], engine="lmfe").adapter, JsonSchemaAdapter)
    with pytest.raises(ValueError, match=r"engine must be one of \('auto', 'xgrammar', 'lmfe'\), got 'outlines'"):
        StructuralLogitsProcessor(tokenizer, tools=[STOCK], engine="outlines")
    with pytest.raises(ValueError, match="engine must be one of"):
        generate_calls(None, tokenizer, "q", [STOCK], PolicyTable.all_high(tiny_model("qwen2").config), engine="x")
    with pytest.raises(ValueError, match="an adapter is its own engine"):
        StructuralLogitsProcessor(None, adapter=JsonSchemaAdapter(tokenizer, {"type": "object"}), engine="lmfe")
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # as if xgrammar were not installed
    assert resolve_engine("auto") == "lmfe"
    proc = StructuralLogitsProcessor(tokenizer, tools=[STOCK])
    assert proc.engine == "lmfe" and isinstance(proc.adapter, JsonSchemaAdapter)
    with pytest.raises(ImportError, match='pass engine="lmfe"'):
        StructuralLogitsProcessor(tokenizer, tools=[STOCK], engine="xgrammar")


def test_bad_schemas_are_named(tokenizer):
    with pytest.raises(TypeError, match="schema must be a dict"):
        XgrammarJsonAdapter(tokenizer, "[]")
    with pytest.raises(ValueError, match="schema must be JSON"):
        XgrammarJsonAdapter(tokenizer, {"type": "object", "default": object()})
    with pytest.raises(ValueError, match="cannot parse schema"):
        XgrammarJsonAdapter(tokenizer, {"type": "no-such-type"})
    with pytest.raises(TypeError, match="tokenizer must be"):
        XgrammarJsonAdapter(None, {"type": "object"})


def test_unpack_token_bitmask_against_the_bits():
    words = torch.randint(-(2**31), 2**31 - 1, (7,), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    brute = [bool((int(words[i // 32]) >> (i % 32)) & 1) for i in range(7 * 32)]
    assert unpack_token_bitmask(words, 7 * 32).tolist() == brute
    assert unpack_token_bitmask(words, 200).tolist() == brute[:200]
    assert unpack_token_bitmask(words, 230).tolist() == brute + [False] * 6
