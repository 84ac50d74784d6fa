"""StructuralLogitsProcessor: exact lm-format-enforcer masks, per-row tags, rewinds, generate() integration, with
either masking engine where the behaviour is the engine's contract (xgrammar's own: tests/test_xgrammar_engine.py)."""

import json

import pytest
import torch
from lmformatenforcer import JsonSchemaParser
from test_structure_golden import CASES, RESTAURANTS, STOCK, WEATHER
from transformers import LogitsProcessorList

from hf_structkv.models import tiny_model
from hf_structkv.structure.adapter import GrammarAdapter, GrammarSequence
from hf_structkv.structure.function_calls import function_call_schema
from hf_structkv.structure.lmfe import JsonSchemaAdapter, _transformers_integration
from hf_structkv.structure.processor import StructuralLogitsProcessor
from hf_structkv.structure.tags import StructuralTag, position_tag, view_tags
from hf_structkv.structure.xgrammar_json import XgrammarJsonAdapter

ENGINE_ADAPTERS = {"lmfe": JsonSchemaAdapter, "xgrammar": XgrammarJsonAdapter}

TOOLS = [WEATHER, RESTAURANTS, STOCK]
CALL_A = '[{"name": "get_weather", "arguments": {"location": "Oslo", "unit": "celsius"}}]'
CALL_B = (
    '[{"name": "get_stock_price", "arguments": {"ticker": "IBM"}}, '
    '{"name": "get_weather", "arguments": {"location": "Rome"}}]'
)


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def run_rows(proc, prompt: torch.Tensor, rows: list[list[int]], vocab: int, pad: int) -> list[torch.Tensor]:
    """Call ``proc`` as generate does: one call per step, generated tokens appended (``pad`` after a row's end).
    Returns the allowed mask ``[batch, vocab]`` of every call."""
    length = max(len(r) for r in rows)
    generated = torch.tensor([r + [pad] * (length - len(r)) for r in rows])
    masks = []
    for step in range(length + 1):
        input_ids = torch.cat([prompt, generated[:, :step]], dim=1)
        masks.append(torch.isfinite(proc(input_ids, torch.zeros(len(rows), vocab))))
    return masks


def single_row_tags(tokenizer, tokens: list[int]) -> list:
    sequence = JsonSchemaAdapter(tokenizer, function_call_schema(TOOLS)).new_sequence()
    return [sequence.advance(t) for t in tokens]


@pytest.fixture(scope="module")
def list_tokenizer_data(tokenizer):
    """lm-format-enforcer's own tables in its list representation (the adapter uses bitmasks)."""
    return _transformers_integration().build_token_enforcer_tokenizer_data(tokenizer, use_bitmask=False)


@pytest.mark.parametrize("case", sorted(CASES))
def test_masks_equal_lm_format_enforcers_own_allowed_tokens(tokenizer, list_tokenizer_data, case):
    """At every step the processor allows exactly the token ids lm-format-enforcer's transformers integration
    returns (its list representation, fed prompt + generated ids as in its own generate path)."""
    tools, text = CASES[case]
    schema = function_call_schema(tools)
    integration = _transformers_integration()
    reference = integration.build_transformers_prefix_allowed_tokens_fn(list_tokenizer_data, JsonSchemaParser(schema))
    proc = StructuralLogitsProcessor(tokenizer, tools=tools, engine="lmfe")
    prompt = torch.tensor([ids_of(tokenizer, "Call the tools.")])
    tokens = ids_of(tokenizer, text)
    masks = run_rows(proc, prompt, [tokens], len(tokenizer), tokenizer.pad_token_id)
    for step, mask in enumerate(masks):
        sent = torch.cat([prompt[0], torch.tensor(tokens[:step], dtype=torch.long)])
        expected = sorted(set(reference(0, sent)))
        assert mask[0].nonzero().flatten().tolist() == expected, f"step {step}"
    assert tokenizer.eos_token_id in masks[-1][0].nonzero().flatten().tolist()  # complete: may stop


@pytest.mark.parametrize("engine", sorted(ENGINE_ADAPTERS))
def test_batch_rows_are_independent_and_stop_tokens_are_free(tokenizer, engine):
    tokens_a, tokens_b = ids_of(tokenizer, CALL_A), ids_of(tokenizer, CALL_B)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    prompt = torch.tensor([[pad, pad, 11, 12], [21, 22, 23, 24]])  # left padding: one prompt length
    proc = StructuralLogitsProcessor(tokenizer, tools=TOOLS, engine=engine)
    assert isinstance(proc.adapter, ENGINE_ADAPTERS[engine]) and proc.engine == engine
    masks = run_rows(proc, prompt, [tokens_a + [eos], tokens_b], len(tokenizer), pad)
    assert proc.family == "function_calling"
    assert proc.tags(0) == single_row_tags(tokenizer, tokens_a) + [None] * (len(tokens_b) - len(tokens_a))
    assert proc.tags(1) == single_row_tags(tokenizer, tokens_b)
    assert proc.num_tagged(1) == len(tokens_b) and proc.tag_at(1, 0) == proc.tags(1)[0]
    finished = len(tokens_a) + 1
    assert masks[finished][0].all()  # a finished row is left to generate's padding
    assert not masks[finished][1].all()


@pytest.mark.parametrize("engine", sorted(ENGINE_ADAPTERS))
def test_rewind_to_a_shorter_input_equals_a_fresh_run(tokenizer, engine):
    tokens = ids_of(tokenizer, CALL_B)
    other = ids_of(tokenizer, '[{"name": "get_weather", "arguments": {"location": "Lima"}}]')
    common = next(i for i, (x, y) in enumerate(zip(tokens, other)) if x != y)
    prompt = torch.tensor([ids_of(tokenizer, "Q")])
    proc = StructuralLogitsProcessor(tokenizer, tools=TOOLS, engine=engine)
    run_rows(proc, prompt, [tokens[:20]], len(tokenizer), tokenizer.pad_token_id)
    proc(torch.cat([prompt, torch.tensor([tokens[:30]])], 1), torch.zeros(1, len(tokenizer)))  # extend by 10
    short = proc(torch.cat([prompt, torch.tensor([tokens[: common + 2]])], 1), torch.zeros(1, len(tokenizer)))
    assert proc.tags(0) == single_row_tags(tokenizer, tokens[: common + 2])
    rewound = proc(torch.cat([prompt, torch.tensor([other[:common]])], 1), torch.zeros(1, len(tokenizer)))
    grown = proc(torch.cat([prompt, torch.tensor([other])], 1), torch.zeros(1, len(tokenizer)))
    assert proc.tags(0) == single_row_tags(tokenizer, other)
    fresh = StructuralLogitsProcessor(tokenizer, tools=TOOLS, engine=engine)
    fresh_masks = run_rows(fresh, prompt, [other], len(tokenizer), tokenizer.pad_token_id)
    assert torch.equal(torch.isfinite(rewound), fresh_masks[common]) and torch.equal(
        torch.isfinite(grown), fresh_masks[-1]
    )
    assert not torch.equal(torch.isfinite(short), fresh_masks[common])  # different prefixes, different masks


@pytest.mark.parametrize("engine", sorted(ENGINE_ADAPTERS))
def test_reset_and_bad_inputs(tokenizer, engine):
    with pytest.raises(ValueError, match="exactly one of"):
        StructuralLogitsProcessor(tokenizer)
    with pytest.raises(ValueError, match="exactly one of"):
        StructuralLogitsProcessor(tokenizer, tools=TOOLS, schema={"type": "object"})
    with pytest.raises(TypeError, match="tokenizer must be"):
        StructuralLogitsProcessor(None, tools=TOOLS)
    with pytest.raises(TypeError, match="GrammarAdapter"):
        StructuralLogitsProcessor(tokenizer, adapter=object())
    with pytest.raises(ValueError, match="cannot parse schema"):
        StructuralLogitsProcessor(tokenizer, schema={"type": "no-such-type"}, engine=engine)
    with pytest.raises(ValueError, match="eos_token_id must be"):
        StructuralLogitsProcessor(tokenizer, tools=TOOLS, eos_token_id=[])
    adapter = ENGINE_ADAPTERS[engine](tokenizer, function_call_schema(TOOLS), eos_token_id=[1, 2])
    assert adapter.stop_token_ids == frozenset({1, 2})
    with pytest.raises(ValueError, match="brings its own stop tokens"):
        StructuralLogitsProcessor(tokenizer, adapter=adapter, eos_token_id=3)
    proc = StructuralLogitsProcessor(tokenizer, tools=TOOLS, engine=engine)
    vocab = len(tokenizer)
    with pytest.raises(ValueError, match="same batch"):
        proc(torch.zeros(2, 3, dtype=torch.long), torch.zeros(1, vocab))
    proc(torch.tensor([[5, 6]]), torch.zeros(1, vocab))
    with pytest.raises(ValueError, match="reset"):
        proc(torch.tensor([[7, 6]]), torch.zeros(1, vocab))  # another prompt
    with pytest.raises(IndexError, match="batch index"):
        proc.tags(1)
    with pytest.raises(IndexError, match="out of range"):
        proc.tag_at(0, 0)
    proc.reset()
    proc(torch.tensor([[7, 6, 9], [1, 2, 3]]), torch.zeros(2, vocab))
    assert proc.tags(0) == [] and proc.tags(1) == []
    sequence = adapter.new_sequence()
    with pytest.raises(ValueError, match="num_tokens"):
        sequence.rollback(1)


@pytest.mark.parametrize("engine", sorted(ENGINE_ADAPTERS))
def test_a_token_the_grammar_forbids_is_unresolved(tokenizer, engine):
    proc = StructuralLogitsProcessor(tokenizer, tools=TOOLS, engine=engine)
    prompt = torch.tensor([[5]])
    bad = ids_of(tokenizer, '{"name"')  # the output must be a list
    run_rows(proc, prompt, [bad], len(tokenizer), tokenizer.pad_token_id)
    assert proc.tags(0) == [()] * len(bad)


class _CountdownSequence(GrammarSequence):
    """A toy non-JSON grammar: tokens 10, 11, 12 in this order, then stop token 0."""

    def __init__(self):
        self.tokens = []

    @property
    def num_tokens(self):
        return len(self.tokens)

    def allowed_token_mask(self, vocab_size):
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[10 + len(self.tokens) if len(self.tokens) < 3 else 0] = True
        return mask

    def advance(self, token_id):
        self.tokens.append(token_id)
        return (StructuralTag("schema_bearing", "relation", "stable", "no_lookahead"),)

    def rollback(self, num_tokens):
        del self.tokens[len(self.tokens) - num_tokens :]

    def is_complete(self):
        return len(self.tokens) == 3


class _CountdownAdapter(GrammarAdapter):
    family = "sql"
    stop_token_ids = frozenset({0})

    def new_sequence(self):
        return _CountdownSequence()

    def reset(self):
        pass


def test_any_grammar_adapter_plugs_in():
    proc = StructuralLogitsProcessor(None, adapter=_CountdownAdapter())
    assert proc.family == "sql"
    masks = run_rows(proc, torch.tensor([[5, 5]]), [[10, 11, 12, 0]], 16, pad=0)
    assert [int(m[0].nonzero()) for m in masks[:4]] == [10, 11, 12, 0]
    assert proc.tags(0)[:3] == [(StructuralTag("schema_bearing", "relation", "stable", "no_lookahead"),)] * 3
    assert proc.tags(0)[3] is None

    class Unknown(_CountdownAdapter):
        family = "chess"

    with pytest.raises(ValueError, match="family must be one of"):
        StructuralLogitsProcessor(None, adapter=Unknown())


def valid_prefix(tokenizer, tokens: list[int], engine: str) -> bool:
    """Every token allowed by a fresh adapter of ``engine`` at its step."""
    sequence = ENGINE_ADAPTERS[engine](tokenizer, function_call_schema(TOOLS)).new_sequence()
    for token in tokens:
        if not sequence.allowed_token_mask(len(tokenizer))[token]:
            return False
        sequence.advance(token)
    return True


@pytest.mark.parametrize("engine", sorted(ENGINE_ADAPTERS))
@pytest.mark.parametrize("do_sample", [False, True])
def test_generate_with_left_padding_on_a_tiny_model(tokenizer, do_sample, engine):
    """A random tiny model with the real vocabulary: every generated token is grammatical and tagged."""
    model = tiny_model("qwen2", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)
    tokenizer.padding_side = "left"
    batch = tokenizer(
        ["Weather in Oslo?", "Price of IBM stock and weather in Rome, please"], return_tensors="pt", padding=True
    )
    proc = StructuralLogitsProcessor(tokenizer, tools=TOOLS, engine=engine)
    torch.manual_seed(0)
    out = model.generate(
        **batch,
        logits_processor=LogitsProcessorList([proc]),
        max_new_tokens=24,
        do_sample=do_sample,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    generated = out[:, batch.input_ids.shape[1] :].tolist()
    for row, tokens in enumerate(generated):
        assert valid_prefix(tokenizer, tokens, engine)
        tags = proc.tags(row)
        assert len(tags) == len(tokens) - 1  # the last token is never seen by a processor call
        assert all(t for t in tags)  # no unresolved token


def matches_tools(calls, tools) -> bool:
    """A parsed output is a non-empty list of calls to ``tools`` with their required arguments and allowed keys."""
    by_name = {tool["name"]: tool["parameters"] for tool in tools}
    if not isinstance(calls, list) or not calls:
        return False
    for call in calls:
        if set(call) != {"name", "arguments"} or call["name"] not in by_name:
            return False
        parameters = by_name[call["name"]]
        if not set(parameters["required"]) <= set(call["arguments"]) <= set(parameters["properties"]):
            return False
    return True


@pytest.mark.slow
def test_embedded_model_answers_a_bfcl_style_question_under_the_schema(default_model):
    model, tokenizer = default_model
    question = "What is the weather like in Paris in celsius, and what is the price of AAPL stock?"
    messages = [
        {"role": "system", "content": 'Answer with a JSON list of function calls [{"name": ..., "arguments": {...}}].'},
        {"role": "user", "content": question},
    ]
    prompt = tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    proc = StructuralLogitsProcessor(tokenizer, tools=TOOLS)
    out = model.generate(
        **prompt,
        logits_processor=LogitsProcessorList([proc]),
        max_new_tokens=80,
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
    )
    tokens = out[0, prompt["input_ids"].shape[1] :].tolist()
    assert tokens[-1] == tokenizer.eos_token_id, "the call did not finish within max_new_tokens"
    calls = json.loads(tokenizer.decode(tokens[:-1]))
    assert matches_tools(calls, TOOLS)
    assert {call["name"] for call in calls} == {"get_weather", "get_stock_price"}
    tags = proc.tags(0)
    assert len(tags) == len(tokens) - 1 and all(tags)
    assert any(t.role == "dispatch_key" for token_tags in tags for t in token_tags)


def test_character_feeding_reaches_the_enforcers_own_parser_state(tokenizer):
    """The adapter splits tokens into characters itself (decoding a bounded window of the current word); its
    parser must stay in the state lm-format-enforcer's TokenEnforcer reaches, also over long multi-byte text."""
    adapter = JsonSchemaAdapter(tokenizer, function_call_schema(TOOLS))
    text = '[{"name": "get_weather", "arguments": {"location": "東京都 神南一丁目 🌧🌧🌧 Zürich ünïcödé ☃ 😀 Ωμέγα"}}]'
    sequence = adapter.new_sequence()
    tokens = ids_of(tokenizer, text)
    assert len(tokens) > 40 and sum(tokenizer.decode([t]).endswith("\ufffd") for t in tokens) > 4  # byte pieces
    for step, token in enumerate(tokens):
        sequence.advance(token)
        sequence.allowed_token_mask(len(tokenizer))  # makes the enforcer compute its state for this prefix
        enforcer_parser = adapter._enforcer.prefix_states[tuple(tokens[: step + 1])].parser
        own_parser = sequence._parsers[-1]
        assert set(own_parser.get_allowed_characters()) == set(enforcer_parser.get_allowed_characters()), step
    assert sequence.is_complete()


def test_a_character_outside_the_engines_alphabet_leaves_tokens_unresolved(tokenizer):
    """lm-format-enforcer 0.11.3 accepts only characters of single-character tokens inside strings; '渋' exists
    only as byte pieces, so its token is allowed (free-text tables) but the engine's parse ends there (only
    whitespace and stop stay allowed). The tags are then unresolved: the policy protects such tokens fully."""
    proc = StructuralLogitsProcessor(tokenizer, tools=TOOLS, engine="lmfe")
    tokens = ids_of(tokenizer, '[{"name": "get_weather", "arguments": {"location": "渋谷')
    masks = run_rows(proc, torch.tensor([[5]]), [tokens], len(tokenizer), tokenizer.pad_token_id)
    tags = proc.tags(0)
    broken = next(i for i, t in enumerate(tags) if not t)
    assert all(tags[:broken]) and not any(tags[broken:])
    assert masks[broken][0, tokens[broken]]  # the engine allowed the token
    assert tokenizer.eos_token_id in masks[broken + 1][0].nonzero().flatten().tolist()


def test_stop_token_ids_default_to_the_tokenizers_eos_and_reject_bad_ids():
    from types import SimpleNamespace

    from hf_structkv.structure.adapter import stop_token_ids

    assert stop_token_ids(SimpleNamespace(eos_token_id=7)) == frozenset({7})
    assert stop_token_ids(SimpleNamespace(eos_token_id=7), [1, 2, 2]) == frozenset({1, 2})
    with pytest.raises(ValueError, match="the tokenizer has no eos_token_id"):
        stop_token_ids(SimpleNamespace(eos_token_id=None))
    for bad in ([], [-1], [True], [1.0]):
        with pytest.raises(ValueError, match="eos_token_id must be a non-negative int"):
            stop_token_ids(SimpleNamespace(eos_token_id=7), bad)


@pytest.mark.parametrize("view", ["no_role", "no_class", "no_state_lookahead"])
def test_tag_view_records_the_viewed_parser_tags(tokenizer, view):
    tokens = ids_of(tokenizer, CALL_B)
    full = single_row_tags(tokenizer, tokens)
    proc = StructuralLogitsProcessor(tokenizer, tools=TOOLS, tag_view=view)
    assert proc.tag_view == view
    run_rows(proc, torch.tensor([[1, 2]]), [tokens], len(tokenizer), pad=tokenizer.pad_token_id)
    assert proc.tags(0)[: len(tokens)] == [view_tags(tags, view, "function_calling") for tags in full]
    assert proc.tags(0) != full  # the view changed something on this call


def test_position_view_tags_tokens_by_their_bin_and_keeps_the_grammars_masks(tokenizer):
    """No parser transitions (C.5): the same masks as full tags (the grammar still decides legality), each generated
    token's one tag its position bin, stop tokens still ``None``; a rollback re-tags by index."""
    tokens = ids_of(tokenizer, CALL_B) + [tokenizer.eos_token_id]
    bins = (4, 10)
    full, positional = (
        StructuralLogitsProcessor(tokenizer, tools=TOOLS, **view)
        for view in ({}, {"tag_view": "position_bins", "position_bins": bins})
    )
    masks = [
        run_rows(p, torch.tensor([[1, 2]]), [tokens], len(tokenizer), tokenizer.pad_token_id)
        for p in (full, positional)
    ]
    assert all(torch.equal(a, b) for a, b in zip(*masks, strict=True))
    want = [(position_tag(i, bins, "function_calling"),) for i in range(len(tokens) - 1)] + [None]
    assert positional.tags(0) == want and positional.position_bins == bins
    assert full.tags(0)[-1] is None and full.tags(0)[:-1] != want[:-1]
    positional(torch.tensor([[1, 2, *tokens[:3]]]), torch.zeros(1, len(tokenizer)))  # a crop back to 3 tokens
    assert positional.tags(0) == want[:3]
    with pytest.raises(ValueError, match="apply to tag_view='position_bins' only"):
        StructuralLogitsProcessor(tokenizer, tools=TOOLS, position_bins=(3,))


def test_unknown_tag_view_is_rejected(tokenizer):
    with pytest.raises(ValueError, match="tag_view must be one of"):
        StructuralLogitsProcessor(tokenizer, tools=TOOLS, tag_view="positions")
