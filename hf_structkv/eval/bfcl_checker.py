"""BFCL's own AST checker on our JSON function calls — the one place that imports ``bfcl_eval``'s checker.

``bfcl_eval.eval_checker.ast_eval.ast_checker`` imports ``bfcl_eval.constants.model_config`` for one thing: the
``MODEL_CONFIG_MAPPING[model].underscore_to_dot`` flag (whether a model wrote ``math.hypot`` as ``math_hypot``).
That module imports every vendor handler and so every vendor SDK (openai, anthropic, mistralai, cohere, boto3, ...),
which ``pip install --no-deps bfcl-eval`` leaves out on purpose. While the checker module is imported (once, on first
use), a stand-in module holding a one-model table is placed under that name in ``sys.modules`` and removed again
right after (a real ``model_config`` already imported by a full install is put back): nothing else sees it, and the
checker keeps its reference to the one-model table. Our generations keep dotted names (the grammar fixes each name
to the tool's own), so the flag is ``False``.

The checker itself needs nothing beyond the standard library and ``bfcl_eval``'s own light modules (``enums``,
``type_mappings``, the Java / JavaScript type converters).
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MODEL_NAME", "bfcl_model_output", "check_calls"]

MODEL_NAME = "hf-structkv"
"""The model name handed to the checker (no underscore: the checker maps ``_`` to ``/`` before its table lookup)."""

_CHECKER_MODULE = "bfcl_eval.eval_checker.ast_eval.ast_checker"
_MODEL_CONFIG_MODULE = "bfcl_eval.constants.model_config"
_INSTALL_HINT = 'pip install --no-deps "bfcl-eval==2026.3.23" (see scripts/setup.sh)'


@dataclass(frozen=True)
class _CheckerModelConfig:
    """The one field of ``bfcl_eval``'s ``ModelConfig`` the AST checker reads."""

    underscore_to_dot: bool = False


def _import_checker() -> types.ModuleType:
    """``bfcl_eval``'s ``ast_checker`` module, imported with the one-model stand-in for its provider-model table."""
    checker = sys.modules.get(_CHECKER_MODULE)
    if checker is None:
        try:
            importlib.import_module("bfcl_eval.constants.enums")
        except ModuleNotFoundError as err:
            raise ImportError(f"the BFCL checker comes from the bfcl-eval package: {_INSTALL_HINT}") from err
        stand_in = types.ModuleType(_MODEL_CONFIG_MODULE, "hf_structkv stand-in: the AST checker's one-model table")
        stand_in.MODEL_CONFIG_MAPPING = {MODEL_NAME: _CheckerModelConfig(underscore_to_dot=False)}
        previous = sys.modules.get(_MODEL_CONFIG_MODULE)
        sys.modules[_MODEL_CONFIG_MODULE] = stand_in
        try:
            checker = importlib.import_module(_CHECKER_MODULE)
        finally:
            if previous is None:
                del sys.modules[_MODEL_CONFIG_MODULE]
            else:
                sys.modules[_MODEL_CONFIG_MODULE] = previous
    if MODEL_NAME not in checker.MODEL_CONFIG_MAPPING:
        raise RuntimeError(
            f"{_CHECKER_MODULE} was imported before hf_structkv.eval.bfcl_checker, with a provider-model table that "
            f"lacks {MODEL_NAME!r}; import hf_structkv.eval.bfcl_checker first"
        )
    return checker


def bfcl_model_output(calls: Sequence[Mapping[str, Any]]) -> list[dict[str, dict]]:
    """Our parsed calls ``[{"name": n, "arguments": {p: v}}]`` as BFCL's decoded model output ``[{n: {p: v}}]``.

    Raises:
        TypeError: ``calls`` is not a list of dicts, or a call's ``arguments`` is not a dict.
        ValueError: a call lacks ``name`` (a non-empty string) or ``arguments``; the message names the call's index.
    """
    if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Sequence):
        raise TypeError(f"calls must be a list of {{'name', 'arguments'}} dicts, got {type(calls).__name__}")
    output = []
    for index, call in enumerate(calls):
        if not isinstance(call, Mapping):
            raise TypeError(f"calls[{index}] must be a dict, got {type(call).__name__}")
        name, arguments = call.get("name"), call.get("arguments")
        if not isinstance(name, str) or not name or "arguments" not in call:
            raise ValueError(f"calls[{index}] needs a non-empty string 'name' and an 'arguments' dict, got {call!r}")
        if not isinstance(arguments, Mapping):
            raise TypeError(f"calls[{index}]['arguments'] must be a dict, got {type(arguments).__name__}")
        output.append({name: dict(arguments)})
    return output


def check_calls(
    category: str,
    tools: Sequence[Mapping[str, Any]],
    ground_truth: Sequence[Mapping[str, Any]],
    calls: Sequence[Mapping[str, Any]] | None,
) -> dict[str, Any]:
    """Score one generation with BFCL's ``ast_checker`` (Python language), as the leaderboard does.

    Args:
        category: the BFCL test category (``simple_python``, ``multiple``, ``parallel``, ``parallel_multiple``,
            ``live_simple``, ...): it selects the simple, multiple or parallel (order-free) checker.
        tools: the entry's BFCL function definitions (``entry["function"]``), unconverted: the checker reads the
            BFCL type names (``dict``, ``float``, ``tuple``, ``any``).
        ground_truth: the entry's possible answer (``[{name: {param: [accepted values]}}]``).
        calls: our parsed calls ``[{"name", "arguments"}]``, or ``None`` when the generated text was not complete
            JSON (scored invalid with BFCL's decoder-failure type).

    Returns:
        ``{"valid": bool, "error": list[str], "error_type": str | None}`` as BFCL's checker returns it
        (``error_type`` is ``None`` for a valid output).
    """
    if not isinstance(category, str) or not category:
        raise ValueError(f"category must be a BFCL test category name such as 'simple_python', got {category!r}")
    if calls is None:
        return {
            "valid": False,
            "error": ["The generated text is not a complete JSON list of calls."],
            "error_type": "ast_decoder:decoder_failed",
        }
    model_output = bfcl_model_output(calls)
    checker = _import_checker()
    language = importlib.import_module("bfcl_eval.constants.enums").Language.PYTHON
    result = checker.ast_checker(
        list(tools),
        model_output,
        list(ground_truth),
        language=language,
        test_category=category,
        model_name=MODEL_NAME,
    )
    valid = bool(result["valid"])
    return {
        "valid": valid,
        "error": list(result.get("error", [])),
        "error_type": None if valid else result["error_type"],
    }
