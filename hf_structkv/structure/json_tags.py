"""Structural tags of JSON function-call transitions, read off lm-format-enforcer's parser states.

A token is fed to the parser one character at a time; each character transition is classified from the parser's
object stack *before* the character (which stack entry receives it, and what encloses that entry), and the token's
``next`` field from the stack *after* the whole token. Nothing looks at later tokens.

Elements. A *call object* is an object whose schema has the properties ``name`` and ``arguments``
(:data:`~hf_structkv.structure.function_calls.DISPATCH_KEY`, :data:`~.ARGUMENTS_KEY`). Its ``name`` value is the
*dispatch value*; its ``arguments`` value is the *argument object*, whose properties are the *arguments* (outside
any call object, the outermost object plays the argument object, so plain JSON schemas get roles too). Everything
a value's parser receives, including the value's quotes and everything nested inside it, belongs to that value.

Rules for one character ``c`` (PASK Table 5 vocabulary, function calling):

* **separator**: whitespace outside string contents, and every character of the list / call object / argument
  object themselves (brackets, braces, commas, colons, the opening quote of a key, the keys ``name`` and
  ``arguments``) -> ``(pure_scaffold, scaffold_separator, boundary)``.
* **dispatch value** -> role ``dispatch_key``, state ``critical``.
* **argument key** (its characters and closing quote) -> ``pure_scaffold``, role ``required`` / ``optional`` of
  the keys still compatible with the prefix typed so far (both when ambiguous: candidate tags), state ``boundary``.
* **argument value** -> role ``required`` if the argument is in the tool's ``required`` list, else ``optional``;
  state ``critical`` for a required argument's value and for a closed-set value (see below) of any argument, else
  ``boundary``.
* class inside a dispatch or argument value: ``schema_bearing`` for the contents of a value chosen from a closed
  set the schema lists (enum / const strings, numeric enums, ``true`` / ``false`` / ``null``); ``free_generation``
  for the contents of open values (free strings including escapes, numbers); ``pure_scaffold`` for quotes,
  brackets, braces, commas, colons and key names of nested values.
* **next** = ``lookahead_critical`` if some non-whitespace character the parser accepts after the token would get
  state ``critical`` by the rules above (e.g. after ``"name": "`` or after the colon of a required argument),
  else ``no_lookahead``; the same for every candidate of the token.

A token spanning several characters gets the union of its characters' tags (deduplicated, sorted in the Table 5
order of class, role, state). Parser forks
(``anyOf`` branches before the tool name is settled, primitive unions of BFCL ``any``) contribute the tags of every
branch that accepts the character. A character no branch accepts makes the token unresolved (empty tuple).
"""

from __future__ import annotations

from collections.abc import Iterator

from lmformatenforcer.characterlevelparser import CharacterLevelParser, ForceStopParser, UnionParser
from lmformatenforcer.consts import WHITESPACE_CHARACTERS
from lmformatenforcer.jsonschemaparser import (
    BaseParsingState,
    JsonSchemaParser,
    NumberParsingState,
    ObjectParsingStage,
    ObjectParsingState,
    StringParsingState,
)

from .function_calls import ARGUMENTS_KEY, DISPATCH_KEY
from .tags import ROLES, STATES, TAG_CLASSES, StructuralTag

__all__ = ["advance_characters", "token_tags"]

_SEPARATOR = ("pure_scaffold", "scaffold_separator", "boundary")
_Triple = tuple[str, str, str]  # (class, role, state) of one character transition


def advance_characters(parser: CharacterLevelParser, characters: str) -> CharacterLevelParser:
    """Feed ``characters`` one at a time, as lm-format-enforcer's TokenEnforcer does: a character the parser
    rejects turns it into a ``ForceStopParser`` (which then accepts only a stop token)."""
    for character in characters:
        try:
            parser = parser.add_character(character)
        except Exception:  # lm-format-enforcer signals a rejected character with assorted exception types
            return ForceStopParser()
    return parser


def token_tags(parser: CharacterLevelParser, characters: str) -> tuple[CharacterLevelParser, tuple[StructuralTag, ...]]:
    """Advance ``parser`` by one token's ``characters``; return the after-state and the token's candidate tags.

    A token that adds no character yet (a byte piece of a multi-byte character, completed by a later token) gets
    the tags of the string content it continues. The tags are empty when the token cannot be resolved: a
    character no live JSON-schema branch accepts (the grammar forbids the token) or one the parser raises on; the
    after-state is then a ``ForceStopParser``, so every later token is unresolved too.
    """
    triples: dict[_Triple, None] = {}
    for character in characters:
        found = _character_triples(parser, character)
        if not found:  # no live branch accepts it: the grammar forbids this token
            return ForceStopParser(), ()
        triples.update(dict.fromkeys(found))
        parser = advance_characters(parser, character)
        if isinstance(parser, ForceStopParser):
            return parser, ()
    if not characters:  # a byte piece of a multi-byte character: it continues the string it is inside
        triples.update(dict.fromkeys(_pending_content_triples(parser)))
        if not triples:
            return parser, ()
    next_field = "lookahead_critical" if _expects_critical(parser) else "no_lookahead"
    return parser, tuple(StructuralTag(*triple, next_field) for triple in sorted(triples, key=_vocabulary_order))


def _vocabulary_order(triple: _Triple) -> tuple[int, int, int]:
    """Canonical order of candidate tags: Table 5 order of class, then role, then state."""
    tag_class, role, state = triple
    family = "function_calling"
    return TAG_CLASSES.index(tag_class), ROLES[family].index(role), STATES[family].index(state)


def _pending_content_triples(parser: CharacterLevelParser) -> list[_Triple]:
    """Tags of content characters of the quoted string each branch is inside (none outside strings)."""
    found: dict[_Triple, None] = {}
    for branch in _branches(parser):
        branch.get_allowed_characters()  # see _receiver
        stack = branch.object_stack
        if stack and _inside_quotes(stack[-1]):
            content = next((c for c in stack[-1].get_allowed_characters() if c not in '"\\'), None)
            if content is not None:
                found.update(dict.fromkeys(_classify(stack, len(stack) - 1, content)))
    return list(found)


def _branches(parser: CharacterLevelParser) -> Iterator[JsonSchemaParser]:
    """The JSON-schema parsers alive in ``parser`` (lm-format-enforcer forks ``anyOf`` objects into a union)."""
    if isinstance(parser, JsonSchemaParser):
        yield parser
    elif isinstance(parser, UnionParser):
        for option in parser.parsers:
            yield from _branches(option)


def _character_triples(parser: CharacterLevelParser, character: str) -> list[_Triple]:
    """``(class, role, state)`` candidates of feeding ``character`` to ``parser``; empty when unresolvable."""
    found: dict[_Triple, None] = {}
    for branch in _branches(parser):
        if character in branch.get_allowed_characters():
            found.update(dict.fromkeys(_classify(branch.object_stack, _receiver(branch, character), character)))
    return list(found)


def _receiver(branch: JsonSchemaParser, character: str) -> int:
    """Index of the stack entry that receives ``character``: the topmost one that accepts it (lm-format-enforcer's
    rule), -1 when none does (whitespace after the end of the output)."""
    # get_allowed_characters() makes `branch` the context's active parser, which list states consult.
    branch.get_allowed_characters()
    index = len(branch.object_stack) - 1
    while index >= 0 and character not in branch.object_stack[index].get_allowed_characters():
        index -= 1
    return index


def _classify(stack: list, receiver: int, character: str) -> list[_Triple]:
    """Apply the module's rules to ``character`` received by ``stack[receiver]``."""
    if receiver < 0:
        return [_SEPARATOR]
    element = stack[receiver]
    is_escape = not _is_json_state(element)  # a backslash escape parser pushed above a string
    content_owner = stack[receiver - 1] if is_escape else element
    if character in WHITESPACE_CHARACTERS and not (is_escape or _inside_quotes(content_owner)):
        return [_SEPARATOR]
    position = _position(stack, receiver - 1 if is_escape else receiver)
    kind = position[0]
    if kind == "separator":
        return [_SEPARATOR]
    if kind == "key":
        roles = _key_roles(position[1], content_owner, None if is_escape else character)
        return [("pure_scaffold", role, "boundary") for role in roles]
    role = "dispatch_key" if kind == "dispatch" else _argument_role(position[1], position[2])
    triples = []
    for tag_class, closed_set in _value_classes(stack, receiver, character, is_escape):
        critical = role in ("dispatch_key", "required") or closed_set
        triples.append((tag_class, role, "critical" if critical else "boundary"))
    return triples


def _position(stack: list, receiver: int) -> tuple:
    """Which element ``stack[receiver]`` serves: ``("separator",)``, ``("dispatch",)``,
    ``("key", argument_object)`` or ``("value", argument_object, key)``."""
    call = next((i for i in range(receiver + 1) if _is_call_object(stack[i])), None)
    if call is not None:
        call_state = stack[call]
        if receiver == call or call_state.current_stage != ObjectParsingStage.PARSING_VALUE:
            return ("separator",)
        if call_state.current_key == DISPATCH_KEY:
            return ("dispatch",)
        if call_state.current_key != ARGUMENTS_KEY:
            return ("separator",)
        arguments = call + 1
    else:
        arguments = next((i for i in range(receiver + 1) if isinstance(stack[i], ObjectParsingState)), None)
        if arguments is None:
            return ("separator",)
    if receiver == arguments or not isinstance(stack[arguments], ObjectParsingState):
        return ("separator",)
    argument_object = stack[arguments]
    if argument_object.current_stage == ObjectParsingStage.PARSING_KEY_VALUE_SEPARATOR:
        return ("key", argument_object)
    if argument_object.current_stage == ObjectParsingStage.PARSING_VALUE:
        return ("value", argument_object, argument_object.current_key)
    return ("separator",)


def _key_roles(argument_object: ObjectParsingState, key_parser: StringParsingState, character: str | None) -> list[str]:
    """Roles of the argument keys compatible with the key typed so far, after ``character`` (``None``: a character
    of an escape sequence, not yet part of the parsed key)."""
    if character == '"':
        candidates = [key_parser.parsed_string]  # the closing quote: the key is complete
    else:
        prefix = key_parser.parsed_string + (character or "")
        candidates = [key for key in key_parser.allowed_strings or () if key.startswith(prefix)]
    roles = dict.fromkeys(_argument_role(argument_object, key) for key in candidates)
    return list(roles) or ["optional"]  # a free-form (dictionary) argument object declares no required keys


def _argument_role(argument_object: ObjectParsingState, key: str | None) -> str:
    return "required" if key in (argument_object.schema_object.required or ()) else "optional"


def _value_classes(stack: list, receiver: int, character: str, is_escape: bool) -> list[tuple[str, bool]]:
    """``(class, closed_set)`` candidates of ``character`` inside a value; ``closed_set`` marks a value chosen
    from a set the schema lists."""
    if is_escape:
        closed = _is_closed_set(stack[receiver - 1])
        return [("schema_bearing" if closed else "free_generation", closed)]
    element = stack[receiver]
    if isinstance(element, UnionParser):  # primitive alternatives, e.g. BFCL "any"
        options = [p for p in element.parsers if character in p.get_allowed_characters()]
        return list(dict.fromkeys(_primitive_class(p, character, False) for p in options))
    is_key = receiver > 0 and _awaits_key_end(stack[receiver - 1])
    return [_primitive_class(element, character, is_key)]


def _primitive_class(element: CharacterLevelParser, character: str, is_key: bool) -> tuple[str, bool]:
    if isinstance(element, StringParsingState) and not is_key:
        if character == '"':
            return ("pure_scaffold", _is_closed_set(element))
        closed = _is_closed_set(element)
        return ("schema_bearing" if closed else "free_generation", closed)
    if isinstance(element, NumberParsingState):
        return ("free_generation", False)
    return ("pure_scaffold", False)  # containers, nested keys


def _expects_critical(parser: CharacterLevelParser) -> bool:
    """True if some non-whitespace character accepted next would be classified ``critical``."""
    for branch in _branches(parser):
        branch.get_allowed_characters()  # see _receiver
        stack = branch.object_stack
        claimed = ""  # characters an entry above receives first (lower entries see only what those leave)
        for index in range(len(stack) - 1, -1, -1):
            for character in _representatives(stack[index], claimed):
                if any(state == "critical" for _, _, state in _classify(stack, index, character)):
                    return True
            if not stack[index].can_end():
                break
            claimed += stack[index].get_allowed_characters()
    return False


def _representatives(element: CharacterLevelParser, claimed: str) -> list[str]:
    """One unclaimed non-whitespace character ``element`` accepts per alternative: the state of a character
    received by ``element`` depends on the character only through which alternatives of a union accept it."""
    options = element.parsers if isinstance(element, UnionParser) else (element,)
    found = []
    for option in options:
        accepted = option.get_allowed_characters()
        character = next((c for c in accepted if c not in WHITESPACE_CHARACTERS and c not in claimed), None)
        if character is not None:
            found.append(character)
    return found


def _is_json_state(element: CharacterLevelParser) -> bool:
    if isinstance(element, BaseParsingState):
        return True
    return isinstance(element, UnionParser) and any(isinstance(p, BaseParsingState) for p in element.parsers)


def _is_call_object(element: CharacterLevelParser) -> bool:
    if not isinstance(element, ObjectParsingState):
        return False
    properties = element.schema_object.properties or {}
    return DISPATCH_KEY in properties and ARGUMENTS_KEY in properties


def _awaits_key_end(element: CharacterLevelParser) -> bool:
    """True for an object whose key string sits right above it on the stack."""
    return (
        isinstance(element, ObjectParsingState)
        and element.current_stage == ObjectParsingStage.PARSING_KEY_VALUE_SEPARATOR
    )


def _inside_quotes(element: CharacterLevelParser) -> bool:
    return (
        isinstance(element, StringParsingState)
        and element.require_opening_quote
        and element.seen_opening_quote
        and not element.seen_closing_quote
    )


def _is_closed_set(element: CharacterLevelParser) -> bool:
    return isinstance(element, StringParsingState) and bool(element.allowed_strings)
