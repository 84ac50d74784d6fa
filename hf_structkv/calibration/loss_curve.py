"""The likelihood loss read on the verdict's scale: isotonic curves fitted on calibration interventions whose verdict
was generated too.

A case's likelihood loss ``ℓ`` (`likelihood`) is the share of the reference reply's probability a schedule removes.
It is a pessimistic proxy of a verdict: a reply is only lost when a greedy argmax flips and the flip breaks the call,
so a mean ``ℓ`` compared with a tolerance stated in verdicts (``α``) keeps far more than it needs (on the embedded
model the decode path's development loss was 0.10 at ``B_D = 0.81``). The development criterion is therefore the
**expected change of the development error rate**

    ``Ê = (1/n) Σ_i [r_i · lost(ℓ_i) − (1 − r_i) · gained(ℓ_i)]``

over the development cases ``i`` (``r_i`` the reference's verdict, ``ℓ_i`` the candidate's likelihood loss), where
``lost(ℓ)`` = P(a valid reference reply becomes invalid | ``ℓ``) and ``gained(ℓ)`` = P(an invalid one becomes valid |
``ℓ``) are nondecreasing step functions fitted by isotonic regression (pool adjacent violators) on **calibration**
pairs: Runtime-V interventions of the stage, sampled over ``ℓ`` bins (`sample_interventions`, seeded), each also
generated and scored by the task's verdict. ``Ê`` is compared with ``α`` as a verdict error rate is; the candidates it
passes are then confirmed by generation on the development cases, as before. Without an invalid-reference pair
``gained`` is 0 (gains never count); without a valid-reference pair ``lost(ℓ) = max(ℓ, 0)``, the loss itself.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["LOSS_BINS", "LossCurve", "StepCurve", "isotonic_fit", "sample_interventions"]

LOSS_BINS = (-1.0, 0.01, 0.05, 0.1, 0.2, 0.4, 0.7)
"""Lower edges of the ``ℓ`` bins the curve's interventions are drawn from in turn (the last bin runs to 1): most
interventions change almost nothing, so an unstratified sample would hardly see the losses where verdicts flip."""


@dataclass(frozen=True)
class StepCurve:
    """A nondecreasing step function: ``values[i]`` from ``starts[i]`` on, ``values[0]`` below ``starts[0]``."""

    starts: tuple[float, ...]
    values: tuple[float, ...]

    def __call__(self, x: float) -> float:
        return self.values[max(0, bisect.bisect_right(self.starts, x) - 1)]

    def to_json(self) -> dict[str, list[float]]:
        return {"starts": list(self.starts), "values": list(self.values)}


def isotonic_fit(xs: Sequence[float], ys: Sequence[float]) -> StepCurve:
    """The least-squares nondecreasing fit of ``ys`` on ``xs`` (pool adjacent violators; equal ``xs`` pooled first),
    as a `StepCurve` whose steps start at the smallest ``x`` of each pooled block.

    Raises:
        ValueError: empty or unequal-length inputs.
    """
    if not xs or len(xs) != len(ys):
        raise ValueError(f"isotonic_fit needs as many ys as xs, at least one; got {len(xs)} xs and {len(ys)} ys")
    points: dict[float, list[float]] = {}
    for x, y in zip(xs, ys, strict=True):
        points.setdefault(float(x), []).append(float(y))
    blocks: list[list[float]] = []  # [start, sum, count]
    for x in sorted(points):
        blocks.append([x, sum(points[x]), len(points[x])])
        while len(blocks) > 1 and blocks[-2][1] / blocks[-2][2] > blocks[-1][1] / blocks[-1][2]:
            _, total, count = blocks.pop()
            blocks[-1][1] += total
            blocks[-1][2] += count
    return StepCurve(tuple(b[0] for b in blocks), tuple(b[1] / b[2] for b in blocks))


@dataclass(frozen=True)
class LossCurve:
    """``lost`` and ``gained`` (module docstring) and the pairs they were fitted on.

    Attributes:
        lost: fitted on the pairs whose reference is valid; gained: on the others; each ``None`` without any.
        pairs: ``(ℓ, reference valid, valid under the intervention)`` per sampled intervention.
    """

    lost: StepCurve | None
    gained: StepCurve | None
    pairs: tuple[tuple[float, bool, bool], ...]

    @classmethod
    def fit(cls, pairs: Sequence[tuple[float, bool, bool]]) -> LossCurve:
        """Both curves from ``(ℓ, reference valid, valid)`` pairs."""
        kept = [(float(loss), bool(ref), bool(valid)) for loss, ref, valid in pairs]
        losing = [(loss, float(not valid)) for loss, ref, valid in kept if ref]
        gaining = [(loss, float(valid)) for loss, ref, valid in kept if not ref]
        lost = isotonic_fit(*zip(*losing, strict=True)) if losing else None
        gained = isotonic_fit(*zip(*gaining, strict=True)) if gaining else None
        return cls(lost, gained, tuple(kept))

    def error_change(self, losses: Sequence[float], reference_valid: Sequence[bool]) -> float:
        """``Ê``: the expected change of the error rate of cases with likelihood losses ``losses`` and reference
        verdicts ``reference_valid`` (same order).

        Raises:
            ValueError: no case, or the two sequences differ in length.
        """
        if not losses or len(losses) != len(reference_valid):
            raise ValueError(f"need one reference verdict per loss, got {len(losses)} losses, {len(reference_valid)}")
        change = 0.0
        for loss, valid in zip(losses, reference_valid, strict=True):
            if valid:
                change += max(loss, 0.0) if self.lost is None else self.lost(loss)
            elif self.gained is not None:
                change -= self.gained(loss)
        return change / len(losses)

    def to_json(self) -> dict[str, Any]:
        return {
            "lost": None if self.lost is None else self.lost.to_json(),
            "gained": None if self.gained is None else self.gained.to_json(),
            "pairs": [list(pair) for pair in self.pairs],
        }


def sample_interventions(
    losses: Sequence[float], count: int, seed: int, bins: Sequence[float] = LOSS_BINS
) -> list[int]:
    """Indices of at most ``count`` of the interventions whose likelihood losses are ``losses``, drawn from the
    ``bins`` (lower edges, ascending) in turn, each bin in a seeded order, until ``count`` are drawn or none is left.

    Raises:
        ValueError: ``count < 0`` or ``bins`` not ascending.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if list(bins) != sorted(bins) or not bins:
        raise ValueError(f"bins must be ascending lower edges, got {bins!r}")
    queues: list[list[int]] = [[] for _ in bins]
    for index, loss in enumerate(losses):
        queues[max(0, bisect.bisect_right(bins, loss) - 1)].append(index)
    rng = random.Random(seed)
    for queue in queues:
        rng.shuffle(queue)
    chosen: list[int] = []
    while len(chosen) < count and any(queues):
        for queue in queues:
            if queue and len(chosen) < count:
                chosen.append(queue.pop())
    return chosen
