"""Interventions resumed from their reference: the forwards an intervention shares with the reference are not run
again.

A decode intervention on bucket ``q`` lowers nothing before forward ``k0 = i0 + window + 2``, the first forward that
commits ``q``'s first occurrence ``i0`` (`interventions` module docstring): forwards ``0 .. k0 - 1`` repeat the
reference exactly, on the same cache contents, so they produce the reference's tokens ``0 .. k0 - 1``. A
`ReferenceKV` keeps the K/V of one reference run under the all-high policy, every token as the model computed it
(one forward per generated token, as in the intervention). `resumed_case_run` rebuilds the intervention's cache as
it stands before forward ``k0`` by replaying the layers' own updates (prompt, then one token at a time: the same
commits, the same stores), advances a fresh processor over the same tokens, and lets ``generate`` continue from
token ``k0 - 1``: the continuation is the intervened generation itself, from forward ``k0`` on. A prefill
intervention changes the prompt plan, which the cache first applies when the prompt leaves the recent window in
forward 1: it shares the prompt forward (``k0 = 1``).

Models with sliding-window layers are not resumed (a sliding layer does not keep the old tokens to replay).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.mixed_precision import StructuredMixedPrecisionCache
from ..cache.mixed_precision_layer import MixedPrecisionLayer
from ..policy.retention import RetentionPolicy
from ..policy.table import PolicyTable
from ..structured_generation import generate_structured
from .interventions import occurrences
from .references import CaseRun, ReferenceTrajectory, case_run
from .task import CalibrationTask

__all__ = ["RecordedReferences", "ReferenceKV", "first_changed_forward", "resumed_case_run"]


def first_changed_forward(reference: ReferenceTrajectory, key: str, window: int) -> int:
    """``k0``: the first forward of a decode intervention on tag ``key`` that can differ from ``reference`` (the
    commit of the tag's first occurrence ``i0``: ``i0 + window + 2``); raises when ``key`` never occurs."""
    found = occurrences(reference, key)
    if not found:
        raise ValueError(f"tag {key!r} does not occur on the reference of {reference.case_id}")
    return found[0] + window + 2


@dataclass(frozen=True)
class ReferenceKV:
    """The K/V of one all-high reference run.

    Attributes:
        reference: the trajectory the run reproduced.
        keys, values: per decoder layer ``[1, H_kv, n, D]``, positions ``0 .. n - 1`` (prompt, then the generated
            tokens that were fed back).
    """

    reference: ReferenceTrajectory
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @classmethod
    def record(
        cls,
        model,
        tokenizer,
        task: CalibrationTask,
        case,
        reference: ReferenceTrajectory,
        policy: PolicyTable,
        max_new_tokens: int,
    ) -> ReferenceKV | None:
        """Generate ``case`` under the all-high ``policy`` (the reference's) and keep its K/V; ``None`` when the
        model has sliding layers or the run does not reproduce ``reference``'s tokens."""
        result = task.generate(model, tokenizer, case, policy, max_new_tokens)
        run = case_run(model, tokenizer, task, case, result.sequences, result.prompt_length, result.processor)
        layers = result.cache.layers
        if run.tokens != reference.tokens or not all(isinstance(layer, MixedPrecisionLayer) for layer in layers):
            return None
        keys, values = [], []
        for layer in layers:
            if layer.num_low_entries():
                raise ValueError("the reference policy quantised entries: ReferenceKV needs the all-high policy")
            stored, positions = layer.high.view() if layer.high.num_entries() else ({}, None)
            if positions is not None and not torch.equal(positions[0], torch.arange(positions.shape[1]).to(positions)):
                raise ValueError("the reference policy released entries: ReferenceKV needs the all-high policy")
            keys.append(torch.cat([stored["keys"], layer.keys], dim=-2) if stored else layer.keys)
            values.append(torch.cat([stored["values"], layer.values], dim=-2) if stored else layer.values)
        return cls(reference, tuple(keys), tuple(values))

    def fill(self, cache: StructuredMixedPrecisionCache, forward: int) -> None:
        """Bring an empty ``cache`` to its state before forward ``forward`` (``>= 1``): the prompt's update, then one
        update per generated token ``0 .. forward - 2``, layer by layer (each update commits as in ``generate``)."""
        prompt = len(self.reference.prompt_ids)
        if not 1 <= forward <= self.keys[0].shape[-2] - prompt + 1:
            raise ValueError(f"forward must be in [1, {self.keys[0].shape[-2] - prompt + 1}], got {forward}")
        spans = [(0, prompt)] + [(t, t + 1) for t in range(prompt, prompt + forward - 1)]
        for start, stop in spans:
            for layer, keys, values in zip(cache.layers, self.keys, self.values, strict=True):
                layer.update(keys[..., start:stop, :], values[..., start:stop, :], kwargs={})


class RecordedReferences:
    """`ReferenceKV` of the case in progress, recorded on first use (`intervention_runs` goes case by case, so one
    recording per case is kept); ``None`` for a case whose recording does not reproduce its reference.

    Args:
        all_high: the all-high reference policy (window and sinks of the calibrated table).
    """

    def __init__(self, model, tokenizer, task: CalibrationTask, all_high: PolicyTable, max_new_tokens: int):
        self.model, self.tokenizer, self.task = model, tokenizer, task
        self.all_high, self.max_new_tokens = all_high, max_new_tokens
        self._case: tuple[str, ReferenceKV | None] | None = None

    def get(self, case, reference: ReferenceTrajectory) -> ReferenceKV | None:
        """The recording of ``case`` if it reproduces ``reference`` (recorded now when ``case`` is a new case)."""
        case_id = self.task.case_id(case)
        if self._case is None or self._case[0] != case_id:
            args = (self.model, self.tokenizer, self.task, case, reference, self.all_high, self.max_new_tokens)
            self._case = case_id, ReferenceKV.record(*args)
        recorded = self._case[1]
        return recorded if recorded is not None and recorded.reference.tokens == reference.tokens else None


def resumed_case_run(
    model,
    tokenizer,
    task: CalibrationTask,
    case,
    policy: RetentionPolicy,
    max_new_tokens: int,
    recorded: ReferenceKV,
    forward: int,
    prefill_plan: torch.Tensor | None = None,
) -> CaseRun:
    """The generation of ``case`` under ``policy`` and ``prefill_plan``, which lower nothing before forward
    ``forward`` (a decode intervention: its first changed forward; a prefill plan: 1, the prompt's first commit),
    run from forward ``forward`` on (module docstring); equal to `run_case`'s."""
    reference = recorded.reference
    prompt = torch.tensor([reference.prompt_ids], device=model.device)
    shared = torch.tensor([reference.tokens[:forward]], device=model.device)
    if shared.shape[1] != forward or forward >= max_new_tokens:
        raise ValueError(f"forward {forward} is not inside the reference's {len(reference.tokens)} generated tokens")
    processor = task.processor(tokenizer, case, policy)
    blank = torch.zeros(1, model.config.vocab_size, device=model.device)
    for j in range(forward):  # the calls of forwards 0 .. forward - 1: tokens 0 .. forward - 2 advanced and tagged
        processor(torch.cat([prompt, shared[:, :j]], dim=1), blank)
    cache = StructuredMixedPrecisionCache(model, policy, processor=processor, prefill_plan=prefill_plan)
    recorded.fill(cache, forward)
    batch = {"input_ids": torch.cat([prompt, shared], dim=1)}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    output = generate_structured(model, tokenizer, batch, processor, policy, max_new_tokens - forward, cache=cache)
    return case_run(model, tokenizer, task, case, output.sequences, prompt.shape[1], processor)
