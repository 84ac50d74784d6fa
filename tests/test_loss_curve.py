"""The loss curve (`calibration.loss_curve`): isotonic regression against its closed form, the expected error change
by hand, and the stratified sample of interventions."""

from __future__ import annotations

import random

import pytest

from hf_structkv.calibration.loss_curve import LOSS_BINS, LossCurve, StepCurve, isotonic_fit, sample_interventions


def closed_form_isotonic(xs, ys):
    """The isotonic regression at each distinct x: ``max_{j <= i} min_{k >= i} mean(y over x_j .. x_k)``."""
    distinct = sorted(set(xs))
    groups = [[y for x, y in zip(xs, ys, strict=True) if x == value] for value in distinct]

    def mean(j, k):
        values = [y for group in groups[j : k + 1] for y in group]
        return sum(values) / len(values)

    n = len(distinct)
    return {distinct[i]: max(min(mean(j, k) for k in range(i, n)) for j in range(i + 1)) for i in range(n)}


@pytest.mark.parametrize("seed", range(8))
def test_isotonic_fit_equals_the_closed_form(seed):
    rng = random.Random(seed)
    xs = [rng.choice([-0.5, 0.0, 0.05, 0.1, 0.3, 0.6, 0.9, 1.0]) for _ in range(rng.randint(1, 14))]
    ys = [float(rng.random() < 0.5) for _ in xs]
    curve = isotonic_fit(xs, ys)
    for x, want in closed_form_isotonic(xs, ys).items():
        assert curve(x) == pytest.approx(want)
    assert list(curve.values) == sorted(curve.values)


def test_step_curve_holds_its_value_between_starts_and_below_the_first():
    curve = StepCurve((0.0, 0.5), (0.1, 0.7))
    assert [curve(x) for x in (-1.0, 0.0, 0.49, 0.5, 1.0)] == [0.1, 0.1, 0.1, 0.7, 0.7]


def test_isotonic_fit_pools_violators():
    curve = isotonic_fit([0.0, 0.1, 0.2, 0.3], [0.0, 1.0, 0.0, 1.0])
    assert curve.starts == (0.0, 0.1, 0.3) and curve.values == (0.0, 0.5, 1.0)


def test_error_change_by_hand():
    # valid references lose 0 below a loss of 0.6 (the observed step) and 1 from it; an invalid one is gained half
    # the time from 0.2
    pairs = [(0.1, True, True), (0.6, True, False), (0.0, False, False), (0.2, False, True), (0.3, False, False)]
    curve = LossCurve.fit(pairs)
    assert curve.lost(0.4) == 0.0 and curve.lost(0.9) == 1.0
    assert curve.gained(0.1) == 0.0 and curve.gained(0.25) == 0.5
    # cases: valid at 0.7 (+1), valid at 0.1 (0), invalid at 0.9 (-0.5), valid at 0.5 (0: below the step)
    assert curve.error_change([0.7, 0.1, 0.9, 0.5], [True, True, False, True]) == pytest.approx(0.5 / 4)
    assert curve.to_json()["pairs"] == [list(p) for p in pairs]


def test_without_invalid_references_gains_never_count():
    curve = LossCurve.fit([(0.1, True, True), (0.9, True, False)])
    assert curve.gained is None
    assert curve.error_change([0.95, 0.95], [False, True]) == pytest.approx(0.5)


def test_without_valid_references_a_loss_counts_as_itself():
    curve = LossCurve.fit([(0.3, False, True)])
    assert curve.lost is None and curve.to_json()["lost"] is None
    assert curve.error_change([0.4, -0.2, 0.35], [True, True, False]) == pytest.approx((0.4 + 0.0 - 1.0) / 3)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="as many ys as xs"):
        isotonic_fit([], [])
    with pytest.raises(ValueError, match="one reference verdict per loss"):
        LossCurve.fit([(0.1, True, True)]).error_change([0.1], [True, False])
    with pytest.raises(ValueError, match="count must be >= 0"):
        sample_interventions([0.1], -1, 0)
    with pytest.raises(ValueError, match="bins must be ascending"):
        sample_interventions([0.1], 1, 0, bins=(0.5, 0.1))


def test_sample_takes_the_bins_in_turn_without_repeats():
    losses = [0.0] * 50 + [0.03] * 5 + [0.5] * 2 + [0.95]
    chosen = sample_interventions(losses, 8, seed=3)
    assert len(chosen) == len(set(chosen)) == 8
    bins = [max(i for i, edge in enumerate(LOSS_BINS) if losses[c] >= edge) for c in chosen]
    # four non-empty bins (< 0.01, 0.01-0.05, 0.4-0.7, >= 0.7): one from each, the three left, then the first again
    assert bins == [0, 1, 5, 6, 0, 1, 5, 0]
    assert sample_interventions(losses, 8, seed=3) == chosen  # seeded
    assert sorted(sample_interventions(losses, 100, seed=0)) == list(range(len(losses)))  # all when too few
