"""Compacting a tool catalogue: the tools rendered by the chat template's tool format (`catalogue_text`), compacted
once and served before every conversation (``generate_calls(..., context=)``).

Calibration: by default `compact`'s own (``queries="repeat"``: the catalogue repeated). With ``queries="self_study"``
or task ``questions`` the self-study tier runs (`catalogue_self_study`): the catalogue ends where the template opens
the conversation's first turn (its turn-start token), so each of the four self-study prompts is sent as a user turn
of the template (`catalogue_turn`: role header before it, end of turn and assistant header after it), and each
question adds a conversation whose answer is the question's turn exactly as ``generate_calls`` feeds it after the
catalogue, followed by the model's sampled reply, so the calibration queries include queries like those the
catalogue will serve.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..cache.compacted import CompactedCache
from ..structure.function_calls import function_call_schema
from ..structured_generation import call_prompt, catalogue_metadata, catalogue_text, conversation_text
from .head_compaction import HEAD_METHODS
from .pipeline import compact
from .self_study import SelfStudy

__all__ = ["catalogue_self_study", "catalogue_turn", "compact_catalogue"]

_MARKER = "SELF_STUDY_PROMPT_MARKER"


def catalogue_turn(tokenizer: PreTrainedTokenizerBase, tools: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    """The user turn that follows ``tools``' catalogue, around its text: ``(before, after)`` such that a user text
    ``q``'s turn after `catalogue_text` (as `call_prompt` renders it, `conversation_text`) is ``before + q + after``
    (for the embedded model's template: the role header ``"user\n"``, then the end of turn and the assistant header).
    Read from the tokenizer's chat template with a marker text as the question.

    Raises:
        ValueError: the template does not render the question's text exactly once, as it is, after the catalogue.
    """
    turn = conversation_text(tokenizer, call_prompt(tokenizer, _MARKER, tools), catalogue_text(tokenizer, tools))
    if turn.count(_MARKER) != 1:
        raise ValueError(
            "the chat template does not render a question's text once, as it is, after the tool catalogue: its user "
            "turn cannot frame the self-study prompts"
        )
    before, after = turn.split(_MARKER)
    return before, after


def catalogue_self_study(
    tokenizer: PreTrainedTokenizerBase,
    tools: Sequence[Mapping[str, Any]],
    questions: Sequence[str | Sequence[Mapping[str, str]]] | None = None,
    config: SelfStudy | None = None,
) -> SelfStudy:
    """``config`` (default ``SelfStudy()``) for a catalogue: its four prompts framed as user turns after the catalogue
    (``turn_prefix`` and ``turn_suffix`` from `catalogue_turn`) and, with ``questions``, their task prompts: each
    question's text after the catalogue in the prompt ``generate_calls`` builds (`call_prompt` then
    `conversation_text`: the user turn and the assistant header), so its calibration conversation reads the catalogue
    token for token as the question will.

    Args:
        questions: ``None`` (no task prompts) or a non-empty list of questions as ``generate_calls`` takes them: each
            a user text or a list of chat messages (``{"role", "content"}``) that does not open with its own system
            message.
        config: lengths and sampling; its ``turn_prefix`` and ``turn_suffix`` must be empty (the catalogue sets them)
            and it must hold no ``prompts`` (the questions are them).

    Raises:
        TypeError: ``questions`` is a string or not a sequence, ``config`` is not a `SelfStudy`.
        ValueError: ``questions`` is empty, or a question is malformed or opens with a system message (the error
            names ``questions[i]``); ``config`` has a turn prefix or suffix or prompts of its own.
    """
    if questions is not None and (isinstance(questions, (str, Mapping)) or not isinstance(questions, Sequence)):
        raise TypeError(f"questions must be a list of questions, got {type(questions).__name__}")
    if questions is not None and not questions:
        raise ValueError("questions must hold at least one question")
    config = SelfStudy() if config is None else config
    if not isinstance(config, SelfStudy):
        raise TypeError(f"config must be a SelfStudy or None, got {type(config).__name__}")
    if config.turn_prefix or config.turn_suffix or config.prompts:
        raise ValueError(
            "a catalogue's self-study frames its prompts as the template's user turn and takes its task prompts from "
            "questions: pass a SelfStudy without turn_prefix, turn_suffix or prompts"
        )
    catalogue = catalogue_text(tokenizer, tools)
    prompts = []
    for index, question in enumerate(questions or ()):
        try:
            prompts.append(conversation_text(tokenizer, call_prompt(tokenizer, question, tools), catalogue))
        except ValueError as error:
            raise ValueError(f"questions[{index}]: {error}") from error
    before, after = catalogue_turn(tokenizer, tools)
    return dataclasses.replace(config, turn_prefix=before, turn_suffix=after, prompts=prompts)


def compact_catalogue(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tools: Sequence[Mapping[str, Any]],
    questions: Sequence[str | Sequence[Mapping[str, str]]] | None = None,
    **compact_kwargs,
) -> CompactedCache:
    """`compact` ``catalogue_text(tokenizer, tools)`` and record it in ``metadata["catalogue"]``
    (`catalogue_metadata`: its SHA-256, tokens and tool count), which ``generate_calls(..., context=)`` checks.

    Args:
        tools: BFCL- or OpenAI-style tool definitions (checked first, `function_call_schema`).
        questions: optional task questions: calibrate with ``queries="self_study"``. With the self-study tier
            (``questions`` or ``queries="self_study"``) the study is ``catalogue_self_study(tokenizer, tools,
            questions, compact_kwargs' self_study)``: the four prompts as user turns after the catalogue and, with
            ``questions``, each question's turn (the metadata's ``calibration.self_study.prompt_tasks`` records them).
            ``None``: `compact`'s calibration as ``compact_kwargs`` ask.
        compact_kwargs: `compact`'s options (``ratio``, ``method``, ``queries``, ...).

    Raises:
        TypeError / ValueError: malformed ``tools`` or ``questions`` (before any work), ``questions`` with a
            ``queries`` tier other than ``"self_study"`` or a query-free ``method``, a ``self_study`` with a turn
            prefix, suffix or prompts of its own, or what `compact` raises for its options.
    """
    function_call_schema(tools)
    if questions is not None:
        if compact_kwargs.get("queries", "self_study") != "self_study":
            raise ValueError(
                f"questions calibrate with queries='self_study', got queries={compact_kwargs['queries']!r}: drop one"
            )
        method = compact_kwargs.get("method", "kv_surgeon")
        if method in HEAD_METHODS and not HEAD_METHODS[method].needs_queries:
            raise ValueError(f"questions calibrate a method fitted to queries; method {method!r} uses none")
        compact_kwargs = {**compact_kwargs, "queries": "self_study"}
    if compact_kwargs.get("queries") == "self_study":
        study = catalogue_self_study(tokenizer, tools, questions, compact_kwargs.get("self_study"))
        compact_kwargs = {**compact_kwargs, "self_study": study}
    cache = compact(model, tokenizer, catalogue_text(tokenizer, tools), **compact_kwargs)
    cache.metadata["catalogue"] = catalogue_metadata(tokenizer, tools)
    return cache
