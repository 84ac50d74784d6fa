"""Development selection (PASK eq. 9): evaluate complete controllers on development cases and keep the cheapest whose
error rate is within ``α`` of the all-high reference's; the all-high controller is the fallback.

Which candidates are evaluated (`search_path`): with ``max_candidates = None`` every candidate of every path (the
paper's protocol: realised cost need not follow the nominal order). With ``max_candidates = N``, per path of
``J + 1`` candidates (nominal cost nondecreasing along it, Prop. 2; its last one all-high), at most ``N`` of them by
bisection for the cheapest that passes the tolerance: candidate 0 first (the path stops if it passes), then the
middle of the interval between the cheapest failing candidate and the cheapest passing one (the all-high end until
one passes), so ``N`` evaluations place the cheapest passing candidate within ``J / 2^(N−1)`` of the path, where
evaluating ``N`` evenly spread candidates places it within ``J / (N − 1)``. It assumes, as stopping at the first
pass did, that the tolerance holds from some point of the path on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm

from ..validation import check_int
from .development_store import DevCase, DevelopmentStore, candidate_digest
from .references import stop_index
from .task import CalibrationTask

__all__ = ["DevResult", "evaluate_controller", "pooled_ratios", "search_path", "select_cheapest"]


def search_path(path_length: int, max_candidates: int | None, passes: Callable[[int], bool]) -> list[int]:
    """Evaluate candidates of a path with ``passes(index)`` (module docstring) and return the indices evaluated,
    in order: every index with ``max_candidates = None``; else a bisection for the cheapest passing one.

    Raises:
        ValueError: ``path_length < 1`` or ``max_candidates < 1``.
    """
    check_int("path_length", path_length, 1)
    if check_int("max_candidates", max_candidates, 1, none_ok=True) is None:
        for index in range(path_length):
            passes(index)
        return list(range(path_length))
    order = [0]
    if passes(0):
        return order
    low, high = 0, path_length - 1  # low fails; high, the path's all-high end, is taken to pass until evaluated
    while len(order) < max_candidates and high - low > 1:
        middle = (low + high) // 2
        order.append(middle)
        if passes(middle):
            high = middle
        else:
            low = middle
    return order


@dataclass(frozen=True)
class DevResult:
    """A controller on the development cases.

    Attributes:
        error_rate: ``R̂_dev``: the fraction of cases the task's verdict rejects.
        decode_ratio: scheduled decode payload over Full KV, pooled over the cases' non-stop generated tokens.
        prefill_ratio: scheduled prompt payload over Full KV, pooled over the cases' prompt tokens.
        valid: the verdict per case.
        reused: how many of the cases were read from a `DevelopmentStore` instead of generated.
        losses: replayed (likelihood) only: each case's likelihood loss; reference_valid: its reference's verdict.
    """

    error_rate: float
    decode_ratio: float
    prefill_ratio: float
    valid: tuple[bool, ...]
    reused: int = 0
    losses: tuple[float, ...] = ()
    reference_valid: tuple[bool, ...] = ()


def evaluate_controller(
    model,
    tokenizer,
    task: CalibrationTask,
    cases: Sequence,
    policy,
    max_new_tokens: int,
    prefill_policy=None,
    progress: bool = False,
    store: DevelopmentStore | None = None,
    replayed: Callable[[object, object, object], DevCase | None] | None = None,
) -> DevResult:
    """Generate each case (batch 1) under ``policy`` (and ``prefill_policy``), score it, pool the measured costs
    (``progress``: a bar over the cases). With ``store``, a case already stored under this candidate
    (`candidate_digest`) is read instead of generated, and each generated case is appended to it. With ``replayed``
    (``(case, policy, prefill_policy) -> DevCase | None``, `ReplayedDevelopment`), a case it answers (its greedy reply
    is the reference's) is not generated."""
    task.check_cases(cases, "cases (the development cases)")
    candidate = None if store is None else candidate_digest(policy, prefill_policy)
    results, reused = [], 0
    for case in tqdm(cases, desc="development", unit="case", disable=not progress, leave=False):
        result = None if store is None else store.get(task.case_id(case), candidate)
        if result is None:
            result = None if replayed is None else replayed(case, policy, prefill_policy)
            if result is None:
                result = _generate_case(model, tokenizer, task, case, policy, max_new_tokens, prefill_policy)
            if store is not None:
                store.put(task.case_id(case), candidate, result)
        else:
            reused += 1
        results.append(result)
    decode_ratio, prefill_ratio = pooled_ratios(
        sum(r.prompt_bits for r in results),
        sum(r.prompt_tokens for r in results),
        sum(r.decode_bits for r in results),
        sum(r.decode_tokens for r in results),
        full_bits=results[-1].full_bits,
    )
    return DevResult(
        error_rate=sum(not r.valid for r in results) / len(results),
        decode_ratio=decode_ratio,
        prefill_ratio=prefill_ratio,
        valid=tuple(r.valid for r in results),
        reused=reused,
    )


def pooled_ratios(
    prompt_bits: float, prompt_tokens: int, decode_bits: float, decode_tokens: int, full_bits: float
) -> tuple[float, float]:
    """``(decode_ratio, prefill_ratio)``: scheduled payload over Full KV's (``full_bits`` per token), pooled over the
    cases' non-stop generated tokens and prompt tokens (1.0 where there is none)."""
    decode = decode_bits / (decode_tokens * full_bits) if decode_tokens else 1.0
    prefill = prompt_bits / (prompt_tokens * full_bits) if prompt_tokens else 1.0
    return decode, prefill


def _generate_case(model, tokenizer, task: CalibrationTask, case, policy, max_new_tokens: int, prefill_policy):
    """One development case generated under the candidate, scored and measured (a `DevCase`)."""
    result = task.generate(model, tokenizer, case, policy, max_new_tokens, prefill_policy=prefill_policy)
    generated = result.sequences[0, result.prompt_length :].tolist()
    stopped = stop_index(generated, result.processor.adapter.stop_token_ids) is not None
    valid = task.score(case, result.texts[0], stopped)
    schedule = result.cache.schedule
    prompt, decode, prompt_length = schedule.scheduled_bits_by_stage(result.cache.get_seq_length())
    return DevCase(
        valid=valid,
        prompt_bits=float(prompt),
        prompt_tokens=int(prompt_length),
        decode_bits=float(decode),
        decode_tokens=sum(decision is not None for decision in schedule.decided[0]),
        full_bits=float(result.cache.costs.full),
    )


def select_cheapest(costs: Sequence[float], error_rates: Sequence[float], reference_error: float, alpha: float):
    """Eq. 9: the index of the cheapest candidate with ``error − reference_error <= alpha`` (ties: the first), or
    ``None`` when none passes (then the all-high fallback applies).

    Raises:
        ValueError: lists of different lengths, or ``alpha`` outside ``[0, 1]``.
    """
    if len(costs) != len(error_rates):
        raise ValueError(
            f"costs and error_rates must have one value per candidate, got {len(costs)} and {len(error_rates)}"
        )
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    passing = [i for i, error in enumerate(error_rates) if error - reference_error <= alpha + 1e-12]
    return min(passing, key=lambda i: (costs[i], i)) if passing else None
