"""Runtime-V: task sensitivity ``V(q, a) = R̂_cal(π_{q,a}) − R̂_cal(π_ref)`` by interventions over complete
autoregressive generation, scored by the task's verdict (BFCL's AST checker in PASK §3.4; `CalibrationTask.score`),
or its likelihood counterpart ``V_lik(q, a)``, the mean likelihood loss of the reference replies under the
intervention (`likelihood`).

Each calibration case is measured under the intervention (verdict: generated, batch 1, `run_case`; only from the
first forward where it can differ from the reference, `resume`: the same generation; likelihood: replayed,
`likelihood_replayer`) unless the intervention provably reproduces the reference: a decode intervention whose bucket
has no occurrence early enough to leave the recent window before the trajectory ends (`reaches_generation`), or a
prefill intervention that lowers no prompt token (or a reference of one token). Skipped cases count with the
reference's verdict (a zero contribution to ``V``) or a zero loss.

With a store (`VerdictStore`, `LikelihoodStore`), a needed case whose measurement is stored is read instead of
measured (a resumed or repeated calibration), and each new measurement is stored as soon as it exists.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from ..policy.costs import Action, GroupCosts
from ..policy.table import PolicyTable
from .buckets import Bucket
from .intervention_store import InterventionStore
from .interventions import BucketIntervention, prefill_intervention_plan, prefill_positions, reaches_generation
from .references import CaseRun, ReferenceTrajectory, run_case
from .resume import RecordedReferences, first_changed_forward, resumed_case_run
from .task import CalibrationTask

__all__ = [
    "InterventionRuns",
    "decode_generator",
    "intervention_runs",
    "likelihood_sensitivity",
    "needs_generation",
    "prefill_generator",
    "task_sensitivity",
]

ACTIONS = (Action.L, Action.R)


@dataclass
class InterventionRuns:
    """What Runtime-V measured.

    Attributes:
        values: ``{(bucket, action): [measurement per case]}``: verdicts (skipped cases: the reference's verdict) or
            likelihood losses (skipped cases: 0.0).
        generated: ``{(bucket, action): number of cases that need a measurement}`` (measured now or read back).
        reused: how many of those were read from the store instead of measured.
        seconds: total measuring time.
    """

    values: dict[tuple[Bucket, Action], list] = field(default_factory=dict)
    generated: dict[tuple[Bucket, Action], int] = field(default_factory=dict)
    reused: int = 0
    seconds: float = 0.0


def needs_generation(reference: ReferenceTrajectory, bucket: Bucket, stage: str, sink_tokens: int, window: int) -> bool:
    """Whether an intervention on ``bucket`` can change ``reference``'s generation (else it is skipped)."""
    if stage == "decode":
        return reaches_generation(reference, bucket.key, window)
    if stage == "prefill":
        return len(reference.tokens) >= 2 and bool(prefill_positions(reference, bucket.key, sink_tokens, window))
    raise ValueError(f"stage must be 'decode' or 'prefill', got {stage!r}")


def intervention_runs(
    task: CalibrationTask,
    cases: Sequence,
    references: Sequence[ReferenceTrajectory],
    buckets: Sequence[Bucket],
    stage: str,
    measure: Callable[[object, ReferenceTrajectory, Bucket, Action], object],
    sink_tokens: int,
    window: int,
    progress: bool = False,
    store: InterventionStore | None = None,
    skipped: Callable[[ReferenceTrajectory], object] = lambda reference: reference.valid,
) -> InterventionRuns:
    """Measurements of every intervention ``(bucket, a)``, ``a ∈ {L, R}``, on every case.

    Args:
        task, cases, references: the calibration cases (``task``'s) and their reference trajectories (same order).
        measure: ``(case, reference, bucket, action) -> value`` of one intervention (a verdict: `verdict_measure`;
            a likelihood loss: `likelihood_measure`).
        store: measurements read before measuring and written after (``None``: every needed case is measured).
        skipped: the value of a case the intervention cannot change (default: the reference's verdict).
    """
    if len(cases) != len(references) or any(task.case_id(c) != r.case_id for c, r in zip(cases, references)):
        raise ValueError("cases and references must be the same cases in the same order")
    todo = [[needs_generation(ref, bucket, stage, sink_tokens, window) for ref in references] for bucket in buckets]
    runs = InterventionRuns()
    total = sum(map(sum, todo)) * len(ACTIONS)
    start = time.perf_counter()
    runs.values = {(bucket, action): [] for bucket in buckets for action in ACTIONS}
    runs.generated = {(bucket, action): sum(needed) for bucket, needed in zip(buckets, todo) for action in ACTIONS}
    with tqdm(total=total, desc=f"runtime-V ({stage})", unit="run", disable=not progress) as bar:
        for index, (case, reference) in enumerate(zip(cases, references)):  # case by case: one reference at a time
            for bucket, needed in zip(buckets, todo):
                for action in ACTIONS:
                    if not needed[index]:
                        runs.values[bucket, action].append(skipped(reference))
                        continue
                    value = None if store is None else store.get(reference, bucket, action)
                    if value is None:
                        value = measure(case, reference, bucket, action)
                        if store is not None:
                            store.put(reference, bucket, action, value)
                    else:
                        runs.reused += 1
                    runs.values[bucket, action].append(value)
                    bar.update()
    runs.seconds = time.perf_counter() - start
    return runs


def task_sensitivity(
    runs: InterventionRuns, references: Sequence[ReferenceTrajectory]
) -> dict[Bucket, dict[Action, float]]:
    """``{bucket: {Action.L: V(q, L), Action.R: V(q, R)}}``: error rate under the intervention minus the reference's."""
    reference_errors = sum(not r.valid for r in references)
    sensitivity: dict[Bucket, dict[Action, float]] = {}
    for (bucket, action), verdicts in runs.values.items():
        errors = sum(not valid for valid in verdicts)
        sensitivity.setdefault(bucket, {})[action] = (errors - reference_errors) / len(references)
    return sensitivity


def likelihood_sensitivity(runs: InterventionRuns) -> dict[Bucket, dict[Action, float]]:
    """``{bucket: {Action.L: V_lik(q, L), Action.R: V_lik(q, R)}}``: the mean likelihood loss over the cases (skipped
    cases 0)."""
    sensitivity: dict[Bucket, dict[Action, float]] = {}
    for (bucket, action), losses in runs.values.items():
        sensitivity.setdefault(bucket, {})[action] = sum(losses) / len(losses)
    return sensitivity


def decode_generator(
    model,
    tokenizer,
    task: CalibrationTask,
    costs: GroupCosts,
    max_new_tokens: int,
    sink_tokens: int,
    window: int,
    tag_view: str = "full",
    position_bins: tuple[int, ...] = (),
    resume: bool = True,
    int4_keys: str = "row",
):
    """``generate`` for `intervention_runs` of decode buckets: the case under `BucketIntervention` (its processor
    emitting ``tag_view`` with ``position_bins``, the view the bucket keys are tags of; ``L`` keys stored in the
    ``int4_keys`` layout).

    With ``resume`` each intervention runs only the forwards where it can differ from the reference
    (`resumed_case_run`, the same generation): the case's reference is generated once more under the all-high policy
    to record its K/V (`RecordedReferences`), and a case it does not reproduce, or a model with sliding layers, is
    generated in full."""
    all_high = PolicyTable.all_high(model, family=task.family, window=window, sink_tokens=sink_tokens)
    recorded = RecordedReferences(model, tokenizer, task, all_high, max_new_tokens)

    def generate(case, reference: ReferenceTrajectory, bucket: Bucket, action: Action) -> CaseRun:
        policy = BucketIntervention(costs, bucket, action, sink_tokens, window, tag_view, position_bins, int4_keys)
        kv = recorded.get(case, reference) if resume else None
        if kv is None:
            return run_case(model, tokenizer, task, case, policy, max_new_tokens)[0]
        forward = first_changed_forward(reference, bucket.key, window)
        return resumed_case_run(model, tokenizer, task, case, policy, max_new_tokens, kv, forward)

    return generate


def prefill_generator(
    model, tokenizer, task: CalibrationTask, reference_policy, max_new_tokens: int, resume: bool = True
):
    """``generate`` for `intervention_runs` of prefill buckets: decode all-high (``reference_policy``), the prompt
    under `prefill_intervention_plan`; with ``resume`` from forward 1 (the prompt forward is the reference's)."""
    recorded = RecordedReferences(model, tokenizer, task, reference_policy, max_new_tokens)

    def generate(case, reference: ReferenceTrajectory, bucket: Bucket, action: Action) -> CaseRun:
        plan = prefill_intervention_plan(
            reference, bucket, action, reference_policy.sink_tokens, reference_policy.window
        )
        kv = recorded.get(case, reference) if resume else None
        if kv is None:
            return run_case(model, tokenizer, task, case, reference_policy, max_new_tokens, prefill_plan=plan)[0]
        return resumed_case_run(
            model, tokenizer, task, case, reference_policy, max_new_tokens, kv, 1, prefill_plan=plan
        )

    return generate
