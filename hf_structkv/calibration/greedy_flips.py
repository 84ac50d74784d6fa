"""Where a retention schedule makes greedy constrained decoding leave a reference reply: the first **flip**.

Greedy decoding under a schedule writes the all-high reference reply ``y_0 .. y_{T-1}`` token for token up to the
first step ``k`` at which the grammar-masked argmax of its logits is not ``y_k``, and leaves it there. Before that
step it saw exactly the reference's tokens, so the logits of every step up to ``k`` are those of the teacher-forced
replay of the reference under the schedule (`CaseReplay`, `hf_structkv.cache.teacher_forced`). `reference_masks`
walks the case's grammar processor along the reference once (the grammar's allowed tokens at each step depend on the
tokens only, not on the schedule); `first_flip` masks each replayed row as ``generate`` masks it and returns the first
step whose masked argmax differs: no generation, one forward per schedule. No flip means the schedule's greedy reply
is the reference's (its verdict too); a flip at ``k`` means it is another reply, which agrees with the reference
before ``k``. Step 0 cannot flip: its logits come from the prompt forward, which no schedule changes (a prefill plan
takes effect at the first commit). "Exactly" is up to floating-point summation order: the replay forwards the reply
in one batch where ``generate`` forwards one token at a time (the float64 tests are exact; in float32 a near tie can
go either way, which the flip's ``margin`` shows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .likelihood import CaseReplay

__all__ = ["Flip", "first_flip", "reference_masks"]


@dataclass(frozen=True)
class Flip:
    """The first step at which a schedule's greedy choice is not the reference's token.

    Attributes:
        index: the reply step ``k >= 1`` (``y_k`` is the reference token not chosen).
        reference_token, chosen_token: ``y_k`` and the masked argmax.
        margin: masked log-probability of ``chosen_token`` minus that of ``reference_token`` (``> 0``; ``inf`` when
            the grammar no longer allows ``y_k``, which cannot happen along the reference's own tokens).
    """

    index: int
    reference_token: int
    chosen_token: int
    margin: float


def reference_masks(replay: CaseReplay, processor) -> torch.Tensor:
    """``[T, V]`` bool: the tokens the case's grammar allows at each reply step ``0 .. T − 1`` along the reference.

    Args:
        replay: the case's `CaseReplay` (its reference's prompt and reply tokens).
        processor: a fresh grammar processor of the case, as ``generate`` would use it (a logits processor called
            with ``(input_ids [1, n], scores [1, V])`` that sets the scores of disallowed tokens to ``-inf``, stateful
            along ``input_ids``; `CalibrationTask.processor`); it is walked along the whole reply.
    """
    tokens = replay.tokens  # [1, P + T]
    prompt, vocab = len(replay.reference.prompt_ids), replay.model.config.vocab_size
    blank = torch.zeros(1, vocab, device=tokens.device)
    rows = [processor(tokens[:, : prompt + step], blank.clone())[0] for step in range(tokens.shape[1] - prompt)]
    return torch.isfinite(torch.stack(rows)) if rows else torch.zeros(0, vocab, dtype=torch.bool)


def first_flip(replay: CaseReplay, rows: torch.Tensor, allowed: torch.Tensor, start: int = 1) -> Flip | None:
    """The first flip at a reply step ``>= start`` of the greedy constrained reply under a schedule, or None
    (module docstring).

    Args:
        replay: the case's `CaseReplay` (its reference's prompt and reply tokens).
        rows: ``[T - start, V]`` the schedule's replayed logits of steps ``start .. T - 1``
            (`CaseReplay.schedule_logits` with ``first=start``).
        allowed: ``[T, V]`` the grammar's allowed tokens along the reference (`reference_masks`).
        start: the first step checked, ``>= 1`` (a schedule that changes no forward before ``start`` cannot flip
            before it but through the replay's float noise).

    Returns:
        a `Flip`, or None when every checked step's masked argmax is the reference's token.
    """
    tokens = replay.tokens  # [1, P + T]
    prompt, length = len(replay.reference.prompt_ids), tokens.shape[1] - len(replay.reference.prompt_ids)
    if start < 1 or rows.shape[0] != max(0, length - start):
        raise ValueError(
            f"rows must hold the {max(0, length - start)} steps {start} .. {length - 1}, got {rows.shape[0]}"
        )
    if allowed.shape != (length, rows.shape[-1]):
        raise ValueError(f"allowed must be [{length}, {rows.shape[-1]}] (reference_masks), got {list(allowed.shape)}")
    for step in range(start, length):
        masked = torch.log_softmax(rows[step - start].masked_fill(~allowed[step], float("-inf")), -1)
        chosen, wanted = int(masked.argmax()), int(tokens[0, prompt + step])
        if chosen != wanted:
            return Flip(step, wanted, chosen, float(masked[chosen] - masked[wanted]))
    return None
