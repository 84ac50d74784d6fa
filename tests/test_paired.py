"""Paired comparison and the exact McNemar test against a brute-force enumeration."""

import itertools

import pytest

from hf_structkv.eval.paired import PairedComparison, mcnemar_exact, paired_comparison


def _brute_force_p(lost: int, gained: int) -> float:
    """Every way the n discordant cases could fall (each side with probability 1/2): the share at least as far from
    an even split as the observed one."""
    n = lost + gained
    observed = abs(gained - n / 2)
    outcomes = list(itertools.product((0, 1), repeat=n))
    return sum(abs(sum(o) - n / 2) >= observed - 1e-12 for o in outcomes) / len(outcomes)


@pytest.mark.parametrize(("lost", "gained"), [(a, b) for a in range(7) for b in range(7) if 0 < a + b <= 12])
def test_mcnemar_exact_equals_the_enumerated_two_sided_tail(lost, gained):
    assert mcnemar_exact(lost, gained) == pytest.approx(_brute_force_p(lost, gained))


def test_mcnemar_exact_closed_values_and_bad_counts():
    assert mcnemar_exact(0, 0) == 1.0 and mcnemar_exact(4, 4) == 1.0
    assert mcnemar_exact(7, 4) == pytest.approx(2 * (1 + 11 + 55 + 165 + 330) / 2**11)  # 0.549
    assert mcnemar_exact(0, 6) == pytest.approx(2 / 2**6) and mcnemar_exact(6, 0) == mcnemar_exact(0, 6)
    with pytest.raises(ValueError, match=r"lost must be an integer >= 0 \(cases\), got -1"):
        mcnemar_exact(-1, 2)
    for bad in (1.5, True):
        with pytest.raises(TypeError, match="gained must be an integer >= 0"):
            mcnemar_exact(2, bad)


def test_paired_comparison_counts_lost_and_gained_cases_in_order():
    reference = {"a": True, "b": True, "c": False, "d": False, "e": True}
    other = {"e": False, "d": True, "c": False, "b": True, "a": False}
    result = paired_comparison(reference, other)
    assert result == PairedComparison(
        cases=5, reference_correct=3, other_correct=2, lost=("a", "e"), gained=("d",), p_value=mcnemar_exact(2, 1)
    )
    assert paired_comparison(other, reference).lost == ("d",)
    with pytest.raises(ValueError, match="different cases"):
        paired_comparison(reference, {**other, "f": True})
    with pytest.raises(ValueError, match="no case"):
        paired_comparison({}, {})
    with pytest.raises(TypeError, match="verdicts must be bools"):
        paired_comparison(reference, {**other, "a": 1})
