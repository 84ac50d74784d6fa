"""PASK's prefill companion (§3.6, A.3, B.4): a frozen retention plan for the prompt tokens, fixed before the prompt
forward and applied after it (full-precision prefill, then keep ``H``, quantise ``L``, release ``R``).

A `PrefillPolicy` holds, per semantic prompt label (`PROMPT_LABELS`, Table 6) and layer group, a base action, a
protection floor and the adjacent-upgrade priorities ``ρ(R→L)``, ``ρ(L→H)`` (the decode table's `PolicyEntry`), and
the prefill budget ``B_P``. `plan_prefill` turns the labels of ``n`` prompt tokens into actions ``[n, groups]``:

1. sink tokens (the first ``sink_tokens``) and the recent window (the last ``window``) are ``H`` in every group;
   they count in the payload;
2. every other token starts at its floor: the floor of its label's entry, or for a token with several labels
   (crossing a span boundary) the most protective action and floor over their entries, with a priority only where
   the entries agree (eq. 12, as `PolicyTable.lookup`); a label without an entry gives ``H`` (action and floor);
3. with target ``T_P = B_P · n · C_full`` bits, adjacent upgrades (``R→L``, ``L→H`` of one token in one group) are
   taken in descending priority, ties by token position and then layer group; an upgrade that would exceed ``T_P``
   is skipped (and its successor never becomes eligible), a step with an ambiguous priority is never taken.

Floors and protection are never overridden: when they alone cost more than ``T_P`` the plan is the floors and the
excess is recorded (`PrefillPlan.floor_excess_bits`). What the greedy rule guarantees (tested against brute force):
the plan never exceeds ``T_P`` when the floors fit, no skipped upgrade would still fit, and when every adjacent step
costs the same and each entry's ``ρ(R→L) >= ρ(L→H)``, the taken upgrades maximise the summed priority among all
plans that respect floors, protection and ``T_P``.

A saved policy is a folder (or a Hub model repository) with ``prefill_policy.json``: ``format_version``,
``hf_structkv_version``, ``labels`` (`PROMPT_LABELS`), ``conventions``, ``group_costs``, ``prefill_budget``
(``B_P``), ``entries`` (``{label: {"action", "floor", "priorities": {"R->L", "L->H"}}}`` as in
``policy_table.json``), ``thresholds``, ``calibration``, ``provenance``, ``description`` and ``fingerprint``.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from types import MappingProxyType
from typing import Any, ClassVar

import torch

from ..persistence import (
    CARD_NAME,
    base_model,
    card_front_matter,
    check_format_version,
    markdown_items,
    render_card,
)
from ..quant.int4_centred import check_int4_keys
from ..structure.prompt_spans import PROMPT_LABELS, label_prompt, token_labels
from ..validation import check_int, is_number
from ..version import __version__
from .costs import Action, GroupCosts, layer_groups
from .entries import PolicyEntry, PolicyLookup, merge_lookups
from .policy_file import PolicyFile, shipped_policy
from .policy_json import (
    CONVENTIONS,
    conventions_with_keys,
    costs_from_json,
    costs_to_json,
    entry_from_json,
    entry_to_json,
    int4_keys_of_conventions,
)
from .retention import RetentionPolicy
from .shipped import CALIBRATED, shipped_pair_folders

__all__ = [
    "PREFILL_POLICY_NAME",
    "PrefillPlan",
    "PrefillPolicy",
    "batch_prefill_plan",
    "calibrated_prefill_policy",
    "illustrative_prefill_policy",
    "plan_prefill",
]

FORMAT_VERSION = 1
PREFILL_POLICY_NAME = "prefill_policy.json"
ILLUSTRATIVE_PREFILL_POLICY = "qwen2.5-coder-0.5b-instruct-illustrative-prefill"
PREFILL_CONVENTIONS = {
    "payload_cost": CONVENTIONS["payload_cost"],
    "quantizer": CONVENTIONS["quantizer"],
    "resolution": "single-label-or-eq12-max",  # several labels: action = floor = max; a priority only where unique
    "allocation": "floors-then-greedy-upgrades-skip-unfit",
    "tie_order": "priority-then-position-then-group",
    "protection": "sinks-and-recent-window-high",
}
_JSON_FIELDS = (
    "format_version",
    "hf_structkv_version",
    "labels",
    "conventions",
    "group_costs",
    "prefill_budget",
    "entries",
    "thresholds",
    "calibration",
    "provenance",
    "description",
    "fingerprint",
)


@dataclass(frozen=True)
class PrefillPolicy(PolicyFile):
    """The frozen prefill record: per prompt label and layer group an action, a floor and priorities, and ``B_P``.

    Attributes:
        costs: the layer groups and their per-token payload costs (`GroupCosts`).
        entries: label (one of `PROMPT_LABELS`) -> `PolicyEntry`; a label without an entry is planned ``H``.
        budget: the prefill budget ``B_P`` in ``[0, 1]``.
        provenance: ``"calibrated"``, ``"illustrative"`` (hand-written) or ``"reference"``.
        description: free text.
        thresholds: calibration thresholds (``alpha_P``, ...), empty when not calibrated.
        calibration: JSON-serialisable calibration record.
        fingerprint: `persistence.model_fingerprint` of the model the policy was built for (required when
            calibrated), or ``None`` when it depends only on the layer dimensions.
        int4_keys: the key layout of its ``L`` tokens (``"row"``, ``"centred"`` or ``"centred-g128"``,
            `hf_structkv.quant.int4_centred`; the ``quantizer`` convention of its file).
    """

    costs: GroupCosts
    entries: Mapping[str, PolicyEntry]
    budget: float
    provenance: str = "calibrated"
    description: str = ""
    thresholds: Mapping[str, float] = field(default_factory=dict)
    calibration: Mapping[str, Any] = field(default_factory=dict)
    fingerprint: Mapping[str, Any] | None = None
    int4_keys: str = "row"

    _FILE_NAME: ClassVar[str] = PREFILL_POLICY_NAME
    SAVED_FILES: ClassVar[tuple[str, ...]] = (PREFILL_POLICY_NAME, CARD_NAME)
    _WHAT: ClassVar[str] = "prefill policy"

    def __post_init__(self) -> None:
        if not isinstance(self.costs, GroupCosts):
            raise TypeError(f"PrefillPolicy.costs must be a GroupCosts, got {type(self.costs).__name__}")
        if len(self.costs.groups) != 3 or self.costs.groups != layer_groups(self.costs.groups[-1].stop):
            raise ValueError(
                "PrefillPolicy.costs must have the 3 layer groups of A.2 (GroupCosts.from_config(config)); got "
                f"group_costs.layer_groups {[(g.start, g.stop) for g in self.costs.groups]}"
            )
        self._check_cost_values()
        for name in ("entries", "thresholds", "calibration"):
            if not isinstance(getattr(self, name), Mapping):
                raise TypeError(f"PrefillPolicy.{name} must be a mapping, got {type(getattr(self, name)).__name__}")
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
        groups = len(self.costs.groups)
        for label, entry in self.entries.items():
            if label not in PROMPT_LABELS:
                raise ValueError(f"unknown prompt label {label!r} in entries; labels are {PROMPT_LABELS}")
            if not isinstance(entry, PolicyEntry) or len(entry.action) != groups:
                raise ValueError(f"entries[{label!r}] must be a PolicyEntry with one action per layer group ({groups})")
        if not is_number(self.budget) or not 0 <= self.budget <= 1:
            raise ValueError(
                f"budget (B_P) must be a number in [0, 1] (prefill_budget in the file), got {self.budget!r}"
            )
        check_int4_keys(self.int4_keys)
        self._check_records()

    def lookup(self, labels: Sequence[str]) -> PolicyLookup:
        """Base action, floor and priorities per group of a token carrying ``labels`` (eq. 12 over several labels:
        action = floor = the most protective of their actions and floors; a priority only where all agree).

        Raises:
            ValueError: no labels, or a label not in `PROMPT_LABELS`.
        """
        distinct = sorted(set(labels), key=_label_order)
        if not distinct:
            raise ValueError("a token needs at least one prompt label")
        groups = len(self.costs.groups)
        if any(label not in self.entries for label in distinct):
            return PolicyLookup((Action.H,) * groups, (Action.H,) * groups, ((None, None),) * groups)
        looked_up = [self.entries[label].lookup() for label in distinct]
        return looked_up[0] if len(looked_up) == 1 else merge_lookups(looked_up)

    # ------------------------------------------------------------------------------------------------ JSON, files
    def to_json_dict(self) -> dict[str, Any]:
        """The ``prefill_policy.json`` content (see the module docstring)."""
        return {
            "format_version": FORMAT_VERSION,
            "hf_structkv_version": __version__,
            "labels": list(PROMPT_LABELS),
            "conventions": conventions_with_keys(PREFILL_CONVENTIONS, self.int4_keys),
            "group_costs": costs_to_json(self.costs),
            "prefill_budget": self.budget,
            "entries": {label: entry_to_json(self.entries[label]) for label in PROMPT_LABELS if label in self.entries},
            **self._records_to_json(),
        }

    @classmethod
    def from_json_dict(cls, record: Any) -> PrefillPolicy:
        """Parse and validate a ``prefill_policy.json`` content.

        Raises:
            ValueError: naming the field: unknown format version, missing or unknown fields, other labels or
                conventions than this hf_structkv's, malformed entries or costs, a budget outside ``[0, 1]``.
        """
        if not isinstance(record, dict):
            raise ValueError(f"{PREFILL_POLICY_NAME} must hold a JSON object, got {type(record).__name__}")
        check_format_version(record.get("format_version"), FORMAT_VERSION, PREFILL_POLICY_NAME)
        unknown, missing = sorted(record.keys() - set(_JSON_FIELDS)), sorted(set(_JSON_FIELDS) - record.keys())
        if unknown or missing:
            raise ValueError(f"{PREFILL_POLICY_NAME} has unknown fields {unknown} and lacks the fields {missing}")
        if record["labels"] != list(PROMPT_LABELS):
            raise ValueError(f"labels in {PREFILL_POLICY_NAME} must be {list(PROMPT_LABELS)}, got {record['labels']!r}")
        int4_keys = int4_keys_of_conventions(record["conventions"], PREFILL_CONVENTIONS, PREFILL_POLICY_NAME)
        entries = record["entries"]
        if not isinstance(entries, dict):
            raise ValueError(f"entries in {PREFILL_POLICY_NAME} must be a JSON object of label -> entry")
        return cls(
            costs=costs_from_json(record["group_costs"]),
            entries={label: entry_from_json(label, value) for label, value in entries.items()},
            budget=record["prefill_budget"],
            int4_keys=int4_keys,
            **cls._records_from_json(record),
        )

    def render_card(self, repo_id: str | None = None) -> str:
        """The ``README.md`` of a saved prefill policy, from the ``model_cards/prefill_policy.md`` template."""
        fingerprint = dict(self.fingerprint or {})
        base = base_model({"fingerprint": fingerprint})
        rows = [
            f"| {label} | {' '.join(a.name for a in entry.action)} | {' '.join(a.name for a in entry.floor)} |"
            for label, entry in sorted(self.entries.items(), key=lambda item: _label_order(item[0]))
        ]
        return render_card(
            "prefill_policy.md",
            front_matter=card_front_matter(["pask-prefill-policy", self.provenance], base),
            model_name=base or fingerprint.get("architecture", "any model with these layer dimensions"),
            provenance=self.provenance,
            description=self.description or "none",
            repo_id=repo_id or "<this repository id or local folder>",
            budget=self.budget,
            int4_keys=self.int4_keys,
            entry_rows="\n".join(rows) or "| (none: every label is planned H) | | |",
            thresholds=markdown_items(dict(self.thresholds)),
            calibration=markdown_items(dict(self.calibration)),
            fingerprint=json.dumps(fingerprint, indent=2, sort_keys=True) if fingerprint else "null",
            hf_structkv_version=__version__,
            format_version=FORMAT_VERSION,
        )


@dataclass(frozen=True)
class PrefillPlan:
    """What `plan_prefill` decided for ``n`` prompt tokens.

    Attributes:
        actions: int64 ``[n, groups]`` of `Action` values (R=0, L=1, H=2).
        payload_bits: the plan's scheduled payload ``Σ_c H_c m(H, c) + L_c m(L, c)`` (protected positions included).
        target_bits: ``T_P = B_P · n · C_full``.
        full_bits: ``n · C_full`` (Full KV).
        floor_excess_bits: how far floors and protection alone exceed ``T_P`` (0 when they fit).
    """

    actions: torch.Tensor
    payload_bits: int
    target_bits: float
    full_bits: int
    floor_excess_bits: float

    @property
    def payload_ratio(self) -> float:
        """The realised prefill budget: ``payload_bits / full_bits``."""
        return self.payload_bits / self.full_bits


def plan_prefill(
    token_labels: Sequence[Sequence[str]], costs: GroupCosts, policy: PrefillPolicy, sink_tokens: int, window: int
) -> PrefillPlan:
    """The prefill plan of B.4 for one prompt (algorithm in the module docstring).

    Args:
        token_labels: per prompt token, its labels (`hf_structkv.structure.prompt_spans.token_labels`).
        costs: the model's `GroupCosts`; must equal ``policy.costs``.
        policy: the `PrefillPolicy`.
        sink_tokens: the first positions kept ``H`` (the decode policy's ``sink_tokens``).
        window: the last positions kept ``H`` (the decode policy's ``window``: they are still in the recent window
            when prefill ends).

    Raises:
        TypeError: ``policy`` or ``costs`` of the wrong type, a token's labels given as one str.
        ValueError: no tokens, a token without labels or with an unknown label, costs that are not the policy's,
            negative ``sink_tokens`` / ``window``.
    """
    if not isinstance(policy, PrefillPolicy):
        raise TypeError(f"policy must be a PrefillPolicy, got {type(policy).__name__}")
    if not isinstance(costs, GroupCosts):
        raise TypeError(f"costs must be a GroupCosts (GroupCosts.from_config(model.config)), got {type(costs)}")
    if costs != policy.costs:
        raise ValueError(f"the prefill policy was built for group costs {policy.costs}, the model's are {costs}")
    check_int("sink_tokens", sink_tokens, 0)
    check_int("window", window, 0)
    n = len(token_labels)
    if n == 0:
        raise ValueError("token_labels is empty: a prompt has at least one token")
    groups = len(costs.groups)
    cost = [[costs.cost(a, c) for a in Action] for c in range(groups)]
    actions = [[int(Action.H)] * groups for _ in range(n)]
    lookups: list[PolicyLookup | None] = [None] * n
    cached: dict[tuple[str, ...], PolicyLookup] = {}
    spent = 0
    heap = []
    for t, labels in enumerate(token_labels):
        if isinstance(labels, str):
            raise TypeError(f"token_labels[{t}] must be a tuple of labels, got the str {labels!r}")
        key = tuple(labels)
        if key not in cached:
            cached[key] = policy.lookup(key)  # validates the labels of protected tokens too
        if t < sink_tokens or t >= n - window:
            spent += costs.full
            continue
        lookups[t] = looked_up = cached[key]
        for c in range(groups):
            a = int(looked_up.floor[c])
            actions[t][c] = a
            spent += cost[c][a]
            if a < Action.H and looked_up.priorities[c][a] is not None:
                heap.append((-looked_up.priorities[c][a], t, c))
    target = Fraction(policy.budget) * n * costs.full
    floor_excess = max(spent - target, 0)
    heapq.heapify(heap)
    while heap:
        _, t, c = heapq.heappop(heap)
        a = actions[t][c]
        if spent + cost[c][a + 1] - cost[c][a] > target:
            continue
        spent += cost[c][a + 1] - cost[c][a]
        actions[t][c] = a = a + 1
        score = lookups[t].priorities[c][a] if a < Action.H else None
        if score is not None:
            heapq.heappush(heap, (-score, t, c))
    return PrefillPlan(
        actions=torch.tensor(actions, dtype=torch.int64),
        payload_bits=spent,
        target_bits=float(target),
        full_bits=n * costs.full,
        floor_excess_bits=float(floor_excess),
    )


def batch_prefill_plan(
    tokenizer,
    prompts: Sequence[str],
    tools: Sequence[Mapping[str, Any]],
    prefill_policy: PrefillPolicy,
    policy: RetentionPolicy,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
) -> torch.Tensor:
    """The ``prefill_plan`` ``[B, P, 3]`` of a left-padded batch of chat-template prompts, for the
    `StructuredMixedPrecisionCache`: each row's plan (`label_prompt` -> `token_labels` -> `plan_prefill` with the
    decode ``policy``'s costs, sink tokens and window) right-aligned, padding positions ``R``.

    Args:
        prompts: the prompt texts, one per row.
        tools: the tool definitions the prompts embed.
        input_ids, attention_mask: ``[B, P]``, the tokenised batch (``add_special_tokens=False``, left padding).

    Raises:
        ValueError: a row whose unpadded ids are not ``tokenizer(prompt, add_special_tokens=False)`` of its prompt,
            or a right-padded row.
    """
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape or len(prompts) != input_ids.shape[0]:
        raise ValueError("input_ids and attention_mask must be [B, P] with one prompt per row")
    plan = torch.full((*input_ids.shape, len(policy.costs.groups)), int(Action.R), dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        real = attention_mask[row].bool().cpu()
        n = int(real.sum())
        if not bool(real[input_ids.shape[1] - n :].all()):
            raise ValueError(f"row {row} of the batch is not left-padded; tokenise with padding_side='left'")
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        if ids != input_ids[row, input_ids.shape[1] - n :].tolist():
            raise ValueError(f"row {row} of input_ids is not tokenizer(prompts[{row}], add_special_tokens=False)")
        labels = token_labels(tokenizer, prompt, label_prompt(prompt, tools))
        row_plan = plan_prefill(labels, policy.costs, prefill_policy, policy.sink_tokens, policy.window)
        plan[row, input_ids.shape[1] - n :] = row_plan.actions
    return plan


def illustrative_prefill_policy(model: Any = None) -> PrefillPolicy:
    """The hand-written, **not calibrated** prefill policy shipped for the embedded model
    (Qwen2.5-Coder-0.5B-Instruct): schema scaffold and descriptions cheap, function names, parameter keys, enum
    values and protected content (instructions, the request) protected, ``B_P = 0.45``. It only exercises the
    prefill companion; it promises no accuracy.

    Args:
        model: when given, checked against the policy's fingerprint and costs.
    """
    return shipped_policy(PrefillPolicy, ILLUSTRATIVE_PREFILL_POLICY, model)


def calibrated_prefill_policy(model: Any = None, name: str = CALIBRATED) -> PrefillPolicy:
    """The prefill policy calibrated by ``hf-structkv calibrate --prefill-only`` (PASK Algorithm 1's prefill stage,
    decode all-high) for the embedded model on the same CPU-sized BFCL calibration / development split as
    `calibrated_policy`; its ``calibration`` records the data, thresholds, realised ``B_P`` and the development
    accuracy against all-high, and the folder's ``calibration_report.json`` every measurement.

    Args:
        model: when given, checked against the policy's fingerprint and costs.
        name: the shipped pair (`SHIPPED_PAIRS`; ``"calibrated"``: the default pair).
    """
    return shipped_policy(PrefillPolicy, shipped_pair_folders(name)[1], model)


def _label_order(label: str) -> int:
    if label not in PROMPT_LABELS:
        raise ValueError(f"unknown prompt label {label!r}; labels are {PROMPT_LABELS}")
    return PROMPT_LABELS.index(label)
