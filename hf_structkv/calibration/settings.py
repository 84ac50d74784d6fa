"""`CalibrationSettings`: what a calibration run is parameterised by (validated once, recorded in the card)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..policy.costs import check_group_count
from ..policy.table import DEFAULT_SINK_TOKENS, DEFAULT_WINDOW
from ..quant.int4_centred import check_int4_keys
from ..structure.tags import TAG_VIEWS
from ..validation import check_int
from .floors import DEFAULT_THRESHOLDS, check_thresholds
from .reserve import DEFAULT_RESERVE_HORIZON, DEFAULT_RESERVE_QUANTILE

__all__ = ["SENSITIVITIES", "STAGES", "STAGE_CHOICES", "CalibrationSettings", "settings_json"]

SENSITIVITIES = ("verdict", "likelihood", "replayed_verdict")

STAGES = ("decode", "prefill")
STAGE_CHOICES = (("decode", "prefill"), ("decode",), ("prefill",))
"""Both stages, the decode table only, or the prefill companion only (it runs with decode all-high either way)."""


@dataclass(frozen=True)
class CalibrationSettings:
    """What a calibration run is parameterised by (all recorded in the card).

    Attributes:
        max_new_tokens: generation cap of every run (reference, interventions, development).
        window, sink_tokens: the recent window and sinks of the calibrated table (and of every run).
        thresholds: the threshold pairs ``τ = (τ_low, τ_high)``, one greedy path each.
        alpha_decode, alpha_prefill: development tolerances ``α_D``, ``α_P``.
        reserve_horizon, reserve_quantile: ``K`` and ``β`` of the reserve.
        max_dev_candidates: candidates evaluated per path, by bisection (`search_path`); ``None`` = all.
        stages: one of `STAGE_CHOICES`: ``("decode", "prefill")``, ``("decode",)`` or ``("prefill",)``. The prefill
            stage holds decode all-high (D.8), so it can be calibrated on its own and served next to any decode table.
        tag_view: what the parser tells the cache in every run and the calibrated table (`TAG_VIEWS`): ``"full"``,
            or a structural ablation of PASK Fig. 5 (``"no_role"``, ``"no_class"``, ``"no_state_lookahead"``, or
            ``"position_bins"``: no parser transitions, each token tagged by its position bin, the bins made from the
            calibration references' lengths by `position_bin_starts`).
        layer_groups: 3 (A.2), or 1 for the Fig. 5 "no layer groups" ablation: one bucket per tag covering every
            layer, so a token's action is tied across depth (decode stage only: the prefill companion keeps 3).
        seed: seeds torch (greedy decoding is deterministic; the split seed is the caller's).
        sensitivity: ``"verdict"`` (PASK §3.4: Runtime-V by generation and the task's verdict, development selection
            by verdicts) or ``"likelihood"`` (teacher-forced likelihood loss of the reference replies,
            `calibration.likelihood`; development selection by likelihood, confirmed by verdicts). The thresholds and
            tolerances are read on the same scale in both (a likelihood loss of 1 is one lost case).
            ``"replayed_verdict"``: the verdicts of ``"verdict"``, each intervention replayed first and generated
            only where its greedy reply changes (`calibration.replayed_verdicts`); selection as ``"verdict"``.
        max_confirmations: with ``"likelihood"``, how many candidates passing by likelihood (cheapest first) are
            confirmed by development verdicts before the all-high fallback.
        curve_pairs: with ``"likelihood"``, how many of each stage's Runtime-V interventions are also generated and
            scored, to fit the `LossCurve` that reads development likelihood losses as an expected change of the
            error rate (`calibration.loss_curve`); verdicts already in the cache folder join them.
        int4_keys: the INT4 key layout of the ``L`` action (`hf_structkv.quant.int4_centred`), ``"row"`` (PASK B.5),
            ``"centred"`` or ``"centred-g128"``: every intervention, Runtime-D round trip, development run and replay
            stores its ``L`` keys so, the calibrated policies record it (their ``quantizer``), and the on-disk stores
            of each layout are keyed apart (the all-high references, which lower nothing, are shared).
    """

    max_new_tokens: int = 128
    window: int = DEFAULT_WINDOW
    sink_tokens: int = DEFAULT_SINK_TOKENS
    thresholds: tuple[tuple[float, float], ...] = DEFAULT_THRESHOLDS
    alpha_decode: float = 0.05
    alpha_prefill: float = 0.02
    reserve_horizon: int = DEFAULT_RESERVE_HORIZON
    reserve_quantile: float = DEFAULT_RESERVE_QUANTILE
    max_dev_candidates: int | None = None
    stages: tuple[str, ...] = STAGES
    seed: int = 0
    tag_view: str = "full"
    layer_groups: int = 3
    sensitivity: str = "verdict"
    max_confirmations: int = 3
    curve_pairs: int = 96
    int4_keys: str = "row"

    def __post_init__(self) -> None:
        object.__setattr__(self, "thresholds", check_thresholds(self.thresholds))
        check_int("max_new_tokens", self.max_new_tokens, 1)
        check_int("window", self.window, 1)
        check_int("sink_tokens", self.sink_tokens, 0)
        for name in ("alpha_decode", "alpha_prefill"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        if tuple(self.stages) not in STAGE_CHOICES:
            raise ValueError(f"stages must be one of {STAGE_CHOICES}, got {self.stages!r}")
        object.__setattr__(self, "stages", tuple(self.stages))
        check_int("max_dev_candidates", self.max_dev_candidates, 1, none_ok=True)
        if self.tag_view not in TAG_VIEWS:
            raise ValueError(f"tag_view must be one of {TAG_VIEWS}, got {self.tag_view!r}")
        check_group_count(self.layer_groups)
        if self.sensitivity not in SENSITIVITIES:
            raise ValueError(f"sensitivity must be one of {SENSITIVITIES}, got {self.sensitivity!r}")
        check_int("max_confirmations", self.max_confirmations, 1)
        check_int("curve_pairs", self.curve_pairs, 1)
        check_int4_keys(self.int4_keys)
        if self.layer_groups != 3 and "prefill" in self.stages:
            raise ValueError(
                "layer_groups=1 (the no-layer-groups ablation) calibrates the decode table only: pass "
                "stages=('decode',) (CLI: --decode-only)"
            )
        if self.tag_view != "full" and "decode" not in self.stages:
            raise ValueError(
                f"tag_view={self.tag_view!r} is an ablation of the decode table; a prefill-only run "
                "(stages=('prefill',)) uses tag_view='full'"
            )


def settings_json(settings: CalibrationSettings) -> dict[str, Any]:
    """``settings`` as the report and the cards record them (JSON lists for the tuples)."""
    values = {name: getattr(settings, name) for name in settings.__dataclass_fields__}
    values["thresholds"] = [list(pair) for pair in settings.thresholds]
    values["stages"] = list(settings.stages)
    return values
