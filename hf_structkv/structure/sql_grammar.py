"""A context-free grammar of the Spider SQL subset whose identifiers are one database's tables and columns.

One grammar object serves two engines: it renders to xgrammar's EBNF (:attr:`SqlGrammar.ebnf`, the masks) and its
productions, whose terminals carry ``(class, role, state)`` labels, drive the tag resolver of
:mod:`~hf_structkv.structure.sql_tags`. Both read the same productions, so they accept the same language.

The language (keywords in upper case, identifiers spelled as in the schema, one space or newline where words meet,
an optional one around commas, operators and inside parentheses)::

    query      := select [(INTERSECT | UNION | EXCEPT) query]        root := query [";"]
    select     := SELECT [DISTINCT] item {"," item} FROM source {JOIN source [ON condition] | "," source}
                  [WHERE condition] [GROUP BY column {"," column} [HAVING condition]]
                  [ORDER BY expr [ASC | DESC] {"," expr [ASC | DESC]}] [LIMIT digits]
    source     := table [AS alias] | "(" query ")" [AS alias]                  alias := T1 ... T9
    condition  := test {(AND | OR) test}
    test       := expr op operand | expr [NOT] IN "(" query ")" | expr [NOT] LIKE string
                  | expr [NOT] BETWEEN operand AND operand                       op := = != <> >= <= > <
    operand    := expr | number | string | "(" query ")"
    expr       := term {("+" | "-" | "*" | "/") term}
    term       := column | (COUNT | MAX | MIN | SUM | AVG) "(" [DISTINCT] expr ")"
    column     := [table "." | alias "."] (name | "*")     (a table qualifier admits only that table's columns)

Identifiers that are not plain SQL names (e.g. ``18_49_Rating_Share``) are written in backticks.

Labels (the tag rules for SQL, PASK Table 5 vocabulary; state decided here, the paper names it only):

* **role** is the clause of a *schema reference* (table, column, ``*``, alias, the ``.`` and backticks inside it):
  ``projection`` in the SELECT list, GROUP BY and ORDER BY, ``relation`` in FROM / JOIN sources (tables and alias
  declarations), ``predicate`` in WHERE, HAVING and ON conditions. Every other character (keywords, operators,
  punctuation, whitespace, literal values) is ``outside_schema``. A nested query's references take the roles of
  its own clauses.
* **class**: ``schema_bearing`` for the names of a schema reference (closed sets the schema lists),
  ``free_generation`` for the contents of literal values (numbers, strings, the LIMIT count), ``pure_scaffold``
  for everything else.
* **state**: ``critical`` for the names of schema references and the contents of literal values (the open
  choices that decide what the query means, as the dispatch key and required values do for calls); ``boundary``
  for the characters that open, separate or close a production (clause keywords, JOIN / ON / AS, set operators,
  AND / OR between tests, commas, parentheses, quotes, ``.``, ``;``); ``stable`` for the rest of the scaffold
  inside a production, where the clause does not change (whitespace, comparison and arithmetic operators, NOT / IN
  / LIKE / BETWEEN, aggregate names, DISTINCT, ASC / DESC).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ALIASES",
    "KEYWORDS",
    "CharClass",
    "DatabaseSchema",
    "Literal",
    "Production",
    "SqlGrammar",
    "identifier",
    "normalise_sql",
    "sql_grammar",
]

Label = tuple[str, str, str]  # (class, role, state)

SQL_ROLES = ("projection", "relation", "predicate")
_BOUNDARY: Label = ("pure_scaffold", "outside_schema", "boundary")
_STABLE: Label = ("pure_scaffold", "outside_schema", "stable")
_VALUE: Label = ("free_generation", "outside_schema", "critical")
_WHITESPACE = " \n"
_AGGREGATES = ("COUNT", "MAX", "MIN", "SUM", "AVG")
_COMPARISONS = ("=", "!=", "<>", ">=", "<=", ">", "<")
_SET_OPERATORS = ("INTERSECT", "UNION", "EXCEPT")
ALIASES = tuple(f"T{i}" for i in range(1, 10))
"""Table aliases the grammar admits (Spider's convention)."""
KEYWORDS = frozenset(
    {"SELECT", "DISTINCT", "FROM", "JOIN", "ON", "AS", "WHERE", "GROUP", "BY", "HAVING", "ORDER", "ASC", "DESC"}
    | {"LIMIT", "AND", "OR", "NOT", "IN", "LIKE", "BETWEEN", *_AGGREGATES, *_SET_OPERATORS}
)
"""Every keyword of the grammar (written in upper case)."""
_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Literal:
    """A fixed string, every character labelled ``label``."""

    text: str
    label: Label


@dataclass(frozen=True)
class CharClass:
    """One character from ``chars`` (or, ``negated``, any character not in ``chars``), labelled ``label``."""

    chars: str
    negated: bool
    label: Label

    def accepts(self, character: str) -> bool:
        return (character in self.chars) != self.negated


Symbol = str | Literal | CharClass  # a str names a nonterminal


@dataclass(frozen=True)
class Production:
    """``lhs ::= rhs`` (an empty ``rhs`` derives the empty string)."""

    lhs: str
    rhs: tuple[Symbol, ...]


@dataclass(frozen=True)
class DatabaseSchema:
    """The tables and columns of one database, as Spider's ``tables.json`` lists them.

    Attributes:
        db_id: the database name.
        tables: table names (original spelling).
        columns: ``(table index, column name)`` per column (original spelling; Spider's ``*`` left out).
        column_types: Spider's type of each column (``text``, ``number``, ``time``, ``boolean``, ``others``).
        primary_keys: indices into ``columns``.
        foreign_keys: ``(column, referenced column)`` index pairs into ``columns``.
    """

    db_id: str
    tables: tuple[str, ...]
    columns: tuple[tuple[int, str], ...]
    column_types: tuple[str, ...]
    primary_keys: tuple[int, ...] = ()
    foreign_keys: tuple[tuple[int, int], ...] = ()

    def __post_init__(self):
        if not isinstance(self.db_id, str) or not self.db_id:
            raise ValueError(f"db_id must be a non-empty string, got {self.db_id!r}")
        if not self.tables or not all(isinstance(name, str) and name for name in self.tables):
            raise ValueError(f"tables must be a non-empty list of table names, got {self.tables!r}")
        if not self.columns:
            raise ValueError(f"database {self.db_id!r} has no columns")
        for table, name in self.columns:
            if not (isinstance(table, int) and 0 <= table < len(self.tables)) or not isinstance(name, str) or not name:
                raise ValueError(f"columns must be (table index, name) pairs over {len(self.tables)} tables")
        if len(self.column_types) != len(self.columns):
            raise ValueError(f"column_types has {len(self.column_types)} entries for {len(self.columns)} columns")
        keys = list(self.primary_keys) + [index for pair in self.foreign_keys for index in pair]
        if not all(isinstance(index, int) and 0 <= index < len(self.columns) for index in keys):
            raise ValueError(f"primary_keys and foreign_keys must index the {len(self.columns)} columns")

    @classmethod
    def from_spider(cls, entry: Mapping[str, Any]) -> DatabaseSchema:
        """Build from one entry of Spider's ``tables.json`` (``column_names_original`` starts with ``[-1, "*"]``)."""
        try:
            names = entry["column_names_original"]
            star = 1 if names and names[0][0] == -1 else 0
            return cls(
                db_id=entry["db_id"],
                tables=tuple(entry["table_names_original"]),
                columns=tuple((int(table), name) for table, name in names[star:]),
                column_types=tuple(entry["column_types"][star:]),
                primary_keys=tuple(index - star for index in entry.get("primary_keys", ()) if index >= star),
                foreign_keys=tuple((a - star, b - star) for a, b in entry.get("foreign_keys", ())),
            )
        except (KeyError, TypeError, IndexError) as err:
            raise ValueError(f"not a Spider tables.json entry ({err!r}): {str(entry)[:200]}") from err

    def table_columns(self, table: int) -> tuple[str, ...]:
        """Column names of table ``table``, in schema order."""
        return tuple(name for owner, name in self.columns if owner == table)


@dataclass(frozen=True)
class SqlGrammar:
    """The productions of one database's grammar (start symbol ``root``) and their xgrammar EBNF rendering."""

    schema: DatabaseSchema
    productions: tuple[Production, ...]

    @property
    def ebnf(self) -> str:
        """The grammar in xgrammar's EBNF (GBNF) syntax, root rule ``root``, one line per nonterminal."""
        rules: dict[str, list[str]] = {}
        for production in self.productions:
            rendered = " ".join(_render(symbol) for symbol in production.rhs) or '""'
            rules.setdefault(production.lhs, []).append(rendered)
        return "\n".join(f"{lhs} ::= {' | '.join(alternatives)}" for lhs, alternatives in rules.items()) + "\n"


def _render(symbol: Symbol) -> str:
    if isinstance(symbol, str):
        return symbol
    if isinstance(symbol, Literal):
        return '"' + "".join(_escape(c, '"\\') for c in symbol.text) + '"'
    return "[" + ("^" if symbol.negated else "") + "".join(_escape(c, "]\\^-") for c in symbol.chars) + "]"


def _escape(character: str, special: str) -> str:
    if character == "\n":
        return "\\n"
    return "\\" + character if character in special else character


def identifier(name: str) -> str:
    """How the grammar writes a schema name: as is when it is a plain SQL name, else in backticks."""
    return name if _PLAIN_NAME.fullmatch(name) else f"`{name}`"


class _Rules:
    """Collects productions in order; nonterminal names are valid EBNF rule names."""

    def __init__(self):
        self.productions: list[Production] = []

    def add(self, lhs: str, *alternatives: Sequence[Symbol]) -> str:
        for rhs in alternatives:
            self.productions.append(Production(lhs, tuple(rhs)))
        return lhs


def _words(text: str, label: Label) -> list[Symbol]:
    """A keyword phrase such as ``GROUP BY``: its words as literals joined by the one-character separator."""
    symbols: list[Symbol] = []
    for index, word in enumerate(text.split(" ")):
        if index:
            symbols.append("sp")
        symbols.append(Literal(word, label))
    return symbols


def _name(rules: _Rules, lhs: str, names: Sequence[str], role: str) -> str:
    """``lhs ::= name1 | name2 | ...``, names labelled as schema references of ``role`` (backticks: boundary)."""
    alternatives = []
    for name in dict.fromkeys(names):
        written = identifier(name)
        if written == name:
            alternatives.append([Literal(name, ("schema_bearing", role, "critical"))])
        else:
            tick = Literal("`", ("pure_scaffold", role, "boundary"))
            alternatives.append([tick, Literal(name, ("schema_bearing", role, "critical")), tick])
    return rules.add(lhs, *alternatives)


def sql_grammar(schema: DatabaseSchema) -> SqlGrammar:
    """The grammar of the module docstring for ``schema``'s tables and columns, built deterministically (the same
    schema gives the same productions in the same order)."""
    if not isinstance(schema, DatabaseSchema):
        raise TypeError(f"schema must be a DatabaseSchema (DatabaseSchema.from_spider), got {type(schema).__name__}")
    r = _Rules()
    word = _words
    r.add("sp", [CharClass(_WHITESPACE, False, _STABLE)])
    r.add("opt", [], ["sp"])
    r.add("root", ["query"], ["query", Literal(";", _BOUNDARY)])
    r.add(
        "query",
        ["select_stmt"],
        *(["select_stmt", "sp", Literal(op, _BOUNDARY), "sp", "query"] for op in _SET_OPERATORS),
    )
    r.add(
        "select_stmt",
        [Literal("SELECT", _BOUNDARY), "distinct_opt", "sp", "select_list", "sp", "from_clause", "where_opt",
         "group_opt", "order_opt", "limit_opt"],
    )  # fmt: skip
    r.add("distinct_opt", [], ["sp", Literal("DISTINCT", _STABLE)])
    comma = ["opt", Literal(",", _BOUNDARY), "opt"]
    r.add("select_list", ["expr_projection"], ["expr_projection", *comma, "select_list"])
    r.add("from_clause", [Literal("FROM", _BOUNDARY), "sp", "source", "joins"])
    r.add(
        "joins",
        [],
        ["sp", Literal("JOIN", _BOUNDARY), "sp", "source", "joins"],
        ["sp", Literal("JOIN", _BOUNDARY), "sp", "source", "sp", Literal("ON", _BOUNDARY), "sp", "condition", "joins"],
        [*comma, "source", "joins"],
    )
    _name(r, "table_relation", schema.tables, "relation")
    _name(r, "alias_relation", ALIASES, "relation")
    r.add("alias_opt", [], ["sp", Literal("AS", _BOUNDARY), "sp", "alias_relation"])
    subquery = [Literal("(", _BOUNDARY), "opt", "query", "opt", Literal(")", _BOUNDARY)]
    r.add("source", ["table_relation", "alias_opt"], [*subquery, "alias_opt"])
    r.add("where_opt", [], ["sp", Literal("WHERE", _BOUNDARY), "sp", "condition"])
    r.add("group_opt", [], ["sp", *word("GROUP BY", _BOUNDARY), "sp", "group_list", "having_opt"])
    r.add("group_list", ["column_projection"], ["column_projection", *comma, "group_list"])
    r.add("having_opt", [], ["sp", Literal("HAVING", _BOUNDARY), "sp", "condition"])
    r.add("order_opt", [], ["sp", *word("ORDER BY", _BOUNDARY), "sp", "order_list"])
    r.add("order_item", ["expr_projection"], *(["expr_projection", "sp", Literal(d, _STABLE)] for d in ("ASC", "DESC")))
    r.add("order_list", ["order_item"], ["order_item", *comma, "order_list"])
    r.add("limit_opt", [], ["sp", Literal("LIMIT", _BOUNDARY), "sp", "digits"])
    digit = CharClass("0123456789", False, _VALUE)
    r.add("digits", [digit], [digit, "digits"])
    r.add("unsigned", ["digits"], ["digits", Literal(".", _VALUE), "digits"])
    r.add("number", ["unsigned"], [Literal("-", _VALUE), "unsigned"])
    r.add("string", *([Literal(q, _BOUNDARY), f"chars_{name}", Literal(q, _BOUNDARY)] for q, name in _QUOTES))
    for quote, name in _QUOTES:
        r.add(f"chars_{name}", [], [CharClass(quote + "\n", True, _VALUE), f"chars_{name}"])
    # conditions (predicate role)
    r.add("condition", ["test"], ["test", "sp", Literal("AND", _BOUNDARY), "sp", "condition"],
          ["test", "sp", Literal("OR", _BOUNDARY), "sp", "condition"])  # fmt: skip
    r.add("not_opt", [], [Literal("NOT", _STABLE), "sp"])
    r.add(
        "test",
        ["expr_predicate", "opt", "comparison", "opt", "operand"],
        ["expr_predicate", "sp", "not_opt", Literal("IN", _STABLE), "opt", *subquery],
        ["expr_predicate", "sp", "not_opt", Literal("LIKE", _STABLE), "sp", "string"],
        ["expr_predicate", "sp", "not_opt", Literal("BETWEEN", _STABLE), "sp", "operand", "sp",
         Literal("AND", _STABLE), "sp", "operand"],
    )  # fmt: skip
    r.add("comparison", *([Literal(op, _STABLE)] for op in _COMPARISONS))
    r.add("operand", ["expr_predicate"], ["number"], ["string"], subquery)
    # expressions and column references, one copy per clause role
    all_columns = [name for _, name in schema.columns]
    for role in ("projection", "predicate"):
        r.add(f"expr_{role}", [f"term_{role}"], [f"term_{role}", "opt", "arithmetic", "opt", f"expr_{role}"])
        r.add(
            f"term_{role}",
            [f"column_{role}"],
            *([Literal(agg, _STABLE), Literal("(", _BOUNDARY), "opt", f"aggregated_{role}", "opt",
               Literal(")", _BOUNDARY)] for agg in _AGGREGATES),
        )  # fmt: skip
        r.add(f"aggregated_{role}", [f"expr_{role}"], [Literal("DISTINCT", _STABLE), "sp", f"expr_{role}"])
        star = Literal("*", ("schema_bearing", role, "critical"))
        dot = Literal(".", ("pure_scaffold", role, "boundary"))
        _name(r, f"name_{role}", all_columns, role)
        _name(r, f"alias_{role}", ALIASES, role)
        qualified = [[f"alias_{role}", dot, f"name_{role}"], [f"alias_{role}", dot, star]]
        for index, table in enumerate(schema.tables):
            columns = schema.table_columns(index)
            table_lhs = _name(r, f"table{index}_{role}", [table], role)
            qualified.append([table_lhs, dot, star])
            if columns:
                qualified.append([table_lhs, dot, _name(r, f"table{index}_columns_{role}", columns, role)])
        r.add(f"column_{role}", [f"name_{role}"], [star], *qualified)
    r.add("arithmetic", *([Literal(op, _STABLE)] for op in "+-*/"))
    return SqlGrammar(schema=schema, productions=tuple(r.productions))


_QUOTES = (("'", "single"), ('"', "double"))


_TOKEN = re.compile(
    r"""(?P<string>'[^']*'|"[^"]*")|(?P<number>\d+(?:\.\d+)?)|(?P<name>`[^`]+`|[A-Za-z_][A-Za-z0-9_]*)"""
    r"""|(?P<op>!=|<>|>=|<=|[=<>+\-*/(),.;])|(?P<space>\s+)"""
)


def normalise_sql(sql: str, schema: DatabaseSchema) -> str:
    """Rewrite a Spider SQL string in the grammar's conventions, meaning unchanged: keywords in upper case, table
    aliases as ``T1``..., identifiers in the schema's spelling (SQL names are case-insensitive), single spaces
    between words, none around ``.``, inside parentheses, before a comma or between an aggregate and its ``(``, no
    trailing ``;``.

    Raises:
        ValueError: ``sql`` has a character the grammar has no token for (the message shows where).
    """
    if not isinstance(sql, str):
        raise TypeError(f"sql must be a string, got {type(sql).__name__}")
    tables = {name.lower(): name for name in schema.tables}
    columns = {name.lower(): name for _, name in schema.columns}
    aliases = {alias.lower(): alias for alias in ALIASES}
    tokens: list[str] = []
    clauses = ["SELECT"]  # the clause keyword in force, one entry per open parenthesis
    position, text = 0, sql.strip().rstrip(";").strip()
    while position < len(text):
        match = _TOKEN.match(text, position)
        if match is None:
            raise ValueError(f"normalise_sql: no SQL token at {text[position : position + 20]!r} in {sql!r}")
        position = match.end()
        kind, value = match.lastgroup, match.group()
        if kind == "space":
            continue
        if kind == "name":
            value = _normalise_name(value, tokens, clauses[-1], _next_token(text, position), tables, columns, aliases)
            if value in _CLAUSES:
                clauses[-1] = value
        elif value == "(":
            clauses.append(clauses[-1])
        elif value == ")" and len(clauses) > 1:
            clauses.pop()
        elif kind == "number" and tokens and tokens[-1] == "-" and (len(tokens) < 2 or tokens[-2] in _VALUE_BEFORE):
            value = tokens.pop() + value  # a negative number: "-" glued to its digits
        tokens.append(value)
    out = ""
    for index, token in enumerate(tokens):
        previous = tokens[index - 1] if index else None
        glued = previous in (None, ".", "(") or token in (".", ",", ")") or (token == "(" and previous in _AGGREGATES)
        out += token if glued else " " + token
    return out


_CLAUSES = frozenset({"SELECT", "FROM", "JOIN", "ON", "WHERE", "GROUP", "HAVING", "ORDER", "LIMIT"})
_VALUE_BEFORE = frozenset({*_COMPARISONS, "(", ",", "AND", "BETWEEN", "LIMIT"})


def _next_token(text: str, position: int) -> str:
    match = _TOKEN.match(text, position)
    while match is not None and match.lastgroup == "space":
        match = _TOKEN.match(text, match.end())
    return "" if match is None else match.group()


def _normalise_name(value, tokens, clause, following, tables, columns, aliases) -> str:
    """A keyword, alias, table or column in the grammar's spelling (unknown names are left as they are)."""
    bare = value.strip("`")
    upper, lower = bare.upper(), bare.lower()
    before = tokens[-1] if tokens else ""
    qualifies = following == "."
    if upper in KEYWORDS and value == bare:
        return upper
    if lower in aliases and (qualifies or before == "AS"):
        return aliases[lower]
    if lower in tables and before != "." and (qualifies or (clause in ("FROM", "JOIN") and before != "AS")):
        return identifier(tables[lower])
    if lower in columns:
        return identifier(columns[lower])
    if lower in tables:
        return identifier(tables[lower])
    return value
