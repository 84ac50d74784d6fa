"""Likelihood sensitivity: how much a retention schedule lowers the teacher-forced likelihood of a case's reference
reply, on the verdict's scale.

A reference trajectory (greedy, all-high) has prompt ``x`` and reply tokens ``y_0 .. y_{T-1}`` (the stop token
included when there is one). `CaseReplay` runs the prompt once (a `TeacherForcedCache`, all-high) and then, per
schedule (a policy and an optional prefill plan), one forward over ``y_0 .. y_{T-2}`` in which every row sees the cache
as that step of ``generate`` would have seen it under the schedule (`hf_structkv.cache.teacher_forced`). This gives
``log p_π(y_k | x, y_<k)`` for ``k = 1 .. T - 1`` (``y_0`` comes from the prompt forward, which no schedule changes).

For a schedule whose first possible effect is forward ``k0`` (a decode intervention on bucket ``q``: ``i0 + window + 2``
for ``q``'s first occurrence ``i0``; a prefill plan: 1; a complete controller: 1), the **likelihood drop** of the case
is ``Δ = Σ_{k0 <= k < T} [log p_ref(y_k | ·) − log p_π(y_k | ·)]``, the log-ratio of the probabilities the all-high
cache and the schedule give to the reference reply from ``k0`` on (a sum: a reply is kept only if every token is), and
the case's **likelihood loss** is ``ℓ = clip(1 − exp(−Δ), −1, 1)``: the share of the reference reply's probability
the schedule removes. ``ℓ`` is on the verdict's scale: 0 for a schedule that changes nothing, near 1 for one that
makes the reference reply impossible (a lost case), negative when the schedule makes it more likely (bounded by −1
like a gained case). Cases a decode intervention cannot reach (`task_sensitivity.needs_generation`) are not replayed:
their loss is exactly 0. The likelihood sensitivity ``V_lik(q, a)`` is the mean loss over the calibration cases, the
counterpart of ``V(q, a)`` = (errors under the intervention − reference errors) / cases.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from ..cache.teacher_forced import TeacherForcedCache
from ..policy.costs import Action, GroupCosts
from ..policy.prefill import PrefillPolicy, plan_prefill
from ..policy.retention import RetentionPolicy
from ..policy.table import PolicyTable
from ..structure.tags import StructuralTag
from ..validation import check_int, is_int
from .buckets import Bucket
from .development_store import candidate_digest
from .intervention_store import InterventionStore
from .interventions import BucketIntervention, prefill_intervention_plan
from .jsonl_store import JsonLinesStore
from .references import ReferenceTrajectory
from .resume import first_changed_forward
from .selection import DevResult, pooled_ratios

__all__ = [
    "CaseReplay",
    "DevelopmentReplay",
    "DevelopmentReplayStore",
    "LikelihoodStore",
    "ReferenceTags",
    "candidate_plan",
    "check_stage",
    "intervention_schedule",
    "likelihood_loss",
    "likelihood_measure",
    "replay_ledger",
]


@dataclass(frozen=True)
class ReferenceTags:
    """A `TagSource` over a reference trajectory's recorded tags (batch 1): what the processor emitted in the
    reference's generation, in the view it was recorded in (``tag_view``, ``position_bins``: the policy's)."""

    reference: ReferenceTrajectory
    tag_view: str = "full"
    position_bins: tuple[int, ...] = ()

    @property
    def prompt_length(self) -> int:
        return len(self.reference.prompt_ids)

    def num_tagged(self, seq: int) -> int:
        return len(self.reference.tokens)

    def tag_at(self, seq: int, index: int) -> tuple[StructuralTag, ...] | None:
        return self.reference.candidates(index)


def likelihood_loss(reference_log_probs: torch.Tensor, log_probs: torch.Tensor, first: int) -> float:
    """``clip(1 − exp(−Δ), −1, 1)`` with ``Δ`` the summed drop of ``log_probs`` below ``reference_log_probs``
    (both ``[T]``) from token ``first`` on (module docstring); 0 when ``first >= T``."""
    if reference_log_probs.shape != log_probs.shape:
        raise ValueError(
            f"log-probability shapes differ: {tuple(reference_log_probs.shape)} vs {tuple(log_probs.shape)}"
        )
    drop = float((reference_log_probs[first:].double() - log_probs[first:].double()).sum())
    return max(-1.0, min(1.0, -math.expm1(-drop))) if drop > -700 else -1.0


class CaseReplay:
    """One reference trajectory's prompt forward, shared by the replays of every schedule on it.

    Args:
        model: the model (switched to hf_structkv's attention).
        reference: the case's `ReferenceTrajectory` (at least one generated token).
        all_high: the all-high policy of the calibration (its window, sinks, tag view and bins).
        reference_log_probs: the ``[T]`` all-high log-probabilities when already known (else computed on first use).
    """

    def __init__(
        self,
        model,
        reference: ReferenceTrajectory,
        all_high: PolicyTable,
        reference_log_probs: torch.Tensor | None = None,
    ):
        if not reference.tokens:
            raise ValueError(f"the reference of {reference.case_id} has no generated token to replay")
        self.model, self.reference, self.all_high = model, reference, all_high
        self.tags = ReferenceTags(reference, all_high.tag_view, tuple(all_high.position_bins))
        self.prompt_cache = TeacherForcedCache(model, all_high, self.tags)
        device = model.device
        self.tokens = torch.tensor([list(reference.prompt_ids) + list(reference.tokens)], device=device)
        prompt = len(reference.prompt_ids)
        with torch.no_grad():
            logits = model(input_ids=self.tokens[:, :prompt], cache=self.prompt_cache, use_cache=True).logits
        self.first_log_prob = torch.log_softmax(logits[0, -1].float(), -1)[reference.tokens[0]].reshape(1)
        self._reference_log_probs = reference_log_probs
        self._reference_cache: TeacherForcedCache | None = None

    def log_probs(
        self, policy: RetentionPolicy, prefill_plan: torch.Tensor | None = None, first: int = 1
    ) -> torch.Tensor:
        """``[T]`` FP32 log-probabilities of the reference's generated tokens under ``policy`` and ``prefill_plan``
        (teacher-forced, one forward).

        ``first``: the schedule's first changed forward (`first_changed_forward`; the caller states it). From
        ``first >= 2`` on, the replay restarts from the all-high reference replay's first ``P + first − 1`` tokens
        and forwards only the rest; the entries before ``first`` are then the reference's. Without that restart
        (sliding-window layers) it forwards every generated token after the shared prompt."""
        if first < 1:
            raise ValueError(f"first must be >= 1 (forward 0 is the shared prompt forward), got {first}")
        length = len(self.reference.tokens)
        if first == 1 or not self.prompt_cache.resumes_past_prompt:
            return self.log_probs_in(self.prompt_cache.with_schedule(policy, prefill_plan))
        if first >= length:
            return self.reference_log_probs
        reference_cache = self._reference_replay()
        keep = len(self.reference.prompt_ids) + first - 1
        cache = reference_cache.with_schedule(policy, prefill_plan, keep=keep)
        return torch.cat([self.reference_log_probs[:first], self._forward(cache, keep)])

    def schedule_logits(
        self, policy: RetentionPolicy, prefill_plan: torch.Tensor | None = None, first: int = 1
    ) -> torch.Tensor:
        """``[T − first, V]`` FP32 logits of reply steps ``first .. T − 1`` under ``policy`` and ``prefill_plan``,
        replayed as `log_probs` replays them: from ``first >= 2`` on, from the all-high reference replay's first
        ``P + first − 1`` tokens (the steps before ``first`` are the reference replay's, which the caller states
        the schedule does not change)."""
        if first < 1:
            raise ValueError(f"first must be >= 1 (forward 0 is the shared prompt forward), got {first}")
        if first >= len(self.reference.tokens):
            return torch.empty(0, self.model.config.vocab_size, device=self.tokens.device)
        if first == 1 or not self.prompt_cache.resumes_past_prompt:
            return self.reply_logits(self.prompt_cache.with_schedule(policy, prefill_plan))[first - 1 :]
        keep = len(self.reference.prompt_ids) + first - 1
        return self.reply_logits(self._reference_replay().with_schedule(policy, prefill_plan, keep=keep), keep)

    def log_probs_in(self, cache: TeacherForcedCache) -> torch.Tensor:
        """``[T]`` log-probabilities of the generated tokens replayed in ``cache`` (a `with_schedule` of the prompt)."""
        return torch.cat([self.first_log_prob, self._forward(cache, len(self.reference.prompt_ids))])

    def reply_logits(self, cache: TeacherForcedCache, start: int | None = None) -> torch.Tensor:
        """``[n − start − 1, V]`` FP32 logits predicting tokens ``start + 1 ..`` of the ``n`` prompt and reply tokens,
        forwarding tokens ``start .. n − 2`` in ``cache``, which holds the first ``start`` (default: the prompt, as
        a `TeacherForcedCache.with_schedule` of `prompt_cache` does; the rows then predict reply tokens ``1 ..``)."""
        start = len(self.reference.prompt_ids) if start is None else start
        if self.tokens.shape[1] <= start + 1:
            return torch.empty(0, self.model.config.vocab_size, device=self.tokens.device)
        with torch.no_grad():
            return self.model(input_ids=self.tokens[:, start:-1], cache=cache, use_cache=True).logits[0].float()

    def _forward(self, cache: TeacherForcedCache, start: int) -> torch.Tensor:
        """``[n − start − 1]`` log-probabilities of tokens ``start + 1 ..`` (`reply_logits`)."""
        if self.tokens.shape[1] <= start + 1:
            return self.first_log_prob[:0]
        return self._token_log_probs(self.reply_logits(cache, start), start)

    def _token_log_probs(self, logits: torch.Tensor, start: int) -> torch.Tensor:
        """``[n − start − 1]`` log-probabilities of tokens ``start + 1 ..`` from their ``logits`` rows
        ``[n − start − 1, V]``."""
        rows = torch.log_softmax(logits, -1)
        return rows.gather(-1, self.tokens[0, start + 1 :].unsqueeze(-1)).squeeze(-1)

    def all_high_logits(self) -> torch.Tensor:
        """``[T − 1, V]`` FP32 logits of reply steps ``1 .. T − 1`` under the all-high policy (`schedule_logits` of
        ``all_high``). While the all-high replay has not run, this forward is that replay: its cache is kept for the
        restarts of `log_probs` and its log-probabilities become `reference_log_probs` (one forward serves both)."""
        cache = self.prompt_cache.with_schedule(self.all_high)
        rows = self.reply_logits(cache)
        if self._reference_cache is None:
            self._keep_reference_replay(cache, rows)
        return rows

    def _reference_replay(self) -> TeacherForcedCache:
        """The all-high replay's cache, holding every prompt and reply token (run once; its log-probabilities become
        `reference_log_probs`)."""
        if self._reference_cache is None:
            cache = self.prompt_cache.with_schedule(self.all_high)
            self._keep_reference_replay(cache, self.reply_logits(cache))
        return self._reference_cache

    def _keep_reference_replay(self, cache: TeacherForcedCache, rows: torch.Tensor) -> None:
        """Keep the all-high replay's ``cache`` and, unless given, its log-probabilities from its ``rows``
        ``[T − 1, V]`` (`reply_logits`)."""
        if self._reference_log_probs is None:
            chosen = self._token_log_probs(rows, len(self.reference.prompt_ids))
            self._reference_log_probs = torch.cat([self.first_log_prob, chosen])
        self._reference_cache = cache

    @property
    def reference_log_probs(self) -> torch.Tensor:
        """``[T]`` log-probabilities under the all-high policy (computed once)."""
        if self._reference_log_probs is None:
            self._reference_replay()
        return self._reference_log_probs

    def loss(self, policy: RetentionPolicy, first: int, prefill_plan: torch.Tensor | None = None) -> float:
        """The likelihood loss of ``policy`` / ``prefill_plan`` from token ``first`` on (`likelihood_loss`), replayed
        from ``first`` on (`log_probs`)."""
        return likelihood_loss(self.reference_log_probs, self.log_probs(policy, prefill_plan, max(first, 1)), first)


def likelihood_measure(model, costs: GroupCosts, stage: str, all_high: PolicyTable):
    """``measure(case, reference, bucket, action) -> loss`` for `intervention_runs`: the likelihood loss of the
    decode intervention `BucketIntervention` (from its first changed forward) or of the prefill intervention plan
    (from forward 1) on the reference (one `CaseReplay` per case: `intervention_runs` goes case by case).

    Args:
        costs: the model's layer-group costs (of the calibrated table).
        stage: ``"decode"`` or ``"prefill"``.
        all_high: the calibration's all-high policy (window, sinks, tag view and bins, INT4 key layout).
    """
    check_stage(stage)
    current: list[CaseReplay] = []

    def measure(case, reference: ReferenceTrajectory, bucket: Bucket, action: Action) -> float:
        if not current or current[0].reference is not reference:
            current[:] = [CaseReplay(model, reference, all_high)]
        policy, plan, first = intervention_schedule(reference, bucket, action, stage, costs, all_high)
        return current[0].loss(policy, first, plan)

    return measure


def check_stage(stage: str) -> str:
    """``stage`` if it is ``"decode"`` or ``"prefill"`` (ValueError otherwise)."""
    if stage not in ("decode", "prefill"):
        raise ValueError(f"stage must be 'decode' or 'prefill', got {stage!r}")
    return stage


def intervention_schedule(
    reference: ReferenceTrajectory, bucket: Bucket, action: Action, stage: str, costs: GroupCosts, all_high: PolicyTable
) -> tuple[RetentionPolicy, torch.Tensor | None, int]:
    """``(policy, prefill plan, first changed forward)`` of the Runtime-V intervention ``(bucket, action)`` of
    ``stage`` on ``reference``: a decode intervention is `BucketIntervention` (``all_high``'s window, sinks, tag view
    and bins, INT4 key layout) with no plan, from its `first_changed_forward`; a prefill intervention is
    ``all_high`` with `prefill_intervention_plan` ``[1, P, G]``, from forward 1."""
    window, sinks = all_high.window, all_high.sink_tokens
    if check_stage(stage) == "prefill":
        return all_high, prefill_intervention_plan(reference, bucket, action, sinks, window), 1
    view = {"tag_view": all_high.tag_view, "position_bins": tuple(all_high.position_bins)}
    policy = BucketIntervention(costs, bucket, action, sinks, window, **view, int4_keys=all_high.int4_keys)
    return policy, None, first_changed_forward(reference, bucket.key, window)


class DevelopmentReplayStore(JsonLinesStore):
    """Development replays kept on disk, as `DevelopmentStore` keeps generated development cases: one line per
    ``(case, candidate)`` (`candidate_digest`) with the case's likelihood loss and its ledger along the reference
    (``{"case", "candidate", "loss", "prompt_bits", "prompt_tokens", "decode_bits", "decode_tokens"}``), so a
    stopped or repeated calibration never replays a candidate on a case twice."""

    ID_FIELDS = ("case", "candidate")
    PREFIX = "development-replay"

    @staticmethod
    def accepts(fields: dict[str, Any]) -> bool:
        loss = fields.get("loss")
        numbers = [fields.get(n) for n in ("prompt_bits", "decode_bits")]
        return (
            isinstance(loss, float)
            and -1.0 <= loss <= 1.0
            and all(isinstance(n, (int, float)) and not isinstance(n, bool) and math.isfinite(n) for n in numbers)
            and all(is_int(fields.get(n)) for n in ("prompt_tokens", "decode_tokens"))
        )


class PromptReplays:
    """Each case's `CaseReplay` (its prompt forward, the same under every schedule), kept in memory for the next
    candidate while the kept prompts hold at most ``max_bytes`` of K/V, the least recently used dropped first (the
    prompt is most of a case's replay: a median development prompt of 376 tokens against a reply of 67).

    Args:
        model: the model; all_high: the calibration's all-high policy.
        max_bytes: bound of the prompt forwards kept (0: none kept).
    """

    def __init__(self, model, all_high: PolicyTable, max_bytes: int = 2 * 2**30):
        self.model, self.all_high = model, all_high
        self.max_bytes = check_int("max_prompt_bytes", max_bytes, 0, counts="bytes")
        self._prompts: OrderedDict[str, CaseReplay] = OrderedDict()
        self._held_bytes = 0  # the kept prompts' K/V bytes

    def __call__(self, reference: ReferenceTrajectory) -> CaseReplay:
        """The case's `CaseReplay`: kept from an earlier call, else run now and kept within ``max_bytes``."""
        replay = self._prompts.pop(reference.case_id, None)
        if replay is None:
            replay = CaseReplay(self.model, reference, self.all_high)
            self._held_bytes += replay.prompt_cache.nbytes()
        self._prompts[reference.case_id] = replay
        while self._prompts and self._held_bytes > self.max_bytes:
            self._held_bytes -= self._prompts.popitem(last=False)[1].prompt_cache.nbytes()
        return replay


class DevelopmentReplay:
    """Complete candidates (a decode table, or the all-high decode with a prefill policy) on the development references
    by likelihood; each reference's all-high log-probabilities are computed once and reused for every candidate, and
    each case's prompt forward is kept for the next candidate (`prompts`, a `PromptReplays` within
    ``max_prompt_bytes``).

    Args:
        model: the model; references: the development `ReferenceTrajectory` objects; all_high: the calibration's
            all-high policy.
        store: where each case's replay under a candidate is read from, or written to as soon as it is computed.
        max_prompt_bytes: bound of the prompt forwards kept across candidates (0: none kept).
    """

    def __init__(
        self,
        model,
        references: Sequence[ReferenceTrajectory],
        all_high: PolicyTable,
        store: DevelopmentReplayStore | None = None,
        max_prompt_bytes: int = 2 * 2**30,
    ):
        self.references, self.all_high, self.store = references, all_high, store
        self.prompts = PromptReplays(model, all_high, max_prompt_bytes)
        self._reference_log_probs: dict[str, torch.Tensor] = {}

    def __call__(
        self, policy: RetentionPolicy, prefill_policy: PrefillPolicy | None = None, progress: bool = False
    ) -> DevResult:
        """``policy`` (and ``prefill_policy``) on every development reference: ``error_rate`` is the mean likelihood
        loss from token 1 on (the all-high reference's is 0), the ratios are the ledger's along the reference
        trajectories, ``valid`` is empty (no verdicts), ``reused`` counts the cases read from the store, ``losses`` and
        ``reference_valid`` are per case."""
        candidate = candidate_digest(policy, prefill_policy)
        losses, bits, reused = [], [0.0, 0, 0.0, 0], 0  # prompt bits, prompt tokens, decode bits, decode tokens
        for reference in tqdm(self.references, desc="development (likelihood)", disable=not progress, leave=False):
            record = None if self.store is None else self.store.get_record((reference.case_id, candidate))
            reused += record is not None
            if record is None:
                record = self._replay(reference, policy, prefill_policy)
                if self.store is not None:
                    self.store.put_record((reference.case_id, candidate), record)
            losses.append(record["loss"])
            fields = ("prompt_bits", "prompt_tokens", "decode_bits", "decode_tokens")
            for i, name in enumerate(fields):
                bits[i] += record[name]
        decode_ratio, prefill_ratio = pooled_ratios(*bits, full_bits=policy.costs.full)
        return DevResult(
            sum(losses) / len(losses),
            decode_ratio,
            prefill_ratio,
            valid=(),
            reused=reused,
            losses=tuple(losses),
            reference_valid=tuple(r.valid for r in self.references),
        )

    def _replay(
        self, reference: ReferenceTrajectory, policy: RetentionPolicy, prefill_policy: PrefillPolicy | None
    ) -> dict[str, Any]:
        """One development case's likelihood loss and ledger under the candidate (a `DevelopmentReplayStore` line)."""
        replay = self.prompts(reference)
        if reference.case_id not in self._reference_log_probs:
            self._reference_log_probs[reference.case_id] = replay.log_probs(self.all_high)
        cache = replay.prompt_cache.with_schedule(policy, candidate_plan(reference, policy, prefill_policy))
        loss = likelihood_loss(self._reference_log_probs[reference.case_id], replay.log_probs_in(cache), 1)
        return {"loss": float(loss), **replay_ledger(cache, reference)}


def candidate_plan(
    reference: ReferenceTrajectory, policy: RetentionPolicy, prefill_policy: PrefillPolicy | None
) -> torch.Tensor | None:
    """The ``[1, P, G]`` prompt actions of ``prefill_policy`` on ``reference``'s prompt labels, with ``policy``'s
    costs, sinks and window (None without a prefill policy: the prompt is kept)."""
    if prefill_policy is None:
        return None
    sinks, window = policy.sink_tokens, policy.window
    return plan_prefill(reference.prompt_labels, policy.costs, prefill_policy, sinks, window).actions[None]


def replay_ledger(cache: TeacherForcedCache, reference: ReferenceTrajectory) -> dict[str, float | int]:
    """The ledger of a replay's schedule along ``reference``: scheduled prompt and decode bits, prompt tokens and
    non-stop generated tokens (the fields of a `DevCase` but the verdict and ``full_bits``)."""
    prompt, decode, length = cache.schedule.scheduled_bits_by_stage(len(reference.prompt_ids) + len(reference.tokens))
    return {
        "prompt_bits": float(prompt),
        "prompt_tokens": int(length),
        "decode_bits": float(decode),
        "decode_tokens": int(reference.num_decoded),
    }


class LikelihoodStore(InterventionStore):
    """Likelihood losses of interventions kept on disk, as `VerdictStore` keeps verdicts: a stopped calibration
    resumes without replaying what it measured (``{"case", "reference", "bucket", "action", "loss"}`` lines)."""

    PREFIX = "likelihood"
    FIELD = "loss"
    EXPECTED = "a float in [-1, 1] (likelihood_loss)"

    @classmethod
    def valid_value(cls, value: Any) -> bool:
        return isinstance(value, float) and -1.0 <= value <= 1.0
