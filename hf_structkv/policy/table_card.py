"""The model card (``README.md``) of a saved `PolicyTable`, from the ``model_cards/policy_table.md`` template."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..persistence import base_model, card_front_matter, markdown_items, render_card
from ..version import __version__
from .costs import Action, GroupCosts, group_names
from .entries import UPGRADE_STEPS, PolicyEntry
from .policy_json import CONVENTIONS, FORMAT_VERSION, conventions_with_keys

__all__ = ["render_table_card"]


def render_table_card(table: Any, repo_id: str | None = None) -> str:
    """The ``README.md`` of a saved `PolicyTable` ``table``, from the ``model_cards/policy_table.md`` template."""
    fingerprint = dict(table.fingerprint or {})
    base = base_model({"fingerprint": fingerprint})
    banners = {
        "calibrated": "Calibrated offline (PASK Algorithm 1) on the data recorded under Calibration.",
        "illustrative": (
            "**Illustrative, not calibrated.** The actions, floors, priorities, budget and reserves below were "
            "written by hand to exercise the controller; no task or distortion measurement chose them, and they "
            "promise no accuracy."
        ),
        "reference": "The all-high reference policy: nothing is compressed (the baseline every policy is held to).",
    }
    allowance = table.budget * table.costs.full
    bins = f" (bins start at {list(table.position_bins)})" if table.position_bins else ""
    return render_card(
        "policy_table.md",
        front_matter=card_front_matter(["pask-policy-table", table.provenance], base),
        model_name=base or fingerprint.get("architecture", "any model with these layer dimensions"),
        provenance=table.provenance,
        provenance_banner=banners[table.provenance],
        description=table.description or "none",
        repo_id=repo_id or "<this repository id or local folder>",
        family=table.family,
        num_layers=table.costs.groups[-1].stop,
        grouping=_grouping(len(table.costs.groups)),
        groups_argument="" if len(table.costs.groups) == 3 else f", groups={len(table.costs.groups)}",
        group_names=" ".join(group_names(len(table.costs.groups))),
        group_scores=" / ".join(group_names(len(table.costs.groups))),
        group_rows=_group_rows(table.costs),
        full_bits=f"{table.costs.full:,}",
        budget=table.budget,
        allowance=f"{allowance:,.1f}",
        sink_tokens=table.sink_tokens,
        window=table.window,
        tag_view=f"`{table.tag_view}`{bins}",
        reserve_rows=_reserve_rows(table),
        entry_rows=_entry_rows(table.entries),
        resolution_rows=_resolution_rows(table),
        thresholds=markdown_items(dict(table.thresholds)),
        calibration=markdown_items(dict(table.calibration)),
        conventions="\n".join(
            f"- **{k}**: `{v}`" for k, v in conventions_with_keys(CONVENTIONS, table.int4_keys).items()
        ),
        fingerprint=json.dumps(fingerprint, indent=2, sort_keys=True) if fingerprint else "null",
        hf_structkv_version=__version__,
        format_version=FORMAT_VERSION,
    )


def _grouping(count: int) -> str:
    if count == 3:
        return "in three groups (A.2)"
    return "in one group: a token's action is tied across depth (the no-layer-groups ablation of PASK Fig. 5)"


def _group_rows(costs: GroupCosts) -> str:
    rows = []
    for c, (name, group) in enumerate(zip(group_names(len(costs.groups)), costs.groups)):
        rows.append(
            f"| {name} | {group.start}-{group.stop - 1} | {costs.cost(Action.H, c):,} | {costs.cost(Action.L, c):,} |"
        )
    return "\n".join(rows)


def _reserve_rows(table: Any) -> str:
    rows = [f"| {state} | {bits:,.1f} |" for state, bits in sorted(table.reserve_by_state.items())]
    rows.append(f"| any other state (pooled) | {table.reserve_pooled:,.1f} |")
    return "\n".join(rows)


def _entry_rows(entries: Mapping[str, PolicyEntry]) -> str:
    rows = []
    for key, entry in sorted(entries.items()):
        rl, lh = ([f"{pair[i]:g}" for pair in entry.priorities] for i in range(len(UPGRADE_STEPS)))
        rows.append(
            f"| {_cell(key)} | {' '.join(a.name for a in entry.action)} | {' '.join(a.name for a in entry.floor)} "
            f"| {' / '.join(rl)} | {' / '.join(lh)} |"
        )
    return "\n".join(rows) or "| (none: every tag gets H) | | | | |"


def _resolution_rows(table: Any) -> str:
    rows = []
    for tag, (key, _) in table._resolved.items():
        target = _cell(key) if key is not None else "no entry: H action and floor"
        rows.append(f"| {_cell('|'.join(tag))} | {target} |")
    return "\n".join(rows)


def _cell(key: str) -> str:
    """A lookup key as code in a Markdown table cell (its ``|`` escaped)."""
    return "`" + key.replace("|", "\\|") + "`"
