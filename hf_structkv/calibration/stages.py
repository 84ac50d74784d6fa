"""One stage of Algorithm 1 (the decode table or the prefill companion): its buckets, its intervened generations,
its candidates and their development evaluation (`Stage`, made by `decode_stage` / `prefill_stage`), and the run
that goes from Runtime-V and Runtime-D to the selected candidate (`run_stage`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..policy.costs import Action
from ..structure.prompt_spans import PROMPT_LABELS
from .buckets import Bucket, bucket_order
from .candidates import decode_candidate, prefill_candidate
from .development_store import DevelopmentStore, candidate_digest
from .distortion import attention_distortion, capture_reference_states
from .floors import envelope, protection_floors
from .interventions import occurrences, prefill_positions
from .path import greedy_path, upgrade_priorities
from .selection import DevResult, dev_candidate_indices, evaluate_controller, select_cheapest
from .task import CalibrationTask
from .task_sensitivity import decode_generator, intervention_runs, prefill_generator, task_sensitivity

__all__ = ["Stage", "decode_stage", "prefill_stage", "run_stage"]


@dataclass
class Stage:
    """What differs between the decode and the prefill stage.

    Attributes:
        name: ``"decode"`` or ``"prefill"``.
        buckets, mean_counts: the stage's buckets and their mean occurrence counts ``N̄`` per reference.
        generate: ``(case, reference, bucket, action) -> CaseRun`` of one intervention (`intervention_runs`).
        build: ``(actions, floors, priorities, tau) -> candidate`` (a `PolicyTable` or a `PrefillPolicy`).
        evaluate: ``(candidate, progress bar, store) -> DevResult`` on the development cases.
        cost, nominal: the measured cost of a `DevResult` and the nominal budget of a candidate.
        alpha: the development tolerance.
    """

    name: str
    buckets: list[Bucket]
    mean_counts: dict[Bucket, float]
    generate: Callable
    build: Callable
    evaluate: Callable[[Any, bool, DevelopmentStore | None], DevResult]
    cost: Callable[[DevResult], float]
    nominal: Callable[[Any], float]
    alpha: float


def decode_stage(
    model, tokenizer, task: CalibrationTask, development, refs, costs, settings, fingerprint, view
) -> Stage:
    """The decode stage: one bucket per (tag key on the references, layer group); candidates are ``task``'s family
    tables of ``view`` (tag view and position bins), evaluated with decode under the candidate."""
    keys = sorted({key for r in refs for tags in r.tags if tags for key in tags})
    groups = len(costs.groups)
    buckets = [Bucket(key, c, groups) for key in keys for c in range(groups)]
    counts = {b: sum(len(occurrences(r, b.key)) for r in refs) / len(refs) for b in buckets}

    def build(actions, floors, priorities, tau):
        return decode_candidate(
            actions,
            floors,
            priorities,
            refs,
            costs,
            settings.reserve_horizon,
            settings.reserve_quantile,
            sink_tokens=settings.sink_tokens,
            window=settings.window,
            fingerprint=fingerprint,
            thresholds={"tau_low": tau[0], "tau_high": tau[1]},
            family=task.family,
            **view,
        )

    return Stage(
        name="decode",
        buckets=buckets,
        mean_counts=counts,
        generate=decode_generator(
            model, tokenizer, task, costs, settings.max_new_tokens, settings.sink_tokens, settings.window, **view
        ),
        build=build,
        evaluate=lambda table, progress, store: evaluate_controller(
            model, tokenizer, task, development, table, settings.max_new_tokens, progress=progress, store=store
        ),
        cost=lambda result: result.decode_ratio,
        nominal=lambda table: table.budget,
        alpha=settings.alpha_decode,
    )


def prefill_stage(
    model, tokenizer, task: CalibrationTask, development, refs, reference, costs, settings, fingerprint
) -> Stage:
    """The prefill stage (decode held at the all-high ``reference``): one bucket per (prompt label lowered on some
    reference, layer group); candidates are `PrefillPolicy` objects, evaluated as ``prefill_policy``."""

    def positions(r, label):
        return prefill_positions(r, label, settings.sink_tokens, settings.window)

    labels = [label for label in PROMPT_LABELS if any(positions(r, label) for r in refs)]
    buckets = [Bucket(label, c) for label in labels for c in range(len(costs.groups))]
    counts = {b: sum(len(positions(r, b.key)) for r in refs) / len(refs) for b in buckets}

    def build(actions, floors, priorities, tau):
        return prefill_candidate(
            actions,
            floors,
            priorities,
            refs,
            costs,
            settings.sink_tokens,
            settings.window,
            fingerprint=fingerprint,
            thresholds={"tau_low": tau[0], "tau_high": tau[1]},
        )

    def evaluate(policy, progress, store):
        return evaluate_controller(
            model,
            tokenizer,
            task,
            development,
            reference,
            settings.max_new_tokens,
            prefill_policy=policy,
            progress=progress,
            store=store,
        )

    return Stage(
        name="prefill",
        buckets=buckets,
        mean_counts=counts,
        generate=prefill_generator(model, tokenizer, task, reference, settings.max_new_tokens),
        build=build,
        evaluate=evaluate,
        cost=lambda result: result.prefill_ratio,
        nominal=lambda policy: policy.budget,
        alpha=settings.alpha_prefill,
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
) -> tuple[Any, dict[str, Any]]:
    """Runtime-V (verdicts read from / written to ``store`` when given), Runtime-D, priorities, one greedy path per
    τ, development selection of one stage (development cases read from / written to ``dev_store`` when given).

    Returns:
        ``(selected candidate or None for the all-high fallback, the stage's report)``.
    """
    runs = intervention_runs(
        task,
        calibration,
        refs,
        stage.buckets,
        stage.name,
        stage.generate,
        settings.sink_tokens,
        settings.window,
        progress,
        store=store,
    )
    sensitivity = task_sensitivity(runs, refs)
    distortion = attention_distortion(
        refs,
        stage.buckets,
        stage.name,
        costs,
        settings.sink_tokens,
        settings.window,
        lambda r: capture_reference_states(model, r),
    )
    priorities = upgrade_priorities(distortion, stage.mean_counts, costs)
    evaluated: dict[str, tuple[Any, DevResult, dict]] = {}
    paths = []
    for tau in settings.thresholds:
        floors = protection_floors(sensitivity, tau)
        path = greedy_path(floors, priorities)
        candidates = [stage.build(actions, floors, priorities, tau) for actions in path]
        evaluated_here = []
        for index in dev_candidate_indices(len(candidates), settings.max_dev_candidates):
            candidate = candidates[index]
            identity = candidate_digest(candidate)
            if identity not in evaluated:
                result = stage.evaluate(candidate, progress, dev_store)
                evaluated[identity] = (candidate, result, {"tau": list(tau), "index": index})
                log(
                    f"{stage.name} tau={tau} candidate {index}/{len(candidates) - 1}: nominal budget "
                    f"{stage.nominal(candidate):.3f}, dev accuracy {1 - result.error_rate:.3f} "
                    f"(all-high {1 - reference_error:.3f}), measured {stage.cost(result):.3f}"
                    + (f" ({result.reused} of {len(result.valid)} cases from the cache)" if result.reused else "")
                )
            result = evaluated[identity][1]
            evaluated_here.append(index)
            passed = result.error_rate - reference_error <= stage.alpha + 1e-12
            if settings.max_dev_candidates is not None and passed:
                break
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
    choice = select_cheapest(
        [stage.cost(r) for _, r, _ in rows], [r.error_rate for _, r, _ in rows], reference_error, stage.alpha
    )
    report = {
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
        "paths": paths,
        "development": [
            {
                **where,
                "nominal_budget": stage.nominal(candidate),
                "accuracy": 1 - result.error_rate,
                "measured_ratio": stage.cost(result),
                "cases_from_cache": result.reused,
            }
            for candidate, result, where in rows
        ],
        "alpha": stage.alpha,
        "reference_development_accuracy": 1 - reference_error,
    }
    if choice is None:
        report["selected"] = "all-high fallback"
        return None, report
    candidate, result, where = rows[choice]
    report["selected"] = {**where, "accuracy": 1 - result.error_rate, "measured_ratio": stage.cost(result)}
    return candidate, report


def _upgrade(before: dict, after: dict) -> str:
    (bucket,) = [b for b in after if after[b] != before[b]]
    return f"{bucket}: {before[bucket].name}->{after[bucket].name}"
