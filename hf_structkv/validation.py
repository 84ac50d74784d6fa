"""Integer- and flag-argument checks shared by the whole package, so every such argument is validated the same way
and its error says the same thing: the argument's name, the allowed range, what the number counts, and the bad value.
The command line reads integers with `int_option`; `is_hub_id` tells a name the Hub could hold from a local path.

``bool`` is not an integer here (``True`` is never a token count); NumPy and other ``numbers.Integral`` integers are.
A value that is not an integer raises ``TypeError``; an integer outside the range raises ``ValueError``.
"""

from __future__ import annotations

import argparse
import math
import numbers
from collections.abc import Callable
from typing import Any

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

__all__ = ["check_bool", "check_int", "int_option", "is_hub_id", "is_int", "is_number"]


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer (any ``numbers.Integral``) and not a ``bool``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """Whether ``value`` is a finite ``int`` or ``float`` and not a ``bool`` (an ``int`` beyond the float range, such
    as ``10**400``, is not finite)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_int(
    name: str,
    value: Any,
    minimum: int = 0,
    maximum: int | None = None,
    *,
    counts: str = "",
    none_ok: bool = False,
) -> int | None:
    """``value`` as an ``int`` after checking it is an integer in ``[minimum, maximum]``.

    Args:
        name: the argument's name, as the caller spells it (the error starts with it).
        value: the argument.
        minimum: the smallest allowed value.
        maximum: the largest allowed value, or ``None`` for no upper bound.
        counts: what the number counts (e.g. ``"tokens per chunk"``), said in the error; empty: nothing said.
        none_ok: ``None`` is allowed too (and returned as ``None``).

    Returns:
        ``int(value)``, or ``None`` when ``value`` is ``None`` and ``none_ok``.

    Raises:
        TypeError: ``value`` is not an integer (a ``bool`` included), or ``None`` without ``none_ok``.
        ValueError: ``value`` is an integer outside ``[minimum, maximum]``.
    """
    if value is None and none_ok:
        return None
    if is_int(value) and minimum <= value and (maximum is None or value <= maximum):
        return int(value)
    allowed = f"an integer >= {minimum}" if maximum is None else f"an integer in [{minimum}, {maximum}]"
    if counts:
        allowed += f" ({counts})"
    if none_ok:
        allowed += " or None"
    message = f"{name} must be {allowed}, got {value!r}"
    raise ValueError(message) if is_int(value) else TypeError(message)


def check_bool(name: str, value: Any) -> bool:
    """``value`` after checking it is ``True`` or ``False`` (not ``0``/``1``, ``None`` or a string).

    Raises:
        TypeError: ``value`` is not a ``bool``; the error starts with ``name``.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def int_option(minimum: int) -> Callable[[str], int]:
    """An ``argparse`` ``type`` reading an integer >= ``minimum``: the parser refuses anything else with
    ``argument --NAME: must be an integer >= minimum, got 'text'`` (and exit status 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    return parse


def is_hub_id(text: str) -> bool:
    """Whether ``text`` is spelled as a Hub repository id (``name`` or ``namespace/name``); a path such as
    ``/data/x``, ``./x`` or ``a/b/c`` is not."""
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True
