"""Compacting a tool catalogue: the tools rendered by the chat template's tool format (`catalogue_text`), compacted
once and served before every conversation (``generate_calls(..., context=)``).

Calibration: by default `compact`'s own (``queries="repeat"``: the catalogue repeated). With task ``questions``
(`catalogue_task_study`), the self-study tier runs and each question adds a conversation whose answer is the
question's turn exactly as ``generate_calls`` feeds it after the catalogue, followed by the model's sampled reply,
so the calibration queries include queries like those the catalogue will serve.
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

__all__ = ["catalogue_task_study", "compact_catalogue"]


def catalogue_task_study(
    tokenizer: PreTrainedTokenizerBase,
    tools: Sequence[Mapping[str, Any]],
    questions: Sequence[str | Sequence[Mapping[str, str]]],
    config: SelfStudy | None = None,
) -> SelfStudy:
    """``config`` (default ``SelfStudy()``) with the task prompts of ``questions``: each question's text after the
    catalogue in the prompt ``generate_calls`` builds (`call_prompt` then `conversation_text`: the user turn and the
    assistant header), so its calibration conversation reads the catalogue token for token as the question will.

    Args:
        questions: a non-empty list of questions as ``generate_calls`` takes them: each a user text or a list of chat
            messages (``{"role", "content"}``) that does not open with its own system message.

    Raises:
        TypeError: ``questions`` is a string or not a sequence, ``config`` is not a `SelfStudy`.
        ValueError: ``questions`` is empty, or a question is malformed or opens with a system message (the error
            names ``questions[i]``).
    """
    if isinstance(questions, (str, Mapping)) or not isinstance(questions, Sequence):
        raise TypeError(f"questions must be a list of questions, got {type(questions).__name__}")
    if not questions:
        raise ValueError("questions must hold at least one question")
    config = SelfStudy() if config is None else config
    if not isinstance(config, SelfStudy):
        raise TypeError(f"config must be a SelfStudy or None, got {type(config).__name__}")
    catalogue = catalogue_text(tokenizer, tools)
    prompts = []
    for index, question in enumerate(questions):
        try:
            prompts.append(conversation_text(tokenizer, call_prompt(tokenizer, question, tools), catalogue))
        except ValueError as error:
            raise ValueError(f"questions[{index}]: {error}") from error
    return dataclasses.replace(config, prompts=prompts)


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
        questions: optional task questions (`catalogue_task_study`): calibrate with ``queries="self_study"`` and
            ``self_study=catalogue_task_study(tokenizer, tools, questions, compact_kwargs' self_study)``; the metadata's
            ``calibration.self_study.prompt_tasks`` then records each question's turn. ``None``: `compact`'s
            calibration as ``compact_kwargs`` ask.
        compact_kwargs: `compact`'s options (``ratio``, ``method``, ``queries``, ...).

    Raises:
        TypeError / ValueError: malformed ``tools`` or ``questions`` (before any work), ``questions`` with a
            ``queries`` tier other than ``"self_study"`` or a query-free ``method``, or what `compact` raises for its
            options.
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
        study = catalogue_task_study(tokenizer, tools, questions, compact_kwargs.get("self_study"))
        compact_kwargs = {**compact_kwargs, "queries": "self_study", "self_study": study}
    cache = compact(model, tokenizer, catalogue_text(tokenizer, tools), **compact_kwargs)
    cache.metadata["catalogue"] = catalogue_metadata(tokenizer, tools)
    return cache
