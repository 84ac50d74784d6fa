"""Structural tags of SQL transitions, read off a character-level Earley parse of the accepted text.

xgrammar masks and accepts the tokens but exposes no parse stack, so the tags come from our own recogniser of the
same :class:`~hf_structkv.structure.sql_grammar.SqlGrammar` productions: an Earley chart over characters (one set
per accepted character, so a rollback is a truncation). The terminals of the productions carry ``(class, role,
state)`` labels (rules in :mod:`~hf_structkv.structure.sql_grammar`); a character's candidate labels are those of
every live terminal that accepts it at the current frontier (several while the prefix is ambiguous, e.g. ``T`` as
alias ``T1`` or table ``TV_Channel``). Nothing looks at later tokens.

A token's tags are the union of its characters' labels (deduplicated, in the Table 5 order of class, role, state),
each with the token's ``next`` field: ``lookahead_critical`` if some terminal the frontier after the token expects
(looking through the optional one-character whitespace) accepts a non-whitespace character with state
``critical``, else ``no_lookahead``. A token that adds no complete character (a byte piece of a multi-byte
character) takes the labels of the string contents it continues; only string literals admit such characters.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from .sql_grammar import CharClass, Label, Literal, SqlGrammar
from .tags import ROLES, STATES, TAG_CLASSES, StructuralTag

__all__ = ["EarleySet", "SqlTagger"]

_WHITESPACE = " \n"
Item = tuple[int, int, int]  # (production index, dot, origin)


@dataclass
class EarleySet:
    """The parser frontier after some characters: ``waiting[nonterminal]`` are the items expecting it,
    ``scanners`` the ``(terminal, item)`` pairs expecting a character, ``complete`` whether the root is derived."""

    waiting: dict[int, list[Item]] = field(default_factory=dict)
    scanners: list[tuple[CharClass, Item]] = field(default_factory=list)
    complete: bool = False


class SqlTagger:
    """Earley recogniser of one :class:`SqlGrammar` whose charts resolve the structural tags of characters.

    A chart is a list of :class:`EarleySet`, one per character accepted plus the start set; callers keep charts
    and truncate them to roll back.
    """

    def __init__(self, grammar: SqlGrammar):
        if not isinstance(grammar, SqlGrammar):
            raise TypeError(f"grammar must be a SqlGrammar (sql_grammar(schema)), got {type(grammar).__name__}")
        names = list(dict.fromkeys(production.lhs for production in grammar.productions))
        ids = {name: index for index, name in enumerate(names)}
        self._lhs: list[int] = []
        self._rhs: list[tuple[int | CharClass, ...]] = []
        self._by_lhs: dict[int, list[int]] = defaultdict(list)
        for production in grammar.productions:
            rhs: list[int | CharClass] = []
            for symbol in production.rhs:
                if isinstance(symbol, str):
                    if symbol not in ids:
                        raise ValueError(f"grammar uses nonterminal {symbol!r} without a production")
                    rhs.append(ids[symbol])
                elif isinstance(symbol, Literal):
                    rhs.extend(CharClass(character, False, symbol.label) for character in symbol.text)
                else:
                    rhs.append(symbol)
            self._by_lhs[ids[production.lhs]].append(len(self._rhs))
            self._lhs.append(ids[production.lhs])
            self._rhs.append(tuple(rhs))
        self._root = ids["root"]
        self._nullable = self._nullable_nonterminals()

    def _nullable_nonterminals(self) -> frozenset[int]:
        nullable: set[int] = set()
        changed = True
        while changed:
            changed = False
            for lhs, rhs in zip(self._lhs, self._rhs):
                if lhs not in nullable and all(isinstance(s, int) and s in nullable for s in rhs):
                    nullable.add(lhs)
                    changed = True
        return frozenset(nullable)

    def start(self) -> list[EarleySet]:
        """A chart holding the start set (nothing accepted yet)."""
        return [self._close([], [(p, 0, 0) for p in self._by_lhs[self._root]])]

    def scan(self, chart: list[EarleySet], character: str) -> tuple[EarleySet | None, tuple[Label, ...]]:
        """The set after ``character`` (``None`` if the grammar rejects it) and the labels of the terminals that
        accept it, without changing ``chart``."""
        kernel, labels = [], {}
        for terminal, (production, dot, origin) in chart[-1].scanners:
            if terminal.accepts(character):
                kernel.append((production, dot + 1, origin))
                labels[terminal.label] = None
        if not kernel:
            return None, ()
        return self._close(chart, kernel), tuple(labels)

    def _close(self, chart: list[EarleySet], kernel: list[Item]) -> EarleySet:
        """Earley prediction and completion from ``kernel`` at position ``len(chart)`` (nullable nonterminals are
        stepped over when predicted, Aycock and Horspool's rule, so completions within the set are not missed)."""
        position = len(chart)
        new = EarleySet()
        seen: set[Item] = set()
        predicted: set[int] = set()
        agenda = list(kernel)
        while agenda:
            item = agenda.pop()
            if item in seen:
                continue
            seen.add(item)
            production, dot, origin = item
            rhs = self._rhs[production]
            if dot == len(rhs):
                lhs = self._lhs[production]
                if lhs == self._root and origin == 0:
                    new.complete = True
                parents = (chart[origin] if origin < position else new).waiting.get(lhs, ())
                agenda.extend((p, d + 1, o) for p, d, o in parents)
                continue
            symbol = rhs[dot]
            if isinstance(symbol, int):
                new.waiting.setdefault(symbol, []).append(item)
                if symbol not in predicted:
                    predicted.add(symbol)
                    agenda.extend((p, 0, position) for p in self._by_lhs[symbol])
                if symbol in self._nullable:
                    agenda.append((production, dot + 1, origin))
            else:
                new.scanners.append((symbol, item))
        return new

    def advance(self, chart: list[EarleySet], text: str) -> tuple[StructuralTag, ...]:
        """Append the sets of ``text``'s characters to ``chart`` and return the token's candidate tags (module
        docstring); empty, with ``chart`` unchanged, when the grammar rejects a character."""
        labels: dict[Label, None] = {}
        new_sets = []
        for character in text:
            after, found = self.scan(chart + new_sets, character)
            if after is None:
                return ()
            labels.update(dict.fromkeys(found))
            new_sets.append(after)
        if not text:  # a byte piece of a multi-byte character, inside a string literal
            labels.update(dict.fromkeys(t.label for t, _ in chart[-1].scanners if t.negated))
            if not labels:
                return ()
        chart.extend(new_sets)
        next_field = "lookahead_critical" if self.expects_critical(chart) else "no_lookahead"
        return tuple(StructuralTag(*label, next_field) for label in sorted(labels, key=_vocabulary_order))

    def expects_critical(self, chart: list[EarleySet]) -> bool:
        """Whether a terminal the frontier expects, directly or after whitespace, accepts a non-whitespace
        character with state ``critical``."""
        frontier = list(chart)
        for _ in range(3):  # the grammar allows at most one whitespace character in a row; a margin costs nothing
            scanners = frontier[-1].scanners
            if any(t.label[2] == "critical" and (t.negated or set(t.chars) - set(_WHITESPACE)) for t, _ in scanners):
                return True
            after, _ = self.scan(frontier, " ")
            if after is None:
                return False
            frontier.append(after)
        return False

    def tags_of(self, text: str) -> list[tuple[str, tuple[StructuralTag, ...]]]:
        """``(character, tags)`` for each character of ``text`` fed one at a time from the start (a diagnostic and
        test helper; raises ``ValueError`` at the first character the grammar rejects)."""
        chart = self.start()
        out = []
        for index, character in enumerate(text):
            tags = self.advance(chart, character)
            if not tags:
                raise ValueError(f"the grammar rejects {character!r} at {index} of {text!r}")
            out.append((character, tags))
        return out

    @staticmethod
    def is_complete(chart: list[EarleySet]) -> bool:
        """Whether the characters of ``chart`` form a complete query."""
        return chart[-1].complete


def _vocabulary_order(label: Label) -> tuple[int, int, int]:
    tag_class, role, state = label
    return TAG_CLASSES.index(tag_class), ROLES["sql"].index(role), STATES["sql"].index(state)
