"""The JSON pieces of PASK's policy files (``policy_table.json``, ``prefill_policy.json``): entries, layer-group costs,
field checks that name the bad field, and the readable indentation both files are written with."""

from __future__ import annotations

import json
from typing import Any

from ..persistence import FINGERPRINT_LIMITS
from ..quant.int4_centred import QUANTIZERS, int4_keys_of_quantizer
from ..validation import is_int
from .costs import Action, GroupCosts
from .entries import UPGRADE_STEPS, PolicyEntry, is_score

__all__ = [
    "CONVENTIONS",
    "conventions_with_keys",
    "int4_keys_of_conventions",
    "FORMAT_VERSION",
    "TABLE_NAME",
    "costs_from_json",
    "costs_to_json",
    "entry_from_json",
    "entry_to_json",
    "json_object",
    "json_text",
]

FORMAT_VERSION = 1
TABLE_NAME = "policy_table.json"
# The rules a decode table is compiled under, recorded in its file: a file compiled under other rules is refused.
CONVENTIONS = {
    "payload_cost": "pask-b3",  # m(R,c)=0, m(H,c)=16 n_c, m(L,c)=4 n_c + 16 k_c + 4 p_c bits per token
    "quantizer": QUANTIZERS["row"],  # B.5: per token x KV-head row, scale max|x|/7, codes [-7, 7] (or centred keys)
    "fallback": "class|role|state|next>class|role|state>class|role>class",  # B.1; no entry -> H action and floor
    "resolution": "single-entry-or-eq12-max",  # eq. 12 over distinct entries; promotion scores only when unique
    "tie_order": "score-then-group",  # demote ascending (score, group), promote descending (score, group)
    "reserve_state": "max-over-candidates-pooled-when-empty",  # Γ of a token: max over its candidates' states
}


def conventions_with_keys(conventions: dict[str, str], int4_keys: str) -> dict[str, str]:
    """``conventions`` with the ``quantizer`` of the key layout ``int4_keys`` (`QUANTIZERS`)."""
    return {**conventions, "quantizer": QUANTIZERS[int4_keys]}


def int4_keys_of_conventions(conventions: Any, expected: dict[str, str], where: str) -> str:
    """The key layout of a policy file's ``conventions``: every convention but ``quantizer`` as ``expected``, the
    ``quantizer`` one of `QUANTIZERS`.

    Raises:
        ValueError: naming ``where`` and the conventions that differ.
    """
    if not isinstance(conventions, dict):
        raise ValueError(f"conventions in {where} must be a JSON object, got {type(conventions).__name__}")
    differ = sorted(
        k for k in expected.keys() | conventions.keys() if k != "quantizer" and conventions.get(k) != expected.get(k)
    )
    if differ:
        raise ValueError(
            f"{where} was compiled under conventions this hf_structkv does not implement: {differ} "
            f"(expected {expected})"
        )
    return int4_keys_of_quantizer(conventions.get("quantizer"), where)


def entry_to_json(entry: PolicyEntry) -> dict[str, Any]:
    return {
        "action": [a.name for a in entry.action],
        "floor": [a.name for a in entry.floor],
        "priorities": {step: [pair[i] for pair in entry.priorities] for i, step in enumerate(UPGRADE_STEPS)},
    }


def entry_from_json(key: str, value: Any) -> PolicyEntry:
    value = json_object(value, f"entries[{key!r}]", ("action", "floor", "priorities"))
    actions = [_actions_from_json(value[name], f"entries[{key!r}].{name}") for name in ("action", "floor")]
    priorities = json_object(value["priorities"], f"entries[{key!r}].priorities", UPGRADE_STEPS)
    scores = []
    for step in UPGRADE_STEPS:
        column = priorities[step]
        if not isinstance(column, list) or len(column) != len(actions[0]) or not all(is_score(s) for s in column):
            raise ValueError(
                f"entries[{key!r}].priorities[{step!r}] must list one finite score >= 0 per layer group "
                f"({len(actions[0])}), got {column!r}"
            )
        scores.append(column)
    return PolicyEntry(actions[0], actions[1], tuple(zip(*scores)))


def _actions_from_json(values: Any, where: str) -> tuple[Action, ...]:
    if not isinstance(values, list) or not all(isinstance(v, str) and v in Action.__members__ for v in values):
        raise ValueError(f"{where} must list one action 'R', 'L' or 'H' per layer group, got {values!r}")
    return tuple(Action[v] for v in values)


def costs_to_json(costs: GroupCosts) -> dict[str, list]:
    """The ``group_costs`` object of a policy file (`costs_from_json` reads it back)."""
    return {
        "layer_groups": [[g.start, g.stop] for g in costs.groups],
        "elements": list(costs.elements),
        "rows": list(costs.rows),
        "padding": list(costs.padding),
    }


def costs_from_json(value: Any) -> GroupCosts:
    value = json_object(value, "group_costs", ("layer_groups", "elements", "rows", "padding"))
    bounds = value["layer_groups"]
    most = FINGERPRINT_LIMITS["num_hidden_layers"]
    if not isinstance(bounds, list) or not all(
        isinstance(b, list) and len(b) == 2 and all(is_int(x) and 0 <= x <= most for x in b) for b in bounds
    ):
        raise ValueError(
            f"group_costs.layer_groups must list [start, stop) pairs of layer indices in [0, {most}], got {bounds!r}"
        )
    lists = []
    for name in ("elements", "rows", "padding"):
        values = value[name]
        if not isinstance(values, list) or not all(is_int(v) and v >= 0 for v in values):
            raise ValueError(f"group_costs.{name} must hold one integer >= 0 per layer group, got {values!r}")
        lists.append(tuple(values))
    return GroupCosts(tuple(range(a, b) for a, b in bounds), *lists)


def json_text(value: Any, indent: int = 0) -> str:
    """``value`` as indented JSON with lists of scalars on one line (readable action and priority rows)."""
    inner = " " * (indent + 2)
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(k)}: {json_text(v, indent + 2)}" for k, v in value.items()]
    elif isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        items = [inner + json_text(v, indent + 2) for v in value]
    else:
        return json.dumps(value, allow_nan=False)
    opening, closing = ("{", "}") if isinstance(value, dict) else ("[", "]")
    return opening + "\n" + ",\n".join(items) + "\n" + " " * indent + closing


def json_object(
    value: Any, where: str, fields: tuple[str, ...] | None = None, file_name: str = TABLE_NAME
) -> dict[str, Any]:
    """``value`` as a JSON object, with exactly ``fields`` when given (errors name ``where`` in ``file_name``)."""
    if not isinstance(value, dict):
        raise ValueError(f"{where} in {file_name} must be a JSON object, got {type(value).__name__}")
    if fields is not None and set(value) != set(fields):
        raise ValueError(
            f"{where} in {file_name} must have exactly the fields {list(fields)}: unknown "
            f"{sorted(value.keys() - set(fields))}, missing {sorted(set(fields) - value.keys())}"
        )
    return value
