"""Runtime-V verdicts generated only where an intervention changes the reply (``sensitivity="replayed_verdict"``).

The paper's task sensitivity (PASK §3.4) scores the greedy reply of every case under every intervention with the
task's verdict: one generation per ``(bucket, action, case)``, which is what makes a paper-sized calibration
unaffordable on a CPU. Most interventions do not change the greedy reply at all, and whether one does is known from
one teacher-forced forward: greedy constrained decoding under the intervention writes the reference reply unless the
masked replay flips (`greedy_flips.first_flip`, checked from the intervention's first changed forward). So
`FlipGate` replays each intervention; the verdict of a case that does not flip is the reference's, and only a case
that flips is generated (the verdict protocol's own generator, resumed from the first changed forward). The
verdicts are the generated protocol's, up to floating-point summation order at a near tie: the replay forwards the
reply in one batch where generation forwards one token at a time. A case whose all-high replay already flips (such
a tie on the reference itself) is always generated. Tests (float64): every intervention's verdict equals the
generated one.

The verdicts are stored apart from generated ones (`ReplayedVerdictStore`), in the same line format. The
development selection is gated the same way (`ReplayedDevelopment`): a candidate's development case whose replay does
not flip takes the reference's verdict and the schedule's ledger along the reference, and only the others are
generated (stored in the `DevelopmentStore` as generated cases are: the same verdict, and the ledger the generation
would measure).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..policy.costs import Action, GroupCosts
from ..policy.table import PolicyTable
from .buckets import Bucket
from .development_store import DevCase
from .greedy_flips import first_flip, reference_masks
from .likelihood import CaseReplay, PromptReplays, candidate_plan, check_stage, intervention_schedule, replay_ledger
from .references import CaseRun, ReferenceTrajectory
from .task import CalibrationTask
from .verdicts import VerdictStore

__all__ = ["FlipGate", "GatedVerdicts", "ReplayedDevelopment", "ReplayedVerdictStore"]


class FlipGate:
    """Whether a Runtime-V intervention can change a case's greedy reply: its masked teacher-forced replay flips, or
    the case's all-high replay does (module docstring). One `CaseReplay` and its grammar masks are kept, for the case
    in progress (`intervention_runs` goes case by case).

    Args:
        model: the model (switched to hf_structkv's attention); tokenizer: its tokenizer.
        task: the calibration task (its grammar processor masks the replayed rows).
        costs: the layer-group costs of the calibrated table.
        stage: ``"decode"`` or ``"prefill"``.
        all_high: the calibration's all-high policy (window, sinks, tag view and bins, INT4 key layout).

    Attributes:
        checked: interventions replayed; flipped: those whose replay flipped; noisy: those on a case whose all-high
            replay flips (counted as flipped).
    """

    def __init__(self, model, tokenizer, task: CalibrationTask, costs: GroupCosts, stage: str, all_high: PolicyTable):
        self.model, self.tokenizer, self.task = model, tokenizer, task
        self.costs, self.stage, self.all_high = costs, check_stage(stage), all_high
        self.checked = self.flipped = self.noisy = 0
        self._case: tuple[ReferenceTrajectory, CaseReplay, torch.Tensor, bool] | None = None

    def __call__(self, case, reference: ReferenceTrajectory, bucket: Bucket, action: Action) -> bool:
        """Whether ``(bucket, action)`` may change ``case``'s greedy reply (False: it writes ``reference``'s)."""
        replay, allowed, noisy = self._replay(case, reference)
        self.checked += 1
        if noisy:
            self.noisy += 1
            self.flipped += 1
            return True
        policy, plan, first = intervention_schedule(reference, bucket, action, self.stage, self.costs, self.all_high)
        flipped = first_flip(replay, replay.schedule_logits(policy, plan, first), allowed, start=first) is not None
        self.flipped += flipped
        return flipped

    def _replay(self, case, reference: ReferenceTrajectory) -> tuple[CaseReplay, torch.Tensor, bool]:
        """The case's `CaseReplay`, its grammar masks along the reference and whether its all-high replay flips
        (computed once per case)."""
        if self._case is None or self._case[0] is not reference:
            replay = CaseReplay(self.model, reference, self.all_high)
            allowed = reference_masks(replay, self.task.processor(self.tokenizer, case, self.all_high))
            self._case = reference, replay, allowed, _all_high_flips(replay, allowed)
        return self._case[1:]


class GatedVerdicts:
    """``measure`` for `intervention_runs`: the verdict of ``generate``'s run where ``gate`` says the reply may
    change, else the reference's verdict.

    Args:
        gate: a `FlipGate` (its counters say how many interventions were replayed and generated).
        generate: ``(case, reference, bucket, action) -> CaseRun`` of the verdict protocol (`decode_generator`,
            `prefill_generator`).
    """

    def __init__(self, gate: FlipGate, generate: Callable[[object, ReferenceTrajectory, Bucket, Action], CaseRun]):
        self.gate, self.generate = gate, generate

    def __call__(self, case, reference: ReferenceTrajectory, bucket: Bucket, action: Action) -> bool:
        if self.gate(case, reference, bucket, action):
            return self.generate(case, reference, bucket, action).valid
        return reference.valid

    def counts(self) -> dict[str, int]:
        """What this run measured: interventions replayed, of which generated (flipped, or on a noisy case)."""
        return {"replayed": self.gate.checked, "generated": self.gate.flipped, "generated_noisy": self.gate.noisy}


class ReplayedDevelopment:
    """Development cases of a candidate answered by replay where its greedy reply is the reference's: for
    `evaluate_controller`'s ``replayed``. A case whose masked replay under the candidate does not flip (nor its all-high
    replay: `FlipGate`'s noise rule) gets the reference's verdict and the ledger of the schedule along the reference
    (as `DevelopmentReplay` measures it); any other case is left to generation (None).

    Args:
        tokenizer, task: as `FlipGate`; references: the development `ReferenceTrajectory` objects.
        prompts: the cases' prompt forwards (`PromptReplays` of the calibration's all-high policy; a stage shares its
            `DevelopmentReplay`'s, so a case's prompt is forwarded once across candidates).

    Attributes:
        replayed: cases answered by replay; passed: cases left to generation.
    """

    def __init__(self, tokenizer, task: CalibrationTask, references, prompts: PromptReplays):
        self.tokenizer, self.task, self.prompts = tokenizer, task, prompts
        self.references = {reference.case_id: reference for reference in references}
        self.replayed = self.passed = 0
        self._noisy: dict[str, bool] = {}

    def __call__(self, case, policy, prefill_policy) -> DevCase | None:
        """The case's `DevCase` under ``policy`` / ``prefill_policy`` if its reply is the reference's, else None."""
        reference = self.references.get(self.task.case_id(case))
        if reference is None or not reference.tokens:
            raise ValueError(f"no development reference with generated tokens for case {self.task.case_id(case)}")
        replay = self.prompts(reference)
        allowed = reference_masks(replay, self.task.processor(self.tokenizer, case, policy))
        if reference.case_id not in self._noisy:
            self._noisy[reference.case_id] = _all_high_flips(replay, allowed)
        cache = replay.prompt_cache.with_schedule(policy, candidate_plan(reference, policy, prefill_policy))
        if self._noisy[reference.case_id] or first_flip(replay, replay.reply_logits(cache), allowed) is not None:
            self.passed += 1
            return None
        self.replayed += 1
        return DevCase(valid=reference.valid, **replay_ledger(cache, reference), full_bits=float(policy.costs.full))


def _all_high_flips(replay: CaseReplay, allowed: torch.Tensor) -> bool:
    """Whether the case's all-high replay already leaves its reference (a float tie: the case is always generated);
    ``allowed``: the case's `reference_masks`."""
    return first_flip(replay, replay.all_high_logits(), allowed) is not None


class ReplayedVerdictStore(VerdictStore):
    """`VerdictStore` lines of verdicts measured through a `FlipGate`, kept apart from the generated ones."""

    PREFIX = "replayed-verdicts"
