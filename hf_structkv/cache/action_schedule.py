"""`ActionSchedule`: which retention action (R / L / H) each cached token gets in each layer group.

Prompt tokens take the prefill plan (default: all ``H``). Generated tokens take what the per-sequence
`PolicyController` decides from the structural tag that the `StructuralLogitsProcessor` resolved for them. A tag is
known only after the token's own forward pass (the processor sees the token when it scores the next one), so the
schedule is computed lazily, in token order, when a layer asks for the actions of tokens leaving its recent window.
Prompt tokens without a plan are ``H``; a prefill plan carries its own sink protection (`plan_prefill` protects each
row's first real tokens, which left padding moves away from position 0); generated tokens among the first
``sink_tokens`` positions are ``H``.

With attention statistics (the `AttentionMass` of a policy whose `RetentionPolicy.attention_statistics` returns one:
the baselines of `hf_structkv.policy.baselines`) the controllers plan the prompt themselves, once, when prompt actions
are first needed (the first commit, after the prompt forward):
``controller.plan_prompt(mass [groups, P], real [P], weighted) -> [P, groups]`` (`RetentionController.plan_prompt`;
``weighted`` ``[groups, P]`` for value-weighted statistics, else ``None``); and each generated token is decided by
``controller.step(candidates, TokenStatistics(position, mass))`` with the mass accumulated so far.
"""

from __future__ import annotations

import copy

import torch

from ..attention.attention_mass import AttentionMass, TokenStatistics
from ..policy.costs import Action, GroupCosts
from ..policy.retention import RetentionController, RetentionPolicy
from ..structure.tag_source import TagSource


class ActionSchedule:
    """Per-sequence actions of the cached tokens, shared by every layer of one `StructuredMixedPrecisionCache`.

    State that changes: `begin` (first forward: batch size), `actions` (steps the controllers over newly tagged
    tokens), `crop` (rolls controllers and actions back), the batch-row operations.

    Args:
        policy: the frozen `RetentionPolicy` (a `PolicyTable`, whose controllers run Algorithm 2, a baseline, a
            calibration intervention).
        costs: the model's `GroupCosts`.
        processor: the `TagSource` (a `StructuralLogitsProcessor`) used in the same ``generate`` call, or ``None``
            (then every generated token is unresolved and gets the policy's protection for unresolved tokens).
        prefill_plan: optional int tensor ``[B, P, groups]`` of `Action` values for the ``P`` prompt tokens per
            layer group of ``costs`` (the prefill companion's plan); prompt tokens beyond it, and all when ``None``,
            are ``H``.
        statistics: the cache's `AttentionMass` when the policy decides from attention statistics (then the
            controllers plan the prompt: no ``prefill_plan``), else ``None``.
        context_length: positions ``0 .. context_length - 1`` hold a compacted context (served as it is, never
            scheduled nor charged); the prompt and ``prefill_plan`` start after it.
        prompt_length: optional, the prompt's length declared up front (the context's positions included, i.e.
            ``input_ids.shape[1]`` of `generation_inputs`), which lets the prompt arrive in several forwards (chunked
            prefill, `may_commit`); the processor's ``prompt_length`` must then agree. ``None``: the processor's, known
            from its first call (without a processor: the context plus ``prefill_plan``).
    """

    def __init__(
        self,
        policy: RetentionPolicy,
        costs: GroupCosts,
        processor: TagSource | None = None,
        prefill_plan: torch.Tensor | None = None,
        statistics: AttentionMass | None = None,
        context_length: int = 0,
        prompt_length: int | None = None,
    ):
        if statistics is not None and prefill_plan is not None:
            raise ValueError(
                "this policy plans the prompt from attention statistics itself: do not pass a prefill_plan (or "
                "prefill_policy) with it"
            )
        if prefill_plan is not None:
            groups = len(costs.groups)
            shape = tuple(prefill_plan.shape) if isinstance(prefill_plan, torch.Tensor) else ()
            if len(shape) != 3 or shape[-1] != groups:
                raise ValueError(
                    f"prefill_plan must be an int tensor [batch, prompt_tokens, {groups}] of Action values (one per "
                    f"layer group of the policy)"
                )
            if prefill_plan.numel() and not bool(((prefill_plan >= 0) & (prefill_plan <= 2)).all()):
                raise ValueError("prefill_plan holds values outside Action (R=0, L=1, H=2)")
        if prompt_length is not None:
            _check_prompt_length(prompt_length, context_length, prefill_plan, statistics)
        self.policy = policy
        self.costs = costs
        self.processor = processor
        self.prefill_plan = None if prefill_plan is None else prefill_plan.to(torch.int64).cpu()
        self.statistics = statistics
        self.context_length = context_length
        self.declared_prompt_length = prompt_length
        self.controllers: list[RetentionController] = []
        self.first_length = 0
        self.decided: list[list[tuple[Action, ...] | None]] = []

    @property
    def batch_size(self) -> int:
        return len(self.controllers)

    def begin(self, batch_size: int, first_length: int) -> None:
        """Create one controller per sequence at the first forward (``first_length`` tokens: the prompt when the
        cache starts empty); a no-op afterwards."""
        if self.controllers:
            if batch_size != self.batch_size:
                raise ValueError(f"the cache was started with batch size {self.batch_size}, got {batch_size}")
            return
        if self.prefill_plan is not None and self.prefill_plan.shape[0] != batch_size:
            raise ValueError(f"prefill_plan has {self.prefill_plan.shape[0]} rows for a batch of {batch_size}")
        self.first_length = first_length
        self.controllers = [self.policy.controller(self.costs) for _ in range(batch_size)]
        self.decided = [[] for _ in range(batch_size)]

    def _plan_prompt(self) -> None:
        """With attention statistics: the controllers' prompt plans ``[B, P, groups]``, made once, after the prompt
        forward (a no-op before it and afterwards)."""
        stats = self.statistics
        if stats is None or self.prefill_plan is not None or stats.prompt_real is None or not self.controllers:
            return
        real = stats.prompt_real  # [B, P]
        plans = []
        for row in range(self.batch_size):
            n = real.shape[1]
            weighted = stats.weighted_row_mass(row, n) if stats.value_weighted else None
            plans.append(self.controllers[row].plan_prompt(stats.row_mass(row, n), real[row], weighted))
        self.prefill_plan = torch.stack(plans).to(torch.int64)

    def _prompt_length(self) -> int | None:
        declared = self.declared_prompt_length
        if self.processor is None:
            if declared is not None:
                return declared
            return self.context_length + (0 if self.prefill_plan is None else self.prefill_plan.shape[1])
        seen = self.processor.prompt_length
        if seen is not None and declared is not None and seen != declared:
            raise ValueError(
                f"the cache was declared a prompt of {declared} tokens (prompt_length=), the processor saw {seen}: "
                "declare input_ids.shape[1] of the generate call (with a context: of generation_inputs)"
            )
        return declared if seen is None else seen

    def may_commit(self, seen: int) -> bool:
        """Whether a forward arriving at a layer that holds ``seen`` tokens commits the tokens leaving its recent
        window: only once the whole prompt is cached, so that a prompt prefilled in several forwards is attended at
        full precision as in one forward (its tokens then leave the window at the first generated token's forward).

        Raises:
            RuntimeError: with a processor that has not seen the prompt yet and no declared ``prompt_length``, a
                forward after the first (the processor is missing from ``generate``, or the prompt is prefilled in
                several forwards without its length declared).
        """
        prompt_length = self._prompt_length()
        if prompt_length is not None:
            return seen >= prompt_length
        if seen >= self.first_length:
            raise RuntimeError(
                "a second forward reached the cache before its structural processor saw the prompt: pass the cache's "
                "processor in logits_processor of the same generate call; to prefill the prompt in several forwards "
                "(generate's prefill_chunk_size, or model(ids[:, :k]) then model(ids[:, k:])), declare its length: "
                "StructuredMixedPrecisionCache(..., prompt_length=input_ids.shape[1])"
            )
        return False

    def _decide_generated(self, row: int, index: int) -> tuple[Action, ...]:
        """Actions of generated token ``index`` of ``row``, stepping the controller up to it in order."""
        decided = self.decided[row]
        for i in range(len(decided), index + 1):
            if self.processor is None:
                candidates = ()
            elif i < self.processor.num_tagged(row):
                candidates = self.processor.tag_at(row, i)
            else:
                raise _untagged(f"generated token {i} of sequence {row}")
            if self.statistics is None:
                decided.append(self.controllers[row].step(candidates))
            else:
                position = self._prompt_length() + i
                mass = self.statistics.row_mass(row, position + 1)
                decided.append(self.controllers[row].step(candidates, TokenStatistics(position, mass)))
        actions = decided[index]
        return (Action.R,) * len(self.costs.groups) if actions is None else actions

    def actions(self, start: int, count: int, group: int) -> torch.Tensor:
        """Actions ``[B, count]`` (int64 `Action` values) of positions ``start .. start + count - 1`` in ``group``."""
        self._plan_prompt()
        result = torch.full((self.batch_size, count), int(Action.H), dtype=torch.int64)
        stop = start + count
        if self.prefill_plan is not None:
            plan_start = max(start, self.context_length)
            planned_stop = min(stop, self.context_length + self.prefill_plan.shape[1])
            if planned_stop > plan_start:
                plan = self.prefill_plan[:, plan_start - self.context_length : planned_stop - self.context_length]
                result[:, plan_start - start : planned_stop - start] = plan[..., group]
        prompt_length = self._prompt_length()
        if prompt_length is None and stop > self.first_length:
            raise _untagged(f"position {stop - 1}")
        if prompt_length is not None:
            for position in range(max(start, prompt_length), stop):
                for row in range(self.batch_size):
                    result[row, position - start] = int(self._decide_generated(row, position - prompt_length)[group])
        # Sinks among generated tokens (a prompt shorter than sink_tokens); a prefill plan protects its own sinks
        # at each row's first real token, which with left padding is not position 0.
        sink_start, sink_stop = max(start, prompt_length or 0), min(stop, self.policy.sink_tokens)
        if prompt_length is not None and sink_stop > sink_start:
            result[:, sink_start - start : sink_stop - start] = int(Action.H)
        return result

    def crop(self, length: int) -> None:
        """Forget the decisions of positions ``>= length``: controllers return to their state before them."""
        prompt_length = self._prompt_length() or 0
        keep = max(0, length - prompt_length)
        for row, controller in enumerate(self.controllers):
            if len(self.decided[row]) > keep:
                controller.rollback(keep)
                del self.decided[row][keep:]

    def select_rows(self, indices: torch.Tensor) -> None:
        """Batch row ``i`` becomes old row ``indices[i]`` (beam reordering, repetition, selection)."""
        rows = indices.tolist()
        self.controllers = [copy.deepcopy(self.controllers[i]) for i in rows]
        self.decided = [list(self.decided[i]) for i in rows]
        if self.prefill_plan is not None:
            self.prefill_plan = self.prefill_plan[indices.cpu()]
        if self.statistics is not None:
            self.statistics.select_rows(indices)

    def scheduled_bits_by_stage(self, num_tokens: int) -> tuple[float, float, int]:
        """The ledger's payload over the first ``num_tokens`` positions of every sequence (a compacted context's
        excluded), in bits, split by stage: ``(prompt_bits, decode_bits, prompt_length)`` (``prompt_length``: the
        prompt tokens after the context). Prompt tokens cost their planned actions; generated tokens
        their controller's charges (stop tokens free); tokens whose tags are available are scheduled first."""
        self._plan_prompt()
        prompt_length = max(self.context_length, min(self._prompt_length() or 0, num_tokens))
        prompt = 0.0
        for group in range(len(self.costs.groups)):
            planned = self.actions(self.context_length, prompt_length - self.context_length, group)  # [B, P]
            values, counts = planned.unique(return_counts=True)
            prompt += sum(self.costs.cost(Action(int(a)), group) * int(n) for a, n in zip(values, counts))
        decode = 0.0
        for row in range(self.batch_size):
            generated = num_tokens - prompt_length
            available = generated if self.processor is None else min(generated, self.processor.num_tagged(row))
            for index in range(available):
                self._decide_generated(row, index)
            decode += self.controllers[row].scheduled_bits
        return prompt, decode, prompt_length - self.context_length

    def scheduled_bits(self, num_tokens: int) -> float:
        """Prompt and decode payload together (`scheduled_bits_by_stage`)."""
        prompt, decode, _ = self.scheduled_bits_by_stage(num_tokens)
        return prompt + decode


def _check_prompt_length(
    prompt_length: object, context_length: int, prefill_plan: torch.Tensor | None, statistics: AttentionMass | None
) -> None:
    """ValueError unless a declared ``prompt_length`` is an int past the context that covers the prefill plan, for a
    policy without attention statistics."""
    if isinstance(prompt_length, bool) or not isinstance(prompt_length, int) or prompt_length <= context_length:
        raise ValueError(
            f"prompt_length must be an int greater than the context's {context_length} tokens (input_ids.shape[1] "
            f"of the generate call), got {prompt_length!r}"
        )
    if statistics is not None:
        raise ValueError(
            "a policy that decides from attention statistics (H2O / SnapKV / MiKV / CriticalKV baselines) reads the "
            "prompt's one forward: prefill the prompt in one forward and do not declare prompt_length"
        )
    planned = 0 if prefill_plan is None else prefill_plan.shape[1]
    if context_length + planned > prompt_length:
        raise ValueError(
            f"prefill_plan covers {planned} tokens after the context's {context_length}, more than the declared "
            f"prompt_length {prompt_length}"
        )


def _untagged(what: str) -> RuntimeError:
    return RuntimeError(
        f"{what} leaves the recent window before the structural processor has tagged it: pass the cache's "
        "processor in logits_processor of the same generate call (and a policy window >= 1)"
    )
