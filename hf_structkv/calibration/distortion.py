"""Runtime-D: attention-output distortion ``D(q, a)`` on fixed reference trajectories (PASK eq. 7, A.4).

Per reference trajectory, one teacher-forced forward over ``prompt + generated tokens`` captures every global
layer's post-RoPE queries (`capture_queries`) and its keys / values (a ``DynamicCache``). The reference queries are
those of generated tokens ``j = 0 .. T − 2`` (token ``j``'s forward produces token ``j + 1``; the last token is never
fed back). For bucket ``q = (z, c)`` and action ``a``, each layer ``ℓ`` of group ``c`` recomputes attention with ``a``
applied to the bucket's entries *that a query sees lowered*:

* decode bucket (tag ``z``): generated token ``i`` with ``z`` among its candidates, from query ``j >= i + window + 1``
  on (the token left the window; generated tokens among the first ``sink_tokens`` positions stay ``H``);
* prefill bucket (label ``z``): prompt tokens carrying ``z`` outside the sinks and the last ``window`` prompt tokens,
  for every reference query (committed before the first generated token's forward).

``a = L`` replaces the entry's key and value by their INT4 round trip (`quantize_int4` / `dequantize_int4`; keys in
the calibration's layout, `served_keys`: per row, or centred by the `key_centres` of the reference's prompt keys as
the cache fits them), ``a = R`` removes it.
``D(q, a) = (1 / |D_cal|) Σ_cases Σ_j Σ_{ℓ∈c} max_h ‖o_ref − o_a‖²`` (query heads ``h``, FP32); queries with no
lowered entry contribute zero, so the sum runs over the affected positions ``S(q)`` only, shared by ``R`` and ``L``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import DynamicCache

from ..attention.modules import attention_scalings
from ..attention.recording import capture_queries
from ..policy.costs import Action, GroupCosts
from ..quant.int4 import dequantize_int4, quantize_int4
from ..quant.int4_centred import check_int4_keys, served_keys
from .buckets import Bucket
from .intervention_store import InterventionStore
from .interventions import occurrences, prefill_positions
from .references import ReferenceTrajectory

__all__ = ["DistortionStore", "ReferenceStates", "attention_distortion", "capture_reference_states", "lowered_entries"]

ReferenceStates = dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]
"""``{layer: (queries [H_q, T − 1, D], keys [H_kv, N, D], values [H_kv, N, D_v], scaling)}`` (FP32)."""


def capture_reference_states(model, reference: ReferenceTrajectory) -> ReferenceStates:
    """One teacher-forced forward over ``reference``'s prompt and generated tokens; the queries of generated tokens
    ``0 .. T − 2`` and every position's keys / values in each global layer."""
    prompt, tokens = len(reference.prompt_ids), len(reference.tokens)
    if tokens < 2:
        return {}
    ids = torch.tensor([list(reference.prompt_ids) + list(reference.tokens)], dtype=torch.long)
    cache = DynamicCache(config=model.config)
    queries = capture_queries(model, ids, positions=slice(prompt, prompt + tokens - 1), cache=cache)
    scalings = attention_scalings(model)
    states = {}
    for layer, grouped in queries.items():
        keys, values = cache.layers[layer].keys[0].float(), cache.layers[layer].values[0].float()
        kv_heads, rows, dim = grouped.shape
        per_head = grouped.float().reshape(kv_heads, rows // (tokens - 1), tokens - 1, dim).flatten(0, 1)
        states[layer] = (per_head, keys, values, scalings.get(layer, dim**-0.5))
    return states


def lowered_entries(
    reference: ReferenceTrajectory, bucket: Bucket, stage: str, sink_tokens: int, window: int
) -> torch.Tensor:
    """Bool ``[T − 1, P + T]``: which entries each reference query sees lowered by an intervention on ``bucket``.

    Args:
        stage: ``"decode"`` (``bucket.key`` is a tag key) or ``"prefill"`` (a prompt label).
    """
    prompt, tokens = len(reference.prompt_ids), len(reference.tokens)
    lowered = torch.zeros(max(tokens - 1, 0), prompt + tokens, dtype=torch.bool)
    if stage == "decode":
        for i in occurrences(reference, bucket.key):
            if prompt + i >= sink_tokens:
                lowered[i + window + 1 :, prompt + i] = True
    elif stage == "prefill":
        lowered[:, prefill_positions(reference, bucket.key, sink_tokens, window)] = True
    else:
        raise ValueError(f"stage must be 'decode' or 'prefill', got {stage!r}")
    return lowered


def _outputs(queries, keys, values, scaling, visible, lowered=None, low_keys=None, low_values=None) -> torch.Tensor:
    """Attention outputs ``[H_q, n, D_v]`` of ``queries`` ``[H_q, n, D]`` over ``keys`` / ``values`` ``[H_kv, N, ·]``
    with bool ``visible`` ``[n, N]``; where ``lowered`` ``[n, N]`` is set, ``low_keys`` / ``low_values`` replace the
    entry (``None``: the entry is removed)."""
    groups = queries.shape[0] // keys.shape[0]
    q = queries.unflatten(0, (keys.shape[0], groups))  # [H_kv, g, n, D]
    scores = torch.einsum("hgnd,hmd->hgnm", q, keys) * scaling
    if lowered is not None and low_keys is not None:
        scores = torch.where(lowered, torch.einsum("hgnd,hmd->hgnm", q, low_keys) * scaling, scores)
    mask = visible if lowered is None or low_keys is not None else visible & ~lowered
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    if lowered is not None and low_values is not None:
        out = torch.einsum("hgnm,hmd->hgnd", probs * ~lowered, values)
        out = out + torch.einsum("hgnm,hmd->hgnd", probs * lowered, low_values)
    else:
        out = torch.einsum("hgnm,hmd->hgnd", probs, values)
    return out.flatten(0, 1)


def _round_trip(x: torch.Tensor) -> torch.Tensor:
    codes, scales = quantize_int4(x)
    return dequantize_int4(codes, scales, x.shape[-1])


def _lowered_keys(keys: torch.Tensor, prompt: int, int4_keys: str) -> torch.Tensor:
    """The INT4 round trip of one reference's keys ``[H_kv, N, D]`` in the layout ``int4_keys`` (`served_keys`:
    centred on the ``prompt`` first keys, every prompt token real, as the cache fits them at its first commit)."""
    return served_keys(keys[None], torch.ones(1, prompt, dtype=torch.bool, device=keys.device), int4_keys)[0]


class DistortionStore(InterventionStore):
    """Runtime-D kept on disk: one reference's distortion ``Σ_j Σ_{ℓ∈c} max_h ‖o_ref − o_a‖²`` of one intervention
    ``(bucket, action)`` per line (``{"case", "reference", "bucket", "action", "error"}``), so a stopped or repeated
    calibration never captures a reference's attention states twice (one forward over the trajectory and one
    attention recomputation per bucket and layer: minutes per hundred references on a CPU)."""

    PREFIX = "distortion"
    FIELD = "error"
    EXPECTED = "a finite float >= 0 (a reference's summed squared output error)"

    @classmethod
    def valid_value(cls, value: Any) -> bool:
        return isinstance(value, float) and math.isfinite(value) and value >= 0.0


def attention_distortion(
    references: Sequence[ReferenceTrajectory],
    buckets: Sequence[Bucket],
    stage: str,
    costs: GroupCosts,
    sink_tokens: int,
    window: int,
    states_of,
    store: DistortionStore | None = None,
    int4_keys: str = "row",
) -> dict[Bucket, dict[Action, float]]:
    """``{bucket: {Action.R: D(q, R), Action.L: D(q, L)}}`` (eq. 7) over ``references``.

    Args:
        states_of: ``reference -> ReferenceStates`` (e.g. ``lambda r: capture_reference_states(model, r)``), called
            once per reference whose distortions ``store`` does not hold.
        store: where each reference's distortions are read from, or written to as soon as they are computed.
        int4_keys: the key layout of ``L`` (`INT4_KEY_LAYOUTS`; keep one store per layout).
    """
    check_int4_keys(int4_keys)
    totals: dict[Bucket, dict[Action, float]] = {b: {Action.R: 0.0, Action.L: 0.0} for b in buckets}
    for reference in references:
        lowered = {b: lowered_entries(reference, b, stage, sink_tokens, window) for b in buckets}
        reached = [(b, a) for b in buckets if bool(lowered[b].any()) for a in (Action.R, Action.L)]
        stored = None if store is None else {(b, a): store.get(reference, b, a) for b, a in reached}
        if stored is not None and None not in stored.values():
            errors = {b: {a: stored[b, a] for a in (Action.R, Action.L)} for b, _ in reached}
        else:
            errors = _reference_errors(reference, lowered, costs, states_of, int4_keys) or {}
            for bucket, action in reached if store is not None else ():
                store.put(reference, bucket, action, errors[bucket][action])
        for bucket, by_action in errors.items():
            for action, error in by_action.items():
                totals[bucket][action] += error
    return {b: {a: v / len(references) for a, v in d.items()} for b, d in totals.items()}


def _reference_errors(
    reference: ReferenceTrajectory, lowered: Mapping[Bucket, torch.Tensor], costs: GroupCosts, states_of, int4_keys
) -> dict[Bucket, dict[Action, float]] | None:
    """One reference's ``Σ_j Σ_{ℓ∈c} max_h ‖o_ref − o_a‖²`` per bucket and action (``lowered``: each bucket's
    `lowered_entries` on it); ``None`` when it has no reference queries."""
    states: Mapping = states_of(reference)
    if not states:
        return None
    prompt = len(reference.prompt_ids)
    n, total = len(reference.tokens) - 1, prompt + len(reference.tokens)
    visible = torch.arange(total)[None, :] <= (prompt + torch.arange(n))[:, None]  # [n, N] causal
    errors = {b: {Action.R: 0.0, Action.L: 0.0} for b, entries in lowered.items() if bool(entries.any())}
    for layer, (queries, keys, values, scaling) in states.items():
        group = costs.group_of_layer(layer)
        active = [b for b in errors if b.group == group]
        if not active:
            continue
        reference_out = _outputs(queries, keys, values, scaling, visible)
        low_keys, low_values = _lowered_keys(keys, prompt, int4_keys), _round_trip(values)
        for bucket in active:
            rows = lowered[bucket].any(dim=1)  # the affected queries S(q) of this case
            args = (queries[:, rows], keys, values, scaling, visible[rows], lowered[bucket][rows])
            for action, replacement in ((Action.R, (None, None)), (Action.L, (low_keys, low_values))):
                out = _outputs(*args, *replacement)
                errors[bucket][action] += float((reference_out[:, rows] - out).square().sum(-1).amax(0).sum())
    return errors
