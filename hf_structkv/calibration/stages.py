"""One stage of Algorithm 1 (the decode table or the prefill companion): its buckets, its intervened generations,
its candidates and their development evaluation (`Stage`, made by `decode_stage` / `prefill_stage`), and the run
that goes from Runtime-V and Runtime-D to the selected candidate (`run_stage`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from ..policy.costs import Action
from ..structure.prompt_spans import PROMPT_LABELS
from .buckets import Bucket, bucket_order
from .candidates import decode_candidate, prefill_candidate
from .development_store import DevelopmentStore, candidate_digest
from .distortion import DistortionStore, attention_distortion, capture_reference_states
from .floors import envelope, protection_floors
from .interventions import occurrences, prefill_positions
from .likelihood import DevelopmentReplay, likelihood_measure
from .loss_curve import LossCurve, sample_interventions
from .path import greedy_path, upgrade_priorities
from .replayed_verdicts import FlipGate, GatedVerdicts, ReplayedDevelopment
from .selection import DevResult, evaluate_controller, search_path, select_cheapest
from .task import CalibrationTask
from .task_sensitivity import (
    ACTIONS,
    decode_generator,
    intervention_runs,
    likelihood_sensitivity,
    needs_generation,
    prefill_generator,
    task_sensitivity,
)
from .verdicts import VerdictStore

__all__ = ["Stage", "StageInputs", "decode_stage", "prefill_stage", "replayed_counts", "run_stage", "stage_runtime_v"]


@dataclass
class Stage:
    """What differs between the decode and the prefill stage.

    Attributes:
        name: ``"decode"`` or ``"prefill"``.
        buckets, mean_counts: the stage's buckets and their mean occurrence counts ``N̄`` per reference.
        measure: ``(case, reference, bucket, action) -> value`` of one intervention (`intervention_runs`): its
            verdict (generated, or replayed and generated where the reply changes), or its likelihood loss
            (``settings.sensitivity``).
        build: ``(actions, floors, priorities, tau) -> candidate`` (a `PolicyTable` or a `PrefillPolicy`).
        evaluate: ``(candidate, progress bar, store) -> DevResult`` on the development cases: generated and scored
            (verdicts; replayed verdicts: generated where the candidate's replay flips), or replayed (likelihood:
            ``error_rate`` is the mean likelihood loss).
        confirm: with likelihood sensitivity, the verdict evaluation that confirms a candidate the likelihood
            selected; ``None`` with verdicts.
        verdict: with likelihood sensitivity, ``() -> measure`` of one intervention's verdict (the loss curve's
            pairs); ``None`` with verdicts.
        cost, nominal: the measured cost of a `DevResult` and the nominal budget of a candidate.
        alpha: the development tolerance.
    """

    name: str
    buckets: list[Bucket]
    mean_counts: dict[Bucket, float]
    measure: Callable
    build: Callable
    evaluate: Callable[[Any, bool, DevelopmentStore | None], DevResult]
    confirm: Callable[[Any, bool, DevelopmentStore | None], DevResult] | None
    verdict: Callable[[], Callable] | None
    cost: Callable[[DevResult], float]
    nominal: Callable[[Any], float]
    alpha: float

    @property
    def by_likelihood(self) -> bool:
        return self.confirm is not None


@dataclass(frozen=True)
class StageInputs:
    """What both stages are built from.

    Attributes:
        model, tokenizer, task: the calibrated model and the task.
        development: the development cases; dev_replay: their likelihood replay (`DevelopmentReplay`).
        refs: the calibration cases' reference trajectories; reference: the all-high table of the calibration's view.
        costs: the model's layer-group costs; settings: the `CalibrationSettings`; fingerprint: the model's.
    """

    model: Any
    tokenizer: Any
    task: CalibrationTask
    development: Sequence[Any]
    dev_replay: DevelopmentReplay
    refs: Sequence[Any]
    reference: Any
    costs: Any
    settings: Any
    fingerprint: Any


def decode_stage(inputs: StageInputs, view: dict[str, Any]) -> Stage:
    """The decode stage: one bucket per (tag key on the references, layer group); candidates are ``task``'s family
    tables of ``view`` (tag view, position bins and INT4 key layout), evaluated with decode under the candidate
    (generated, or replayed by ``dev_replay`` with likelihood sensitivity). ``inputs.reference``: the all-high table
    of ``view``."""
    keys = sorted({key for r in inputs.refs for tags in r.tags if tags for key in tags})
    groups = len(inputs.costs.groups)
    buckets = [Bucket(key, c, groups) for key in keys for c in range(groups)]
    counts = {b: sum(len(occurrences(r, b.key)) for r in inputs.refs) / len(inputs.refs) for b in buckets}

    def build(actions, floors, priorities, tau):
        return decode_candidate(
            actions,
            floors,
            priorities,
            inputs.refs,
            inputs.costs,
            inputs.settings.reserve_horizon,
            inputs.settings.reserve_quantile,
            sink_tokens=inputs.settings.sink_tokens,
            window=inputs.settings.window,
            fingerprint=inputs.fingerprint,
            thresholds={"tau_low": tau[0], "tau_high": tau[1]},
            family=inputs.task.family,
            **view,
        )

    def generate_and_score(table, progress, store, replayed=None):
        return evaluate_controller(
            inputs.model,
            inputs.tokenizer,
            inputs.task,
            inputs.development,
            table,
            inputs.settings.max_new_tokens,
            progress=progress,
            store=store,
            replayed=replayed,
        )

    def replay(table, progress, store):
        return inputs.dev_replay(table, None, progress)

    measure, evaluate, confirm, verdict = _by_sensitivity(
        inputs.settings,
        lambda: likelihood_measure(inputs.model, inputs.costs, "decode", inputs.reference),
        lambda: FlipGate(inputs.model, inputs.tokenizer, inputs.task, inputs.costs, "decode", inputs.reference),
        lambda: _replayed_development(inputs),
        replay,
        lambda: decode_generator(
            inputs.model,
            inputs.tokenizer,
            inputs.task,
            inputs.costs,
            inputs.settings.max_new_tokens,
            inputs.settings.sink_tokens,
            inputs.settings.window,
            **view,
        ),
        generate_and_score,
    )
    return Stage(
        name="decode",
        buckets=buckets,
        mean_counts=counts,
        measure=measure,
        build=build,
        evaluate=evaluate,
        confirm=confirm,
        verdict=verdict,
        cost=lambda result: result.decode_ratio,
        nominal=lambda table: table.budget,
        alpha=inputs.settings.alpha_decode,
    )


def prefill_stage(inputs: StageInputs) -> Stage:
    """The prefill stage (decode held at the all-high ``inputs.reference``): one bucket per (prompt label lowered on
    some reference, layer group); candidates are `PrefillPolicy` objects, evaluated as ``prefill_policy``."""

    def positions(r, label):
        return prefill_positions(r, label, inputs.settings.sink_tokens, inputs.settings.window)

    labels = [label for label in PROMPT_LABELS if any(positions(r, label) for r in inputs.refs)]
    buckets = [Bucket(label, c) for label in labels for c in range(len(inputs.costs.groups))]
    counts = {b: sum(len(positions(r, b.key)) for r in inputs.refs) / len(inputs.refs) for b in buckets}

    def build(actions, floors, priorities, tau):
        return prefill_candidate(
            actions,
            floors,
            priorities,
            inputs.refs,
            inputs.costs,
            inputs.settings.sink_tokens,
            inputs.settings.window,
            fingerprint=inputs.fingerprint,
            thresholds={"tau_low": tau[0], "tau_high": tau[1]},
            int4_keys=inputs.settings.int4_keys,
        )

    def generate_and_score(policy, progress, store, replayed=None):
        return evaluate_controller(
            inputs.model,
            inputs.tokenizer,
            inputs.task,
            inputs.development,
            inputs.reference,
            inputs.settings.max_new_tokens,
            prefill_policy=policy,
            progress=progress,
            store=store,
            replayed=replayed,
        )

    def replay(policy, progress, store):
        return inputs.dev_replay(inputs.reference, policy, progress)

    measure, evaluate, confirm, verdict = _by_sensitivity(
        inputs.settings,
        lambda: likelihood_measure(inputs.model, inputs.costs, "prefill", inputs.reference),
        lambda: FlipGate(inputs.model, inputs.tokenizer, inputs.task, inputs.costs, "prefill", inputs.reference),
        lambda: _replayed_development(inputs),
        replay,
        lambda: prefill_generator(
            inputs.model, inputs.tokenizer, inputs.task, inputs.reference, inputs.settings.max_new_tokens
        ),
        generate_and_score,
    )
    return Stage(
        name="prefill",
        buckets=buckets,
        mean_counts=counts,
        measure=measure,
        build=build,
        evaluate=evaluate,
        confirm=confirm,
        verdict=verdict,
        cost=lambda result: result.prefill_ratio,
        nominal=lambda policy: policy.budget,
        alpha=inputs.settings.alpha_prefill,
    )


def stage_runtime_v(stage: Stage, task: CalibrationTask, cases, refs, settings, progress, store):
    """Runtime-V of ``stage`` on ``cases`` (their ``refs``): every needed intervention measured, or read from
    ``store`` (`intervention_runs`; cases an intervention cannot change count as the reference's verdict or a zero
    loss)."""
    return intervention_runs(
        task,
        cases,
        refs,
        stage.buckets,
        stage.name,
        stage.measure,
        settings.sink_tokens,
        settings.window,
        progress,
        store=store,
        **({"skipped": _zero_loss} if stage.by_likelihood else {}),
    )


def run_stage(
    stage: Stage,
    task: CalibrationTask,
    calibration,
    refs,
    reference_error,
    settings,
    model,
    costs,
    progress,
    log,
    store,
    dev_store,
    distortion_store: DistortionStore | None = None,
    verdict_store: VerdictStore | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Runtime-V (measurements read from / written to ``store`` when given), Runtime-D (per reference, read from /
    written to ``distortion_store``), priorities, one greedy path per τ, development selection of one stage (generated
    development cases read from / written to ``dev_store``).

    With likelihood sensitivity ``settings.curve_pairs`` Runtime-V interventions are also generated and scored
    (verdicts read from / written to ``verdict_store``) to fit the stage's `LossCurve`; the candidates are selected by
    the expected change of the development error rate it reads from their development likelihood losses, and the
    cheapest passing ones, in cost order, are confirmed by the task's verdicts on the development cases (at most
    ``settings.max_confirmations``): the first within ``alpha`` of the reference's error rate is selected.

    Returns:
        ``(selected candidate or None for the all-high fallback, the stage's report)``.
    """
    runs = stage_runtime_v(stage, task, calibration, refs, settings, progress, store)
    sensitivity = likelihood_sensitivity(runs) if stage.by_likelihood else task_sensitivity(runs, refs)
    distortion = attention_distortion(
        refs,
        stage.buckets,
        stage.name,
        costs,
        settings.sink_tokens,
        settings.window,
        lambda r: capture_reference_states(model, r),
        distortion_store,
        settings.int4_keys,
    )
    priorities = upgrade_priorities(distortion, stage.mean_counts, costs)
    started = time.perf_counter()
    curve = _loss_curve(stage, calibration, refs, runs, settings, progress, verdict_store)
    curve_seconds = time.perf_counter() - started

    def error_change(result: DevResult) -> float:
        """The candidate's error rate above the reference's: read by the loss curve from likelihood losses."""
        if curve is not None:
            return curve.error_change(result.losses, result.reference_valid)
        return result.error_rate - reference_error

    evaluated: dict[str, tuple[Any, DevResult, dict]] = {}
    paths = []
    for tau in settings.thresholds:
        floors = protection_floors(sensitivity, tau)
        path = greedy_path(floors, priorities)
        candidates = [stage.build(actions, floors, priorities, tau) for actions in path]
        evaluated_here = _search_candidates(
            stage, candidates, tau, settings, evaluated, error_change, reference_error, progress, log, dev_store
        )
        paths.append(
            {
                "tau": list(tau),
                "floors": {str(b): a.name for b, a in sorted(floors.items())},
                "upgrades": [_upgrade(path[i], path[i + 1]) for i in range(len(path) - 1)],
                "nominal_budgets": [stage.nominal(c) for c in candidates],
                "evaluated": evaluated_here,
            }
        )
    rows = list(evaluated.values())
    candidate_costs, errors = [stage.cost(r) for _, r, _ in rows], [r.error_rate for _, r, _ in rows]
    confirmations: list[dict[str, Any]] = []
    if stage.by_likelihood:
        changes = [error_change(r) for _, r, _ in rows]
        choice = _confirmed(
            stage, rows, candidate_costs, changes, reference_error, settings, progress, log, dev_store, confirmations
        )
    else:
        choice = select_cheapest(candidate_costs, errors, reference_error, stage.alpha)
    report = {
        "sensitivity": settings.sensitivity,
        "buckets": {
            str(b): {
                "V": {a.name: sensitivity[b][a] for a in (Action.L, Action.R)},
                "V_envelope": dict(zip(("L", "R"), envelope(sensitivity[b][Action.L], sensitivity[b][Action.R]))),
                "D": {a.name: distortion[b][a] for a in (Action.L, Action.R)},
                "mean_count": stage.mean_counts[b],
                "priorities": {"R->L": priorities[b][0], "L->H": priorities[b][1]},
                "generated_cases": {a.name: runs.generated[b, a] for a in (Action.L, Action.R)},
            }
            for b in bucket_order(stage.buckets)
        },
        "runtime_v_seconds": round(runs.seconds, 1),
        "runtime_v_generations": sum(runs.generated.values()),
        "runtime_v_reused": runs.reused,
        **replayed_counts(stage),
        "paths": paths,
        "development": [
            {
                **where,
                "nominal_budget": stage.nominal(candidate),
                **(
                    {"likelihood_loss": result.error_rate, "expected_error_change": error_change(result)}
                    if stage.by_likelihood
                    else {"accuracy": 1 - result.error_rate, "cases_from_cache": result.reused}
                ),
                "measured_ratio": stage.cost(result),
            }
            for candidate, result, where in rows
        ],
        **(
            {"confirmations": confirmations, "loss_curve": {**curve.to_json(), "seconds": round(curve_seconds, 1)}}
            if stage.by_likelihood
            else {}
        ),
        "alpha": stage.alpha,
        "reference_development_accuracy": 1 - reference_error,
    }
    if choice is None:
        report["selected"] = "all-high fallback"
        return None, report
    candidate, result, where = rows[choice]
    if stage.by_likelihood:
        confirmed = confirmations[-1]
        keys = ("likelihood_loss", "expected_error_change", "accuracy", "measured_ratio")
        report["selected"] = {**where, **{k: confirmed[k] for k in keys}}
    else:
        report["selected"] = {**where, "accuracy": 1 - result.error_rate, "measured_ratio": stage.cost(result)}
    return candidate, report


def _by_sensitivity(settings, likelihood, gate, development_gate, replay, generator, generate_and_score):
    """A stage's ``(measure, evaluate, confirm, verdict)`` for ``settings.sensitivity``: likelihood (``likelihood()``'s
    measure, candidates replayed, confirmed by generation, ``generator()``'s verdicts for the loss curve made on first
    use), verdicts (``generator()``'s runs scored, candidates generated) or replayed verdicts (the same, generated
    only where ``gate()``, a `FlipGate`, or ``development_gate()``, a `ReplayedDevelopment`, says the reply may
    change)."""
    if settings.sensitivity == "likelihood":
        return likelihood(), replay, generate_and_score, lambda: _verdict_measure(generator())
    if settings.sensitivity == "replayed_verdict":
        development = development_gate()

        def evaluate(candidate, progress, store):
            return generate_and_score(candidate, progress, store, replayed=development)

        return GatedVerdicts(gate(), generator()), evaluate, None, None
    return _verdict_measure(generator()), generate_and_score, None, None


def _replayed_development(inputs: StageInputs) -> ReplayedDevelopment:
    """The development cases' replay gate of a stage (its references are the development replay's)."""
    dev_replay = inputs.dev_replay
    return ReplayedDevelopment(inputs.tokenizer, inputs.task, dev_replay.references, dev_replay.prompts)


def replayed_counts(stage: Stage) -> dict[str, dict[str, int]]:
    """``{"runtime_v_replayed": GatedVerdicts.counts()}`` for a stage measured by replayed verdicts, else ``{}``."""
    return {"runtime_v_replayed": stage.measure.counts()} if isinstance(stage.measure, GatedVerdicts) else {}


def _verdict_measure(generate):
    """``measure`` for `intervention_runs` from a ``generate`` of `CaseRun` objects: the run's verdict."""

    def measure(case, reference, bucket, action) -> bool:
        return generate(case, reference, bucket, action).valid

    return measure


def _zero_loss(reference) -> float:
    """The likelihood loss of a case an intervention cannot change."""
    return 0.0


def _confirmed(stage, rows, costs, changes, reference_error, settings, progress, log, dev_store, confirmations):
    """The index of the cheapest candidate whose expected error change (``changes``, from the loss curve) is within
    ``alpha`` that the task's verdicts confirm (error rate within ``alpha`` of the reference's), trying at most
    ``settings.max_confirmations`` of them in cost order; ``None`` when none is confirmed. Appends one record per
    confirmation to ``confirmations``."""
    passing = [i for i, change in enumerate(changes) if change <= stage.alpha + 1e-12]
    for index in sorted(passing, key=lambda i: (costs[i], i))[: settings.max_confirmations]:
        candidate, likelihood, where = rows[index]
        verdicts = stage.confirm(candidate, progress, dev_store)
        passed = verdicts.error_rate - reference_error <= stage.alpha + 1e-12
        confirmations.append(
            {
                **where,
                "likelihood_loss": likelihood.error_rate,
                "expected_error_change": changes[index],
                "accuracy": 1 - verdicts.error_rate,
                "measured_ratio": stage.cost(verdicts),
                "passed": passed,
                "cases_from_cache": verdicts.reused,
            }
        )
        log(
            f"{stage.name} confirmation of tau={where['tau']} candidate {where['index']}: dev accuracy "
            f"{1 - verdicts.error_rate:.3f} (all-high {1 - reference_error:.3f}), measured {stage.cost(verdicts):.3f}"
            f" -> {'selected' if passed else 'rejected'}"
        )
        if passed:
            return index
    return None


def _search_candidates(
    stage, candidates, tau, settings, evaluated, error_change, reference_error, progress, log, dev_store
) -> list[int]:
    """`search_path` over one path's ``candidates``: each evaluated candidate (or read back from ``evaluated``, keyed
    by `candidate_digest`, filled here) passes when ``error_change`` of its result is within ``alpha``; returns the
    indices evaluated."""
    measured = "dev likelihood loss" if stage.by_likelihood else "dev accuracy"

    def passes(index: int) -> bool:
        candidate = candidates[index]
        identity = candidate_digest(candidate)
        if identity not in evaluated:
            result = stage.evaluate(candidate, progress, dev_store)
            evaluated[identity] = (candidate, result, {"tau": list(tau), "index": index})
            value = result.error_rate if stage.by_likelihood else 1 - result.error_rate
            log(
                f"{stage.name} tau={tau} candidate {index}/{len(candidates) - 1}: nominal budget "
                f"{stage.nominal(candidate):.3f}, {measured} {value:.3f}"
                + (f", expected error change {error_change(result):+.3f}" if stage.by_likelihood else "")
                + ("" if stage.by_likelihood else f" (all-high {1 - reference_error:.3f})")
                + f", measured {stage.cost(result):.3f}"
                + (f" ({result.reused} cases from the cache)" if result.reused else "")
            )
        return error_change(evaluated[identity][1]) <= stage.alpha + 1e-12

    return search_path(len(candidates), settings.max_dev_candidates, passes)


def _loss_curve(stage, calibration, refs, runs, settings, progress, verdict_store) -> LossCurve | None:
    """With likelihood sensitivity, the stage's `LossCurve`: ``settings.curve_pairs`` of the Runtime-V interventions
    in ``runs`` (those that needed a replay), sampled over loss bins (`sample_interventions`, ``settings.seed``), each
    generated and scored too (verdicts read from / written to ``verdict_store``), and every other intervention whose
    verdict ``verdict_store`` already holds (e.g. from a verdict calibration of the same references); ``None`` with
    verdicts."""
    if not stage.by_likelihood:
        return None
    measured = [
        (index, bucket, action)
        for bucket in stage.buckets
        for index, reference in enumerate(refs)
        if needs_generation(reference, bucket, stage.name, settings.sink_tokens, settings.window)
        for action in ACTIONS
    ]
    losses = [runs.values[bucket, action][index] for index, bucket, action in measured]
    chosen = sample_interventions(losses, settings.curve_pairs, settings.seed)
    verdicts: dict[int, bool] = {}
    if verdict_store is not None:  # every verdict already stored joins the sample, at no cost
        for number, (index, bucket, action) in enumerate(measured):
            valid = verdict_store.get(refs[index], bucket, action)
            if valid is not None:
                verdicts[number] = valid
    verdict = None
    for number in tqdm(chosen, desc=f"loss curve ({stage.name})", unit="run", disable=not progress):
        if number not in verdicts:
            index, bucket, action = measured[number]
            verdict = verdict or stage.verdict()
            verdicts[number] = verdict(calibration[index], refs[index], bucket, action)
            if verdict_store is not None:
                verdict_store.put(refs[index], bucket, action, verdicts[number])
    return LossCurve.fit([(losses[n], refs[measured[n][0]].valid, verdicts[n]) for n in sorted(verdicts)])


def _upgrade(before: dict, after: dict) -> str:
    (bucket,) = [b for b in after if after[b] != before[b]]
    return f"{bucket}: {before[bucket].name}->{after[bucket].name}"
