"""Paired comparison of two methods on the same cases: which cases one solves that the other does not, and the exact
McNemar test of whether the difference is beyond chance.

Two methods answering the same benchmark cases are compared case by case, not by their accuracies alone: only the
discordant cases (solved by one, not the other) carry information about which is better. Under the null hypothesis
that both are equally good, each of the ``n = lost + gained`` discordant cases is equally likely to fall either way,
so ``gained ~ Binomial(n, 1/2)``; the exact two-sided p-value is ``min(1, 2 · P[X <= min(lost, gained)])``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from ..validation import check_int

__all__ = ["PairedComparison", "mcnemar_exact", "paired_comparison"]


def mcnemar_exact(lost: int, gained: int) -> float:
    """The exact two-sided McNemar p-value of ``lost`` and ``gained`` discordant cases (module docstring); 1.0 when
    there are none.

    Raises:
        TypeError: a count is not an integer (a ``bool`` included).
        ValueError: a negative count.
    """
    lost = check_int("lost", lost, counts="cases")
    gained = check_int("gained", gained, counts="cases")
    n = lost + gained
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(lost, gained) + 1)) / 2**n
    return min(1.0, 2 * tail)


@dataclass(frozen=True)
class PairedComparison:
    """``other`` against ``reference`` on the same cases.

    Attributes:
        cases: how many cases both answered.
        reference_correct, other_correct: how many each solved.
        lost: the cases ``reference`` solved and ``other`` did not (ids, in ``reference``'s order).
        gained: the cases ``other`` solved and ``reference`` did not.
        p_value: `mcnemar_exact` of the two counts.
    """

    cases: int
    reference_correct: int
    other_correct: int
    lost: tuple[str, ...]
    gained: tuple[str, ...]
    p_value: float


def paired_comparison(reference: Mapping[str, bool], other: Mapping[str, bool]) -> PairedComparison:
    """Compare two methods' verdicts ``{case id: solved}`` over the same cases.

    Raises:
        ValueError: the two cover different cases (naming a few), or no case.
        TypeError: a verdict that is not a bool.
    """
    if set(reference) != set(other):
        only = sorted(set(reference) ^ set(other))
        raise ValueError(
            f"the two methods answered different cases (e.g. {only[:3]}): compare runs over the same cases"
        )
    if not reference:
        raise ValueError("no case to compare")
    for verdicts in (reference, other):
        bad = [case for case, solved in verdicts.items() if not isinstance(solved, bool)]
        if bad:
            raise TypeError(f"verdicts must be bools (solved or not), got {verdicts[bad[0]]!r} for case {bad[0]!r}")
    lost = tuple(case for case in reference if reference[case] and not other[case])
    gained = tuple(case for case in reference if other[case] and not reference[case])
    return PairedComparison(
        cases=len(reference),
        reference_correct=sum(reference.values()),
        other_correct=sum(other.values()),
        lost=lost,
        gained=gained,
        p_value=mcnemar_exact(len(lost), len(gained)),
    )
