"""The SQL grammar (schema-restricted Spider subset), its Earley tag resolver and the xgrammar adapter."""

import functools
import itertools
import random

import numpy as np
import pytest
import torch
import xgrammar

from hf_structkv.eval.spider import database_schema, load_spider
from hf_structkv.structure import StructuralLogitsProcessor, StructuralTag
from hf_structkv.structure.sql_grammar import (
    DatabaseSchema,
    Literal,
    Production,
    SqlGrammar,
    identifier,
    normalise_sql,
    sql_grammar,
)
from hf_structkv.structure.sql_tags import SqlTagger
from hf_structkv.structure.xgrammar_sql import SqlGrammarAdapter


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tokenizer), max_threads=1)


def xgrammar_accepts(compiler, schema: DatabaseSchema, text: str) -> bool:
    matcher = xgrammar.GrammarMatcher(compiler.compile_grammar(sql_grammar(schema).ebnf))
    return matcher.accept_string(text) and matcher.is_completed()


@functools.cache
def _tagger(schema: DatabaseSchema) -> SqlTagger:
    return SqlTagger(sql_grammar(schema))


def tagger_accepts(schema: DatabaseSchema, text: str) -> bool:
    tagger = _tagger(schema)
    chart = tagger.start()
    return all(tagger.advance(chart, character) for character in text) and tagger.is_complete(chart)


# ----------------------------------------------------------------------------------------------- the grammar
def test_both_engines_accept_every_normalised_gold_query_of_spider_dev(compiler):
    """All 1,034 Spider dev gold queries, normalised (keywords upper case, schema spelling), are in the grammar of
    their database, for xgrammar and for the Earley tag resolver alike."""
    entries = load_spider()
    assert len(entries) == 1034
    schemas = {db_id: database_schema(db_id) for db_id in {entry.db_id for entry in entries}}
    rejected = []
    for entry in entries:
        query = normalise_sql(entry.gold, schemas[entry.db_id])
        if not (
            xgrammar_accepts(compiler, schemas[entry.db_id], query) and tagger_accepts(schemas[entry.db_id], query)
        ):
            rejected.append(entry.gold)
    assert rejected == []


@pytest.mark.parametrize(
    "query",
    [
        "SELECT foo FROM singer",  # no such column
        "SELECT Name FROM singers",  # no such table
        "SELECT singer.Theme FROM singer",  # Theme is a column of concert, not of singer
        "SELECT T1.Name FROM singer AS X1",  # aliases are T1..T9
        "select Name from singer",  # keywords are upper case
        "SELECT Name FROM singer WHERE Age > '30",  # unterminated string
        "SELECT Name FROM singer LIMIT x",
    ],
)
def test_both_engines_reject_what_is_not_in_the_schema_grammar(compiler, query):
    schema = database_schema("concert_singer")
    assert not xgrammar_accepts(compiler, schema, query)
    assert not tagger_accepts(schema, query)


def test_the_grammar_is_deterministic_and_quotes_non_plain_names():
    schema = database_schema("tvshow")
    assert sql_grammar(schema) == sql_grammar(schema)
    assert sql_grammar(schema).ebnf == sql_grammar(database_schema("tvshow")).ebnf
    assert '"`" "18_49_Rating_Share" "`"' in sql_grammar(schema).ebnf
    assert tagger_accepts(schema, "SELECT `18_49_Rating_Share` FROM TV_series")
    assert (identifier("18_49_Rating_Share"), identifier("Rating")) == ("`18_49_Rating_Share`", "Rating")


def test_tags_of_lists_each_characters_tags_and_names_the_first_rejected_one():
    tagger = SqlTagger(sql_grammar(database_schema("concert_singer")))
    tags = tagger.tags_of("SELECT Age")
    assert [character for character, _ in tags] == list("SELECT Age")
    assert tags[-1][1] == (StructuralTag("schema_bearing", "projection", "critical", "no_lookahead"),)
    with pytest.raises(ValueError, match="rejects 'x' at 7"):
        tagger.tags_of("SELECT x")
    with pytest.raises(TypeError, match="SqlGrammar"):
        SqlTagger(database_schema("concert_singer"))


def test_normalise_sql_keeps_the_meaning_in_the_grammar_conventions():
    schema = database_schema("concert_singer")
    assert normalise_sql("select count(*) from SINGER as t1 where t1.age  >  -5 ;", schema) == (
        "SELECT COUNT(*) FROM singer AS T1 WHERE T1.Age > -5"
    )
    assert normalise_sql('SELECT name , country FROM singer WHERE song_name LIKE "%Hey%"', schema) == (
        'SELECT Name, Country FROM singer WHERE Song_Name LIKE "%Hey%"'
    )
    with pytest.raises(ValueError, match="no SQL token"):
        normalise_sql("SELECT name FROM singer WHERE a = #", schema)
    with pytest.raises(TypeError, match="sql must be a string"):
        normalise_sql(None, schema)


def test_database_schema_validates_its_input():
    with pytest.raises(ValueError, match="not a Spider tables.json entry"):
        DatabaseSchema.from_spider({"db_id": "x"})
    with pytest.raises(ValueError, match="columns must be"):
        DatabaseSchema("x", ("t",), ((3, "c"),), ("text",))
    with pytest.raises(ValueError, match="column_types"):
        DatabaseSchema("x", ("t",), ((0, "c"),), ())
    with pytest.raises(TypeError, match="DatabaseSchema"):
        sql_grammar({"db_id": "x"})
    schema = database_schema("concert_singer")
    assert schema.table_columns(1)[:3] == ("Singer_ID", "Name", "Country")
    assert schema.columns[schema.foreign_keys[0][0]] == (2, "Stadium_ID")


# ------------------------------------------------------------------------------------ Earley vs brute force
def _toy_grammar() -> SqlGrammar:
    """Left and right recursion, nullable rules and an ambiguous prefix, over the alphabet {a, b, c}."""
    label = ("pure_scaffold", "outside_schema", "stable")
    a, b, c = (Literal(x, label) for x in "abc")
    productions = [
        Production("root", ("list", "tail")),
        Production("list", ()),
        Production("list", ("list", a)),
        Production("tail", (b, "tail")),
        Production("tail", ("maybe",)),
        Production("maybe", ()),
        Production("maybe", (c, "maybe", a)),
    ]
    return SqlGrammar(schema=database_schema("concert_singer"), productions=tuple(productions))


def _brute_force_language(grammar: SqlGrammar, max_length: int) -> set[str]:
    """Every string of length <= max_length derived by leftmost expansion of sentential forms (pruned by the
    terminal count, which only grows)."""
    rules: dict[str, list[tuple]] = {}
    for production in grammar.productions:
        rules.setdefault(production.lhs, []).append(production.rhs)
    words, frontier, seen = set(), [("root",)], set()
    while frontier:
        form = frontier.pop()
        if form in seen or sum(not isinstance(s, str) for s in form) > max_length or len(form) > 3 * max_length + 3:
            continue
        seen.add(form)
        index = next((i for i, s in enumerate(form) if isinstance(s, str)), None)
        if index is None:
            words.add("".join(s.text for s in form))
            continue
        for rhs in rules[form[index]]:
            frontier.append(form[:index] + rhs + form[index + 1 :])
    return words


def test_earley_recogniser_matches_brute_force_on_a_toy_grammar():
    grammar = _toy_grammar()
    language = _brute_force_language(grammar, 9)  # every prefix of length <= 4 extends to a word of length <= 9
    prefixes = {word[:i] for word in language for i in range(len(word) + 1)}
    tagger = SqlTagger(grammar)
    for length in range(5):
        for letters in itertools.product("abc", repeat=length):
            text = "".join(letters)
            chart, alive = tagger.start(), True
            for character in text:
                alive = alive and bool(tagger.advance(chart, character))
            assert alive == (text in prefixes), text
            assert (alive and tagger.is_complete(chart)) == (text in language), text


# ------------------------------------------------------------------------------------------------ the tags
_SHORT = {"P": "pure_scaffold", "S": "schema_bearing", "F": "free_generation", "o": "outside_schema"}
_SHORT |= {"proj": "projection", "rel": "relation", "pred": "predicate", "s": "stable", "b": "boundary"}
_SHORT |= {"c": "critical", "L": "lookahead_critical", "-": "no_lookahead"}

# Hand-checked: (token text, candidate tags in the short form above) for the embedded model's tokenizer.
GOLDEN = {
    ("concert_singer", "SELECT COUNT(*) FROM singer"): [
        ("SELECT", ["P o b L"]),
        (" COUNT", ["P o s -", "S proj c -"]),  # "C" may still start the column Country or Capacity
        ("(*)", ["P o b -", "S proj c -"]),
        (" FROM", ["P o s L", "P o b L"]),
        (" singer", ["P o s L", "S rel c L"]),
    ],
    ("concert_singer", "SELECT T1.Name FROM singer AS T1 WHERE T1.Age > 30"): [
        ("SELECT", ["P o b L"]),
        (" T", ["P o s L", "S proj c L"]),
        ("1", ["S proj c -"]),
        (".Name", ["P proj b -", "S proj c -"]),
        (" FROM", ["P o s L", "P o b L"]),
        (" singer", ["P o s L", "S rel c L"]),
        (" AS", ["P o s L", "P o b L"]),
        (" T", ["P o s L", "S rel c L"]),
        ("1", ["S rel c -"]),
        (" WHERE", ["P o s L", "P o b L"]),
        (" T", ["P o s L", "S pred c L"]),
        ("1", ["S pred c -"]),
        (".Age", ["P pred b -", "S pred c -"]),
        (" >", ["P o s L"]),
        (" ", ["P o s L"]),
        ("3", ["F o c L"]),
        ("0", ["F o c L"]),
    ],
    ("pets_1", "SELECT PetType, MAX(weight) FROM Pets WHERE PetType LIKE 'c%' ORDER BY PetType DESC"): [
        ("SELECT", ["P o b L"]),
        (" Pet", ["P o s L", "S proj c L"]),
        ("Type", ["S proj c -"]),
        (",", ["P o b L"]),
        (" MAX", ["P o s -", "S proj c -"]),  # "M" may still start the column Major
        ("(weight", ["P o b -", "S proj c -"]),
        (")", ["P o b -"]),
        (" FROM", ["P o s L", "P o b L"]),
        (" Pets", ["P o s -", "S rel c -"]),
        (" WHERE", ["P o s L", "P o b L"]),
        (" Pet", ["P o s L", "S pred c L"]),
        ("Type", ["S pred c -"]),
        (" LIKE", ["P o s -"]),
        (" '", ["P o s L", "P o b L"]),
        ("c", ["F o c L"]),
        ("%'", ["P o b -", "F o c -"]),
        (" ORDER", ["P o s -", "P o b -"]),
        (" BY", ["P o s L", "P o b L"]),
        (" Pet", ["P o s L", "S proj c L"]),
        ("Type", ["S proj c -"]),
        (" DESC", ["P o s -"]),
    ],
}


def _expand(short: str) -> StructuralTag:
    return StructuralTag(*(_SHORT[field] for field in short.split()))


@pytest.mark.parametrize("key", list(GOLDEN), ids=lambda key: key[1][:40])
def test_golden_tags_per_token(tokenizer, key):
    db_id, query = key
    sequence = SqlGrammarAdapter(tokenizer, database_schema(db_id)).new_sequence()
    ids = tokenizer(query, add_special_tokens=False).input_ids
    got = [(tokenizer.decode([token]), sequence.advance(token)) for token in ids]
    want = [(text, tuple(_expand(tag) for tag in tags)) for text, tags in GOLDEN[key]]
    assert got == want
    assert sequence.is_complete()
    assert all(tag.validate("sql") for _, tags in got for tag in tags)


def test_a_byte_piece_inside_a_string_takes_the_string_contents_tags(tokenizer):
    sequence = SqlGrammarAdapter(tokenizer, database_schema("concert_singer")).new_sequence()
    query = "SELECT Name FROM singer WHERE Country = '渋谷'"
    ids = tokenizer(query, add_special_tokens=False).input_ids
    pieces = [token for token in ids if "\ufffd" in tokenizer.decode([token])]
    assert pieces, "the test needs a character split into byte tokens"
    tags = {token: sequence.advance(token) for token in ids}
    content = (_expand("F o c L"),)
    assert all(set(tags[token]) <= {*content, _expand("P o b L")} and content[0] in tags[token] for token in pieces)
    assert sequence.is_complete()


# -------------------------------------------------------------------------------------- adapter and processor
def test_processor_mask_equals_xgrammars_mask_at_every_step(tokenizer, compiler):
    schema = database_schema("concert_singer")
    query = "SELECT T1.Name, COUNT(*) FROM singer AS T1 JOIN singer_in_concert AS T2 ON T1.Singer_ID = T2.Singer_ID"
    ids = tokenizer(query, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    processor = StructuralLogitsProcessor(tokenizer, adapter=SqlGrammarAdapter(tokenizer, schema))
    matcher = xgrammar.GrammarMatcher(
        compiler.compile_grammar(sql_grammar(schema).ebnf), override_stop_tokens=[tokenizer.eos_token_id]
    )
    vocab = len(tokenizer) + 7  # a model vocabulary larger than the tokenizer's: the extra ids are forbidden
    prompt = torch.tensor([[11, 12, 13]])
    for step in range(len(ids)):
        input_ids = torch.cat([prompt, torch.tensor([ids[:step]], dtype=torch.long)], dim=1)
        allowed = processor(input_ids, torch.zeros(1, vocab)) == 0
        bitmask = xgrammar.allocate_token_bitmask(1, len(tokenizer))
        matcher.fill_next_token_bitmask(bitmask)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")  # int32 words, little-endian
        want = torch.from_numpy(bits[: len(tokenizer)].astype(bool))
        assert torch.equal(allowed[0, : len(tokenizer)], want), step
        assert not allowed[0, len(tokenizer) :].any()
        assert allowed[0, ids[step]]
        assert matcher.accept_token(ids[step])
    assert len(processor.tags(0)) == len(ids) - 1 and all(processor.tags(0))  # the stop token is never seen


def test_rollback_restores_masks_and_tags_exactly(tokenizer):
    adapter = SqlGrammarAdapter(tokenizer, database_schema("pets_1"))
    ids = tokenizer("SELECT PetType FROM Pets WHERE weight > 10 ORDER BY pet_age", add_special_tokens=False).input_ids
    fresh = adapter.new_sequence()
    masks, tags = [fresh.allowed_token_mask(len(tokenizer))], []
    for token in ids:
        tags.append(fresh.advance(token))
        masks.append(fresh.allowed_token_mask(len(tokenizer)))
    sequence = adapter.new_sequence()
    for token in ids:
        sequence.advance(token)
    for keep in (len(ids) - 1, 7, 3, 0):
        sequence.rollback(sequence.num_tokens - keep)
        assert sequence.num_tokens == keep
        assert torch.equal(sequence.allowed_token_mask(len(tokenizer)), masks[keep])
        assert [sequence.advance(token) for token in ids[keep:]] == tags[keep:]
        assert sequence.is_complete()
    with pytest.raises(ValueError, match=r"num_tokens must be an integer in \[0, "):
        sequence.rollback(len(ids) + 1)


def test_a_forbidden_token_leaves_only_stop_tokens_until_rolled_back(tokenizer):
    adapter = SqlGrammarAdapter(tokenizer, database_schema("pets_1"), eos_token_id=[tokenizer.eos_token_id, 7])
    sequence = adapter.new_sequence()
    select = tokenizer("SELECT", add_special_tokens=False).input_ids
    assert [len(sequence.advance(token)) > 0 for token in select] == [True] * len(select)
    before = sequence.allowed_token_mask(len(tokenizer))
    assert sequence.advance(tokenizer("FROM", add_special_tokens=False).input_ids[0]) == ()
    assert sequence.allowed_token_mask(len(tokenizer)).nonzero().flatten().tolist() == [7, tokenizer.eos_token_id]
    assert sequence.advance(select[0]) == () and not sequence.is_complete()
    sequence.rollback(2)
    assert torch.equal(sequence.allowed_token_mask(len(tokenizer)), before)
    assert adapter.stop_token_ids == frozenset({7, tokenizer.eos_token_id})


def test_random_walks_under_the_mask_are_always_tagged(tokenizer):
    """Whatever xgrammar allows, the Earley resolver follows: tokens sampled from the mask always get tags."""
    adapter = SqlGrammarAdapter(tokenizer, database_schema("world_1"))
    rng = random.Random(0)
    for _ in range(4):
        sequence = adapter.new_sequence()
        for _ in range(40):
            allowed = sequence.allowed_token_mask(len(tokenizer)).nonzero().flatten().tolist()
            choices = [token for token in allowed if token not in adapter.stop_token_ids]
            if not choices:
                break
            assert sequence.advance(rng.choice(choices)) != ()


def test_adapter_arguments_are_checked(tokenizer):
    with pytest.raises(TypeError, match="DatabaseSchema"):
        SqlGrammarAdapter(tokenizer, {"db_id": "pets_1"})
    with pytest.raises(TypeError, match="transformers tokenizer"):
        SqlGrammarAdapter("qwen", database_schema("pets_1"))
    with pytest.raises(ValueError, match="eos_token_id"):
        SqlGrammarAdapter(tokenizer, database_schema("pets_1"), eos_token_id=-1)
    processor = StructuralLogitsProcessor(tokenizer, adapter=SqlGrammarAdapter(tokenizer, database_schema("pets_1")))
    assert processor.family == "sql"
