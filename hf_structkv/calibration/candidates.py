"""Candidate controllers of Algorithm 1: a bucket action map ``Θ`` with its floors and priorities, compiled into a
`PolicyTable` (decode: with ``B_D`` and the reserve ``Γ``) or a `PrefillPolicy` (prefill: with ``B_P``).

Costs on the reference trajectories (Prop. 2's nominal cost): each token takes what the compiled table gives it, the
most protective action over its candidates (eq. 12; tags or labels without an entry: ``H``). Decode:
``B_D = Σ_tokens M(max(a⁰, a⁻)) / (C_full · #tokens)`` over the non-stop generated tokens. Prefill:
``B_P = Σ_prompts payload / (C_full · Σ n)``, sinks and the last ``window`` prompt tokens at ``H``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from ..policy.costs import Action, GroupCosts
from ..policy.prefill import PrefillPolicy
from ..policy.table import PolicyEntry, PolicyTable, all_high_entries
from ..structure.tags import StructuralTag
from .buckets import Bucket
from .reserve import reserve_table

__all__ = [
    "all_high_candidate",
    "compile_entries",
    "decode_candidate",
    "decode_cost_ratio",
    "prefill_candidate",
    "prefill_cost_ratio",
]


def compile_entries(
    actions: Mapping[Bucket, Action],
    floors: Mapping[Bucket, Action],
    priorities: Mapping[Bucket, tuple[float, float]],
    groups: int,
) -> dict[str, PolicyEntry]:
    """One `PolicyEntry` per bucket key: per group the action, floor and ``(ρ(R→L), ρ(L→H))``.

    Raises:
        ValueError: a key without all ``groups`` layer groups.
    """
    keys = sorted({bucket.key for bucket in actions})
    entries = {}
    for key in keys:
        per_group = [Bucket(key, c, groups) for c in range(groups)]
        missing = [str(b) for b in per_group if b not in actions or b not in floors or b not in priorities]
        if missing:
            raise ValueError(f"the candidate lacks the buckets {missing}: every key needs all {groups} layer groups")
        entries[key] = PolicyEntry(
            action=tuple(Action(actions[b]) for b in per_group),
            floor=tuple(Action(floors[b]) for b in per_group),
            priorities=tuple(tuple(float(p) for p in priorities[b]) for b in per_group),
        )
    return entries


def _token_actions(table: PolicyTable, keys) -> tuple[tuple[Action, ...], tuple[Action, ...]]:
    """``(max(a⁰, a⁻), a⁻)`` per group of a token with candidate ``keys`` (``()`` unresolved)."""
    lookup = table.lookup([StructuralTag.from_key(key) for key in keys])
    return tuple(max(a, f) for a, f in zip(lookup.base, lookup.floor)), lookup.floor


def decode_cost_ratio(table: PolicyTable, references: Sequence) -> float:
    """``B_D``: the table's nominal payload over the references' non-stop tokens, over Full KV."""
    bits = tokens = 0
    for reference in references:
        for keys in reference.tags:
            if keys is not None:
                bits += table.costs.total(_token_actions(table, keys)[0])
                tokens += 1
    return bits / (tokens * table.costs.full) if tokens else 1.0


def decode_candidate(
    actions: Mapping[Bucket, Action],
    floors: Mapping[Bucket, Action],
    priorities: Mapping[Bucket, tuple[float, float]],
    references: Sequence,
    costs: GroupCosts,
    horizon: int,
    beta: float,
    **table_fields: Any,
) -> PolicyTable:
    """The decode controller of one path step: entries, ``B_D`` = its reference cost ratio, ``Γ`` from the floors
    (Reserve(D_cal, f, B_D)).

    Args:
        table_fields: the remaining `PolicyTable` fields (``family``, ``sink_tokens``, ``window``, ``fingerprint``,
            ``description``, ``thresholds``, ``calibration``, ``tag_view``, ``position_bins``).
    """
    entries = compile_entries(actions, floors, priorities, len(costs.groups))
    table = PolicyTable(costs=costs, entries=entries, budget=1.0, **table_fields)
    budget = decode_cost_ratio(table, references)
    floor_costs, states = [], []
    for reference in references:
        tokens = [keys for keys in reference.tags if keys is not None]
        floor_costs.append([costs.total(_token_actions(table, keys)[1]) for keys in tokens])
        states.append([frozenset(key.split("|")[2] for key in keys) for keys in tokens])
    by_state, pooled = reserve_table(floor_costs, states, budget * costs.full, horizon, beta)
    return dataclasses.replace(table, budget=budget, reserve_by_state=by_state, reserve_pooled=pooled)


def prefill_cost_ratio(policy: PrefillPolicy, references: Sequence, sink_tokens: int, window: int) -> float:
    """``B_P``: the policy's nominal prompt payload (actions ``max(a⁰, a⁻)``, sinks and window ``H``), over Full KV."""
    bits = total = 0
    for reference in references:
        n = len(reference.prompt_labels)
        for t, labels in enumerate(reference.prompt_labels):
            if t < sink_tokens or t >= n - window:
                bits += policy.costs.full
            else:
                lookup = policy.lookup(labels)
                bits += policy.costs.total(tuple(max(a, f) for a, f in zip(lookup.base, lookup.floor)))
        total += n * policy.costs.full
    return bits / total if total else 1.0


def prefill_candidate(
    actions: Mapping[Bucket, Action],
    floors: Mapping[Bucket, Action],
    priorities: Mapping[Bucket, tuple[float, float]],
    references: Sequence,
    costs: GroupCosts,
    sink_tokens: int,
    window: int,
    **policy_fields: Any,
) -> PrefillPolicy:
    """The prefill policy of one path step with ``B_P`` = its reference cost ratio."""
    entries = compile_entries(actions, floors, priorities, len(costs.groups))
    policy = PrefillPolicy(costs=costs, entries=entries, budget=1.0, **policy_fields)
    return dataclasses.replace(policy, budget=prefill_cost_ratio(policy, references, sink_tokens, window))


def all_high_candidate(
    costs: GroupCosts, family: str, tag_view: str = "full", position_bins: tuple[int, ...] = (), **table_fields: Any
) -> PolicyTable:
    """The fallback controller (A.4): ``B_D = 1``, all-high actions and floors, ``Γ = 0``, for ``family``'s tags of
    ``tag_view``."""
    entries = all_high_entries(len(costs.groups), family, tag_view, position_bins)
    return PolicyTable(
        family=family,
        costs=costs,
        entries=entries,
        budget=1.0,
        tag_view=tag_view,
        position_bins=position_bins,
        **table_fields,
    )
