"""The frozen PASK policy table (A.4): what the online controller looks up for every generated token.

Per lookup key (a structural-tag fallback key, B.1) and layer group the table holds a base action, a protection floor
and the adjacent-upgrade priorities ``ρ(R→L)`` and ``ρ(L→H)`` (eq. 8); beside them the decode budget ``B_D``, the
reserve table ``Γ(state)`` with a pooled fallback (eq. 10), the sink / recent-window settings, the layer groups and
their payload costs, and the conventions the table was compiled under.

A saved table is a folder (or a Hub model repository) of two files; loading reads JSON only, so it never runs code:

* ``policy_table.json``: ``format_version``, ``hf_structkv_version``, ``family`` (``"function_calling"`` or
  ``"sql"``), ``vocabulary`` (the tag vocabulary of the family, Table 5), ``conventions`` (identifiers of the cost,
  quantiser, fallback, resolution, tie-order and reserve-state rules), ``group_costs`` (``layer_groups`` as
  ``[start, stop)`` pairs, three groups or one for the no-layer-groups ablation, and ``elements`` / ``rows`` /
  ``padding`` = ``n_c`` / ``k_c`` / ``p_c`` per group), ``decode_budget`` (``B_D``), ``sink_tokens``, ``window``,
  ``tag_view`` and ``position_bins`` (the structural view the tags are served in, Fig. 5; optional: a file without
  them means full tags), ``reserve`` (``by_state`` bits and ``pooled`` bits),
  ``entries`` (``{key: {"action": ["R"|"L"|"H"] * groups, "floor": [...], "priorities": {"R->L": [...],
  "L->H": [...]}}}``), ``thresholds``, ``calibration``, ``provenance`` (``"calibrated"``, ``"illustrative"`` or
  ``"reference"``), ``description`` and ``fingerprint`` (`hub.model_fingerprint`, or ``null`` for a table that only
  depends on the layer dimensions, such as the all-high reference).
* ``README.md``: a card rendered from ``model_cards/policy_table.md``.

Lookup (B.1, eq. 12): each candidate tag resolves to the first of its fallback keys ``class|role|state|next`` →
``class|role|state`` → ``class|role`` → ``class`` that has an entry (precomputed for the whole vocabulary, so a lookup
is one dictionary access per candidate). When every candidate resolves to the same entry, that entry's base action,
floor and priorities are returned. When they resolve to several entries, each group gets base = floor = the most
protective of their actions and floors, and a promotion score only where all those entries agree on it (an ambiguous
score is ``None``: that step is never taken). No candidates, or a candidate with no compatible entry, gives ``H`` as
action and floor in every group.
"""

from __future__ import annotations

import importlib.resources
import json
import math
import os
import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, NamedTuple, TypeVar

from ..structure.tags import NEXT, ROLES, STATES, TAG_CLASSES, StructuralTag, check_tag_view, view_vocabulary
from ..validation import is_int
from .costs import GROUP_COUNTS, Action, GroupCosts, group_names, layer_groups

__all__ = [
    "DEFAULT_SINK_TOKENS",
    "DEFAULT_WINDOW",
    "PolicyEntry",
    "PolicyLookup",
    "PolicyTable",
    "all_high_entries",
    "calibrated_policy",
    "illustrative_policy",
]

FORMAT_VERSION = 1
TABLE_NAME = "policy_table.json"
CARD_NAME = "README.md"  # as hf_structkv.hub.CARD_NAME
POLICY_FILES = (TABLE_NAME, CARD_NAME)
DEFAULT_SINK_TOKENS = 4
"""Positions at the start of the sequence (prompt included) kept ``H`` as attention sinks (StreamingLLM's usual 4)."""
DEFAULT_WINDOW = 32
"""Most recent generated tokens kept ``H``; a scheduled ``L`` / ``R`` applies when a token leaves this window. 32 is
the middle of the recent-window range PASK's baselines are tuned over (16-128) and leaves the one-token tag delay of
the logits processor far inside the window."""
PROVENANCES = ("calibrated", "illustrative", "reference")
CONVENTIONS = {
    "payload_cost": "pask-b3",  # m(R,c)=0, m(H,c)=16 n_c, m(L,c)=4 n_c + 16 k_c + 4 p_c bits per token
    "quantizer": "int4-symmetric-row-fp16-scale",  # B.5: per token x KV-head row, scale max|x|/7, codes [-7, 7]
    "fallback": "class|role|state|next>class|role|state>class|role>class",  # B.1; no entry -> H action and floor
    "resolution": "single-entry-or-eq12-max",  # eq. 12 over distinct entries; promotion scores only when unique
    "tie_order": "score-then-group",  # demote ascending (score, group), promote descending (score, group)
    "reserve_state": "max-over-candidates-pooled-when-empty",  # Γ of a token: max over its candidates' states
}
UPGRADE_STEPS = ("R->L", "L->H")
ILLUSTRATIVE_POLICY = "qwen2.5-coder-0.5b-instruct-illustrative"
CALIBRATED_POLICY = "qwen2.5-coder-0.5b-instruct-calibrated"

_JSON_FIELDS = (
    "format_version",
    "hf_structkv_version",
    "family",
    "vocabulary",
    "conventions",
    "group_costs",
    "decode_budget",
    "sink_tokens",
    "window",
    "tag_view",
    "position_bins",
    "reserve",
    "entries",
    "thresholds",
    "calibration",
    "provenance",
    "description",
    "fingerprint",
)

_OPTIONAL_JSON_FIELDS = {"tag_view": "full", "position_bins": []}
"""Fields a table file may lack (written before they existed), with the value such a file means."""


def _vocabulary(family: str) -> dict[str, list[str]]:
    """The tag vocabulary of ``family`` as recorded in the JSON file."""
    return {
        "tag_class": list(TAG_CLASSES),
        "role": list(ROLES[family]),
        "state": list(STATES[family]),
        "next": list(NEXT),
    }


def _valid_keys(family: str, tag_view: str, position_bins: tuple[int, ...]) -> frozenset[str]:
    """Every lookup key of ``family`` under ``tag_view``: the fallback keys of all the tags the view emits."""
    return frozenset(key for tag in view_vocabulary(family, tag_view, position_bins) for key in tag.fallback_keys())


def all_high_entries(
    groups: int, family: str = "function_calling", tag_view: str = "full", position_bins: tuple[int, ...] = ()
) -> dict[str, PolicyEntry]:
    """One ``H`` entry (action, floor, zero priorities in ``groups`` groups) per tag class the view emits: every
    token of that view resolves to ``H``."""
    high = PolicyEntry((Action.H,) * groups, (Action.H,) * groups, ((0.0, 0.0),) * groups)
    classes = dict.fromkeys(tag.tag_class for tag in view_vocabulary(family, tag_view, position_bins))
    return dict.fromkeys(classes, high)


class PolicyLookup(NamedTuple):
    """What the table gives a token (per layer group): the starting point of Algorithm 2.

    Attributes:
        base: the base action ``a⁰`` per group.
        floor: the floor ``a⁻`` per group (never crossed).
        priorities: per group ``(ρ(R→L), ρ(L→H))``; ``None`` where the score is ambiguous (several entries disagree),
            and such a step is never taken.
    """

    base: tuple[Action, ...]
    floor: tuple[Action, ...]
    priorities: tuple[tuple[float | None, float | None], ...]


@dataclass(frozen=True)
class PolicyEntry:
    """One calibrated bucket: per layer group the base action, the floor and the adjacent-upgrade priorities.

    Attributes:
        action: base action ``a⁰`` per group.
        floor: protection floor ``a⁻`` per group. A floor above the action is allowed: the controller starts from
            ``max(action, floor)`` (eq. 11).
        priorities: per group ``(ρ(R→L), ρ(L→H))``, finite and ``>= 0``: the controller demotes the step with the
            smallest score first and promotes the one with the largest first.
    """

    action: tuple[Action, ...]
    floor: tuple[Action, ...]
    priorities: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        for name in ("action", "floor"):
            values = getattr(self, name)
            if not isinstance(values, tuple) or not all(isinstance(a, Action) for a in values):
                raise TypeError(f"PolicyEntry.{name} must be a tuple of Action values (one per layer group)")
        if not isinstance(self.priorities, tuple) or not all(
            isinstance(pair, tuple) and len(pair) == 2 and all(_is_score(s) for s in pair) for pair in self.priorities
        ):
            raise ValueError(
                "PolicyEntry.priorities must be a tuple of (ρ(R->L), ρ(L->H)) pairs of finite numbers >= 0, "
                f"one per layer group, got {self.priorities!r}"
            )
        if not len(self.action) == len(self.floor) == len(self.priorities):
            raise ValueError(
                f"PolicyEntry needs one action, floor and priority pair per layer group, got {len(self.action)} "
                f"actions, {len(self.floor)} floors and {len(self.priorities)} priority pairs"
            )

    def lookup(self) -> PolicyLookup:
        """This entry as a lookup result."""
        return PolicyLookup(self.action, self.floor, self.priorities)


_Saved = TypeVar("_Saved", bound="_PolicyFile")


class _PolicyFile:
    """What `PolicyTable` and `PrefillPolicy` share as policies saved in one JSON file: the checks of their
    ``provenance``, ``description``, ``thresholds``, ``calibration`` and ``fingerprint`` fields (`_check_records`,
    run by their ``__post_init__`` after ``costs`` is checked and the mappings frozen), `from_pretrained` and
    `check_model`.

    A subclass names its JSON file (``_FILE_NAME``), the files a Hub download fetches (``_HUB_FILES``) and itself in
    messages (``_WHAT``).
    """

    _FILE_NAME: ClassVar[str]
    _HUB_FILES: ClassVar[tuple[str, ...]]
    _WHAT: ClassVar[str]

    def _check_records(self) -> None:
        if self.provenance not in PROVENANCES:
            raise ValueError(f"provenance must be one of {PROVENANCES}, got {self.provenance!r}")
        if not isinstance(self.description, str):
            raise TypeError(f"description must be a str, got {type(self.description).__name__}")
        for name, value in self.thresholds.items():
            if not isinstance(name, str) or not _is_number(value):
                raise ValueError(f"thresholds must map names to finite numbers, got {name!r}: {value!r}")
        try:
            calibration = json.loads(json.dumps(dict(self.calibration), allow_nan=False))
        except (TypeError, ValueError) as err:
            raise ValueError(f"calibration must be JSON-serialisable (no NaN): {err}") from None
        object.__setattr__(self, "calibration", MappingProxyType(calibration))
        if self.fingerprint is None:
            if self.provenance == "calibrated":
                raise ValueError(
                    f"a calibrated {self._WHAT} needs the fingerprint of its model: "
                    "fingerprint=model_fingerprint(model) (from hf_structkv.hub import model_fingerprint)"
                )
            return
        if not isinstance(self.fingerprint, Mapping):
            raise TypeError(f"fingerprint must be a dict or None, got {type(self.fingerprint).__name__}")
        missing = [name for name in _hub().STRUCTURE_FIELDS if name not in self.fingerprint]
        if missing:
            raise ValueError(
                f"the fingerprint lacks the fields {missing}; build it with hf_structkv.hub.model_fingerprint(model)"
            )
        layers = self.fingerprint["num_hidden_layers"]
        kv_heads, head_dim = self.fingerprint["num_key_value_heads"], self.fingerprint["head_dim"]
        if not all(is_int(v) and v > 0 for v in (layers, kv_heads, head_dim)):
            raise ValueError("the fingerprint's num_hidden_layers, num_key_value_heads and head_dim must be positive")
        groups = len(self.costs.groups)
        if GroupCosts.from_dims([kv_heads] * layers, [head_dim] * layers, groups) != self.costs:
            raise ValueError(
                f"costs do not match the fingerprint's model ({layers} layers, {kv_heads} KV heads, head_dim "
                f"{head_dim}): build them with GroupCosts.from_config(model.config, groups={groups})"
            )
        object.__setattr__(self, "fingerprint", json.loads(json.dumps(dict(self.fingerprint), allow_nan=False)))

    def _records_to_json(self) -> dict[str, Any]:
        """The JSON fields of the checked records (`_check_records`), as both files write them."""
        return {
            "thresholds": dict(self.thresholds),
            "calibration": dict(self.calibration),
            "provenance": self.provenance,
            "description": self.description,
            "fingerprint": None if self.fingerprint is None else dict(self.fingerprint),
        }

    @classmethod
    def _records_from_json(cls, record: dict[str, Any]) -> dict[str, Any]:
        """The constructor keywords of the records in a parsed file (``thresholds`` and ``calibration`` must be JSON
        objects; the rest is checked by `_check_records`)."""
        return {
            "thresholds": _json_object(record["thresholds"], "thresholds", file_name=cls._FILE_NAME),
            "calibration": _json_object(record["calibration"], "calibration", file_name=cls._FILE_NAME),
            "provenance": record["provenance"],
            "description": record["description"],
            "fingerprint": record["fingerprint"],
        }

    @classmethod
    def from_pretrained(
        cls: type[_Saved],
        path_or_repo_id: str | os.PathLike,
        model: Any = None,
        revision: str | None = None,
        token: str | None = None,
    ) -> _Saved:
        """Load what `save_pretrained` wrote, from a folder or a Hub repository (JSON only, no code runs).

        Args:
            model: when given, the policy must fit it (`check_model`).
            revision: Hub branch, tag or commit (ignored for a folder).
            token: Hub token for private repositories.

        Raises:
            ValueError: a missing or invalid JSON file (see ``from_json_dict``), or a model the policy was not built
                for.
        """
        folder = _hub()._resolve_folder(path_or_repo_id, revision, token, files=cls._HUB_FILES)
        policy = cls.from_json_dict(_hub()._read_config(folder, cls._FILE_NAME, cls._WHAT))
        if model is not None:
            policy.check_model(model)
        return policy

    def check_model(self, model: Any) -> None:
        """Raise ``ValueError`` unless ``model`` has this policy's fingerprint (when recorded) and layer-group costs."""
        if self.fingerprint is not None:
            _hub()._check_same_model(dict(self.fingerprint), _hub().model_fingerprint(model), what=self._WHAT)
        costs = GroupCosts.from_config(model.config, len(self.costs.groups))
        if costs != self.costs:
            raise ValueError(
                f"this {self._WHAT} was built for other layer dimensions: its group costs are {self.costs}, the "
                f"model's are {costs}"
            )


@dataclass(frozen=True)
class PolicyTable(_PolicyFile):
    """The frozen record a PASK controller runs from (A.4). Validated on construction; compare with ``==``.

    Attributes:
        family: the grammar family of the tag vocabulary (``"function_calling"`` or ``"sql"``).
        costs: the layer groups and their per-token payload costs (`GroupCosts`).
        entries: lookup key (``class``, ``class|role``, ``class|role|state`` or ``class|role|state|next``) ->
            `PolicyEntry`.
        budget: the decode budget ``B_D`` in ``[0, 1]``: each non-stop token adds ``B_D · C_full`` bits of allowance.
        reserve_by_state: ``Γ(state)`` in bits for the parser states seen in calibration.
        reserve_pooled: ``Γ`` in bits for any other state (the pooled quantile).
        sink_tokens: the first positions of the sequence (prompt included) kept ``H`` (matters once a prefill plan
            quantises or releases prompt tokens).
        window: the most recent generated tokens kept ``H`` (>= 1: a token's tag arrives one step late).
        tag_view: the view of the tags the table was calibrated on and must be served with (`TAG_VIEWS`:
            ``"full"``, or a structural ablation such as ``"no_role"``); the processor feeding the cache must emit
            the same view (``generate_calls`` builds it so).
        position_bins: the bin starts of the ``"position_bins"`` view (`position_bin_starts`; ``()`` otherwise):
            its keys are ``position|bin_<k>...``, and the processor must use the same bins.
        provenance: ``"calibrated"`` (Algorithm 1 output), ``"illustrative"`` (hand-written, not calibrated) or
            ``"reference"`` (the all-high policy).
        description: free text shown in the card.
        thresholds: calibration thresholds (``tau_low``, ``tau_high``, ``alpha``...), empty when not calibrated.
        calibration: JSON-serialisable calibration record (data, reserve horizon and quantile, ...).
        fingerprint: `hub.model_fingerprint` of the model the table was built for, or ``None`` when it depends only
            on the layer dimensions in ``costs`` (required for calibrated tables).
    """

    family: str
    costs: GroupCosts
    entries: Mapping[str, PolicyEntry]
    budget: float
    reserve_by_state: Mapping[str, float] = field(default_factory=dict)
    reserve_pooled: float = 0.0
    sink_tokens: int = DEFAULT_SINK_TOKENS
    window: int = DEFAULT_WINDOW
    tag_view: str = "full"
    position_bins: tuple[int, ...] = ()
    provenance: str = "calibrated"
    description: str = ""
    thresholds: Mapping[str, float] = field(default_factory=dict)
    calibration: Mapping[str, Any] = field(default_factory=dict)
    fingerprint: Mapping[str, Any] | None = None

    _FILE_NAME: ClassVar[str] = TABLE_NAME
    _HUB_FILES: ClassVar[tuple[str, ...]] = POLICY_FILES
    _WHAT: ClassVar[str] = "policy table"

    def __post_init__(self) -> None:
        if self.family not in ROLES:
            raise ValueError(f"family must be one of {tuple(ROLES)}, got {self.family!r}")
        self._check_costs()
        for name in ("entries", "reserve_by_state", "thresholds", "calibration"):
            if not isinstance(getattr(self, name), Mapping):
                raise TypeError(f"PolicyTable.{name} must be a mapping, got {type(getattr(self, name)).__name__}")
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
        object.__setattr__(self, "position_bins", check_tag_view(self.tag_view, self.family, self.position_bins))
        self._check_entries()
        self._check_scalars()
        self._check_records()
        object.__setattr__(self, "_resolved", self._resolve_vocabulary())

    def __copy__(self) -> PolicyTable:
        return self  # immutable: copies (of a controller, say) share it

    def __deepcopy__(self, memo: dict) -> PolicyTable:
        return self

    # ------------------------------------------------------------------------------------------------ validation
    def _check_costs(self) -> None:
        if not isinstance(self.costs, GroupCosts):
            raise TypeError(f"PolicyTable.costs must be a GroupCosts, got {type(self.costs).__name__}")
        groups = self.costs.groups
        if len(groups) not in GROUP_COUNTS or groups != layer_groups(groups[-1].stop, len(groups)):
            raise ValueError(
                "PolicyTable.costs.groups must be the 3 layer groups of A.2 (layer_groups(L)) or the single group of "
                f"the no-layer-groups ablation (layer_groups(L, 1)), got {[(g.start, g.stop) for g in groups]}"
            )
        for name in ("elements", "rows", "padding"):
            values = getattr(self.costs, name)
            if len(values) != len(groups) or not all(is_int(v) and v >= 0 for v in values):
                raise ValueError(f"PolicyTable.costs.{name} must hold one integer >= 0 per layer group, got {values}")

    def _check_entries(self) -> None:
        valid = _valid_keys(self.family, self.tag_view, self.position_bins)
        groups = len(self.costs.groups)
        for key, entry in self.entries.items():
            if key not in valid:
                raise ValueError(
                    f"unknown lookup key {key!r} for the {self.family} vocabulary under tag_view={self.tag_view!r}: a "
                    "key is 'class', 'class|role', 'class|role|state' or 'class|role|state|next' over the tags of "
                    "hf_structkv.structure.tags.view_vocabulary"
                )
            if not isinstance(entry, PolicyEntry):
                raise TypeError(f"entries[{key!r}] must be a PolicyEntry, got {type(entry).__name__}")
            if len(entry.action) != groups:
                raise ValueError(
                    f"entries[{key!r}] has {len(entry.action)} layer groups but the table has {groups} "
                    f"({', '.join(group_names(groups))})"
                )

    def _check_scalars(self) -> None:
        if not _is_number(self.budget) or not 0 <= self.budget <= 1:
            raise ValueError(f"budget (B_D) must be a number in [0, 1], got {self.budget!r}")
        states = STATES[self.family]
        for state, bits in self.reserve_by_state.items():
            if state not in states:
                raise ValueError(f"reserve_by_state has unknown state {state!r}; {self.family} states are {states}")
            if not _is_number(bits) or bits < 0:
                raise ValueError(f"reserve_by_state[{state!r}] must be a finite number of bits >= 0, got {bits!r}")
        if not _is_number(self.reserve_pooled) or self.reserve_pooled < 0:
            raise ValueError(f"reserve_pooled must be a finite number of bits >= 0, got {self.reserve_pooled!r}")
        if not is_int(self.sink_tokens) or self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be an integer >= 0, got {self.sink_tokens!r}")
        if not is_int(self.window) or self.window < 1:
            raise ValueError(
                f"window must be an integer >= 1 (a token's tag arrives one step after its K/V), got {self.window!r}"
            )

    def _resolve_vocabulary(self) -> dict[StructuralTag, tuple[str | None, PolicyLookup]]:
        """Every full tag of the vocabulary -> (its entry key or ``None``, its lookup result): the B.1 fallback chain,
        precomputed so that `lookup` is one dictionary access per candidate."""
        resolved = {}
        for tag in view_vocabulary(self.family, self.tag_view, self.position_bins):
            key = next((k for k in tag.fallback_keys() if k in self.entries), None)
            resolved[tag] = (key, self._all_high_lookup() if key is None else self.entries[key].lookup())
        return resolved

    def _all_high_lookup(self) -> PolicyLookup:
        groups = len(self.costs.groups)
        return PolicyLookup((Action.H,) * groups, (Action.H,) * groups, ((None, None),) * groups)

    # ------------------------------------------------------------------------------------------------ lookup
    @property
    def layer_groups(self) -> tuple[range, ...]:
        """The lower / middle / upper layer ranges (A.2)."""
        return self.costs.groups

    def entry_key(self, tag: StructuralTag) -> str | None:
        """The entry ``tag`` resolves to through the fallback chain, ``None`` when none is compatible.

        Raises:
            ValueError: ``tag`` is not a tag of this table's vocabulary.
        """
        return self._resolve(tag)[0]

    def lookup(self, candidates: Iterable[StructuralTag]) -> PolicyLookup:
        """Base actions, floors and priorities per layer group for a token with these candidate tags (eq. 12).

        Args:
            candidates: the token's candidate tags; empty = unresolved.

        Returns:
            One entry's values when every candidate resolves to it; the conservative merge when they resolve to
            several (base = floor = the most protective action or floor, promotion scores only where unique); ``H``
            as action and floor everywhere when there are no candidates or one has no compatible entry.

        Raises:
            ValueError: a candidate is not a tag of this table's vocabulary.
        """
        resolved = {}
        for tag in candidates:
            key, result = self._resolve(tag)
            if key is None:
                return self._all_high_lookup()
            resolved[key] = result
        if len(resolved) == 1:
            return next(iter(resolved.values()))
        if not resolved:
            return self._all_high_lookup()
        return _merge(list(resolved.values()))

    def _resolve(self, tag: StructuralTag) -> tuple[str | None, PolicyLookup]:
        try:
            return self._resolved[tag]
        except (KeyError, TypeError):
            raise ValueError(
                f"candidate tag {tag!r} is not in the {self.family} vocabulary (Table 5) under tag_view="
                f"{self.tag_view!r}; tags must be what a StructuralLogitsProcessor of this view emits "
                "(hf_structkv.structure.tags.view_vocabulary)"
            ) from None

    def reserve(self, state: str | None) -> float:
        """``Γ(state)`` in bits: the calibrated reserve of ``state``, else the pooled one (also for ``None``).

        Raises:
            ValueError: ``state`` is not a parser state of this table's family.
        """
        if state is None:
            return self.reserve_pooled
        if state not in STATES[self.family]:
            raise ValueError(f"state must be one of {STATES[self.family]} or None, got {state!r}")
        return self.reserve_by_state.get(state, self.reserve_pooled)

    # ------------------------------------------------------------------------------------------------ builders
    @classmethod
    def all_high(
        cls,
        config_or_costs: Any,
        family: str = "function_calling",
        sink_tokens: int = DEFAULT_SINK_TOKENS,
        window: int = DEFAULT_WINDOW,
        tag_view: str = "full",
        position_bins: tuple[int, ...] = (),
    ) -> PolicyTable:
        """The all-high reference policy (A.4): ``B_D = 1``, ``H`` actions and floors everywhere, ``Γ = 0``.

        Args:
            config_or_costs: a `GroupCosts`, a transformers config, or a model (whose fingerprint is then recorded).
            tag_view, position_bins: the tag view its generations record (the reference of a structural-ablation
                calibration).
        """
        model = config_or_costs if hasattr(config_or_costs, "config") else None
        if isinstance(config_or_costs, GroupCosts):
            costs = config_or_costs
        elif model is not None:
            costs = GroupCosts.from_config(model.config)
        elif hasattr(config_or_costs, "num_hidden_layers") or hasattr(config_or_costs, "get_text_config"):
            costs = GroupCosts.from_config(config_or_costs)
        else:
            raise TypeError(
                f"config_or_costs must be a GroupCosts, a transformers config or a model, got "
                f"{type(config_or_costs).__name__}"
            )
        return cls(
            family=family,
            costs=costs,
            entries=all_high_entries(len(costs.groups), family, tag_view, tuple(position_bins)),
            budget=1.0,
            sink_tokens=sink_tokens,
            window=window,
            tag_view=tag_view,
            position_bins=tuple(position_bins),
            provenance="reference",
            description="The all-high reference policy: every generated token kept in high precision in every layer.",
            fingerprint=None if model is None else _hub().model_fingerprint(model),
        )

    # ------------------------------------------------------------------------------------------------ JSON
    def controller(self, costs: GroupCosts):
        """A fresh `PolicyController` (Algorithm 2) for one sequence of a model with ``costs``."""
        from .controller import PolicyController

        return PolicyController(self, costs)

    def to_json_dict(self) -> dict[str, Any]:
        """The ``policy_table.json`` content (see the module docstring)."""
        return {
            "format_version": FORMAT_VERSION,
            "hf_structkv_version": _hub().__version__,
            "family": self.family,
            "vocabulary": _vocabulary(self.family),
            "conventions": dict(CONVENTIONS),
            "group_costs": _costs_to_json(self.costs),
            "decode_budget": self.budget,
            "sink_tokens": self.sink_tokens,
            "window": self.window,
            "tag_view": self.tag_view,
            "position_bins": list(self.position_bins),
            "reserve": {"by_state": dict(self.reserve_by_state), "pooled": self.reserve_pooled},
            "entries": {key: _entry_to_json(entry) for key, entry in sorted(self.entries.items())},
            **self._records_to_json(),
        }

    @classmethod
    def from_json_dict(cls, record: Any) -> PolicyTable:
        """Parse and validate a ``policy_table.json`` content.

        Raises:
            ValueError: naming the field: an unknown ``format_version``, missing or unknown fields, a vocabulary or
                conventions this hf_structkv does not implement, unknown lookup keys or actions, a wrong number of
                layer groups, negative budgets or reserves.
        """
        if not isinstance(record, dict):
            raise ValueError(f"{TABLE_NAME} must hold a JSON object, got {type(record).__name__}")
        if record.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"unknown format_version {record.get('format_version')!r} in {TABLE_NAME} (this hf_structkv "
                f"{_hub().__version__} reads format {FORMAT_VERSION}); a newer hf_structkv may read it"
            )
        required = set(_JSON_FIELDS) - set(_OPTIONAL_JSON_FIELDS)
        unknown, missing = sorted(record.keys() - set(_JSON_FIELDS)), sorted(required - record.keys())
        if unknown or missing:
            raise ValueError(f"{TABLE_NAME} has unknown fields {unknown} and lacks the fields {missing}")
        family = record["family"]
        if family not in ROLES:
            raise ValueError(f"family in {TABLE_NAME} must be one of {tuple(ROLES)}, got {family!r}")
        if record["vocabulary"] != _vocabulary(family):
            raise ValueError(
                f"the tag vocabulary in {TABLE_NAME} is not hf_structkv's {family} vocabulary "
                f"{_vocabulary(family)}: the table was compiled for other tags"
            )
        conventions = _json_object(record["conventions"], "conventions")
        if conventions != CONVENTIONS:
            differ = sorted(k for k in CONVENTIONS.keys() | conventions if conventions.get(k) != CONVENTIONS.get(k))
            raise ValueError(
                f"{TABLE_NAME} was compiled under conventions this hf_structkv does not implement: {differ} "
                f"(expected {CONVENTIONS})"
            )
        reserve = _json_object(record["reserve"], "reserve", ("by_state", "pooled"))
        return cls(
            family=family,
            costs=_costs_from_json(record["group_costs"]),
            entries={
                key: _entry_from_json(key, value) for key, value in _json_object(record["entries"], "entries").items()
            },
            budget=record["decode_budget"],
            reserve_by_state=_json_object(reserve["by_state"], "reserve.by_state"),
            reserve_pooled=reserve["pooled"],
            sink_tokens=record["sink_tokens"],
            window=record["window"],
            tag_view=record.get("tag_view", _OPTIONAL_JSON_FIELDS["tag_view"]),
            position_bins=_position_bins_from_json(record.get("position_bins", _OPTIONAL_JSON_FIELDS["position_bins"])),
            **cls._records_from_json(record),
        )

    # ------------------------------------------------------------------------------------------------ files, Hub
    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write ``policy_table.json`` and ``README.md`` into ``save_directory``.

        Each file is written to a temporary name and renamed into place; ``policy_table.json`` (which makes the folder
        a table) is removed first and written last, so a crash never leaves a loadable mix of two tables.
        """
        self._write_folder(Path(save_directory), repo_id=None)

    def _write_folder(self, directory: Path, repo_id: str | None) -> None:
        text = _json_text(self.to_json_dict()) + "\n"
        card = self.render_card(repo_id=repo_id)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / TABLE_NAME).unlink(missing_ok=True)
        _hub()._replace_file(directory / CARD_NAME, lambda tmp: tmp.write_text(card, encoding="utf-8"))
        _hub()._replace_file(directory / TABLE_NAME, lambda tmp: tmp.write_text(text, encoding="utf-8"))

    def push_to_hub(
        self, repo_id: str, private: bool | None = None, token: str | None = None, revision: str | None = None
    ) -> str:
        """Save the table (with a card whose snippet loads ``repo_id``) and upload it to a Hub model repository.

        Creates the repository if needed (``private`` applies only then) and the branch ``revision`` if given;
        ``token`` is the Hub write token (``None``: the logged-in user's).

        Returns:
            The URL of the upload commit.
        """
        return _hub()._upload_folder(
            lambda folder: self._write_folder(folder, repo_id=repo_id),
            POLICY_FILES,
            f"Upload {self.provenance} PASK policy table ({self.family}) with hf_structkv",
            repo_id,
            private=private,
            token=token,
            revision=revision,
        )

    # ------------------------------------------------------------------------------------------------ card
    def render_card(self, repo_id: str | None = None) -> str:
        """The ``README.md`` of a saved table, from the ``model_cards/policy_table.md`` template."""
        fingerprint = dict(self.fingerprint or {})
        base_model = _hub()._base_model({"fingerprint": fingerprint})
        front_matter = ["library_name: hf_structkv", "tags:", "- hf_structkv", "- kv-cache", "- pask-policy-table"]
        front_matter.append(f"- {self.provenance}")
        if base_model:
            front_matter.append(f"base_model: {json.dumps(base_model)}")
        banners = {
            "calibrated": "Calibrated offline (PASK Algorithm 1) on the data recorded under Calibration.",
            "illustrative": (
                "**Illustrative, not calibrated.** The actions, floors, priorities, budget and reserves below were "
                "written by hand to exercise the controller; no task or distortion measurement chose them, and they "
                "promise no accuracy."
            ),
            "reference": "The all-high reference policy: nothing is compressed (the baseline every policy is held to).",
        }
        allowance = self.budget * self.costs.full
        bins = f" (bins start at {list(self.position_bins)})" if self.position_bins else ""
        template = (importlib.resources.files("hf_structkv.model_cards") / "policy_table.md").read_text(
            encoding="utf-8"
        )
        return string.Template(template).substitute(
            front_matter="\n".join(front_matter),
            model_name=base_model or fingerprint.get("architecture", "any model with these layer dimensions"),
            provenance=self.provenance,
            provenance_banner=banners[self.provenance],
            description=self.description or "none",
            repo_id=repo_id or "<this repository id or local folder>",
            family=self.family,
            num_layers=self.costs.groups[-1].stop,
            grouping=_grouping(len(self.costs.groups)),
            groups_argument="" if len(self.costs.groups) == 3 else f", groups={len(self.costs.groups)}",
            group_names=" ".join(group_names(len(self.costs.groups))),
            group_scores=" / ".join(group_names(len(self.costs.groups))),
            group_rows=_group_rows(self.costs),
            full_bits=f"{self.costs.full:,}",
            budget=self.budget,
            allowance=f"{allowance:,.1f}",
            sink_tokens=self.sink_tokens,
            window=self.window,
            tag_view=f"`{self.tag_view}`{bins}",
            reserve_rows=_reserve_rows(self),
            entry_rows=_entry_rows(self.entries),
            resolution_rows=_resolution_rows(self),
            thresholds=_hub()._markdown_items(dict(self.thresholds)),
            calibration=_hub()._markdown_items(dict(self.calibration)),
            conventions="\n".join(f"- **{k}**: `{v}`" for k, v in CONVENTIONS.items()),
            fingerprint=json.dumps(fingerprint, indent=2, sort_keys=True) if fingerprint else "null",
            hf_structkv_version=_hub().__version__,
            format_version=FORMAT_VERSION,
        )


def illustrative_policy(model: Any = None) -> PolicyTable:
    """The hand-written, **not calibrated** policy table shipped for the embedded model (Qwen2.5-Coder-0.5B-Instruct):
    scaffold tokens cheap (``R`` / ``L``), dispatch keys and required values ``H``, free generation ``L``,
    ``B_D = 0.5``. It promises no accuracy; `calibrated_policy` is the table Algorithm 1 produced.

    Args:
        model: when given, checked against the table's fingerprint and costs.
    """
    return _shipped_policy(ILLUSTRATIVE_POLICY, model)


def calibrated_policy(model: Any = None) -> PolicyTable:
    """The decode policy table calibrated by `hf_structkv.calibrate` (PASK Algorithm 1) for the embedded model on a
    small CPU-sized BFCL calibration / development split; the table's card and ``calibration`` record say on what
    data, with which thresholds, the realised ``B_D`` and the development accuracy against all-high.

    Args:
        model: when given, checked against the table's fingerprint and costs.
    """
    return _shipped_policy(CALIBRATED_POLICY, model)


def _shipped_policy(name: str, model: Any, cls: type = PolicyTable):
    """Load the shipped policy folder ``hf_structkv/data/policies/<name>`` with ``cls.from_pretrained``
    (`PrefillPolicy` for the prefill companions)."""
    resource = importlib.resources.files("hf_structkv") / "data" / "policies" / name
    with importlib.resources.as_file(resource) as folder:
        return cls.from_pretrained(folder, model=model)


# ---------------------------------------------------------------------------------------------------- helpers
def _merge(results: list[PolicyLookup]) -> PolicyLookup:
    """Eq. 12 over several entries: base = floor = the max of their actions and floors per group; a promotion score
    survives only when every entry has the same one."""
    groups = len(results[0].base)
    top = tuple(max(max(r.base[c], r.floor[c]) for r in results) for c in range(groups))
    priorities = tuple(
        tuple(_unique(r.priorities[c][step] for r in results) for step in range(len(UPGRADE_STEPS)))
        for c in range(groups)
    )
    return PolicyLookup(top, top, priorities)


def _unique(scores: Iterable[float | None]) -> float | None:
    distinct = set(scores)
    return distinct.pop() if len(distinct) == 1 else None


def _entry_to_json(entry: PolicyEntry) -> dict[str, Any]:
    return {
        "action": [a.name for a in entry.action],
        "floor": [a.name for a in entry.floor],
        "priorities": {step: [pair[i] for pair in entry.priorities] for i, step in enumerate(UPGRADE_STEPS)},
    }


def _entry_from_json(key: str, value: Any) -> PolicyEntry:
    value = _json_object(value, f"entries[{key!r}]", ("action", "floor", "priorities"))
    actions = [_actions_from_json(value[name], f"entries[{key!r}].{name}") for name in ("action", "floor")]
    priorities = _json_object(value["priorities"], f"entries[{key!r}].priorities", UPGRADE_STEPS)
    scores = []
    for step in UPGRADE_STEPS:
        column = priorities[step]
        if not isinstance(column, list) or len(column) != len(actions[0]) or not all(_is_score(s) for s in column):
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


def _costs_to_json(costs: GroupCosts) -> dict[str, list]:
    """The ``group_costs`` object of a policy file (`_costs_from_json` reads it back)."""
    return {
        "layer_groups": [[g.start, g.stop] for g in costs.groups],
        "elements": list(costs.elements),
        "rows": list(costs.rows),
        "padding": list(costs.padding),
    }


def _costs_from_json(value: Any) -> GroupCosts:
    value = _json_object(value, "group_costs", ("layer_groups", "elements", "rows", "padding"))
    bounds = value["layer_groups"]
    if not isinstance(bounds, list) or not all(
        isinstance(b, list) and len(b) == 2 and all(is_int(x) for x in b) for b in bounds
    ):
        raise ValueError(f"group_costs.layer_groups must list [start, stop) integer pairs, got {bounds!r}")
    lists = []
    for name in ("elements", "rows", "padding"):
        if not isinstance(value[name], list):
            raise ValueError(f"group_costs.{name} must be a list with one integer per layer group")
        lists.append(tuple(value[name]))
    return GroupCosts(tuple(range(a, b) for a, b in bounds), *lists)


def _json_text(value: Any, indent: int = 0) -> str:
    """``value`` as indented JSON with lists of scalars on one line (readable action and priority rows)."""
    inner = " " * (indent + 2)
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(k)}: {_json_text(v, indent + 2)}" for k, v in value.items()]
    elif isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        items = [inner + _json_text(v, indent + 2) for v in value]
    else:
        return json.dumps(value, allow_nan=False)
    opening, closing = ("{", "}") if isinstance(value, dict) else ("[", "]")
    return opening + "\n" + ",\n".join(items) + "\n" + " " * indent + closing


def _json_object(
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


def _grouping(count: int) -> str:
    if count == 3:
        return "in three groups (A.2)"
    return "in one group: a token's action is tied across depth (the no-layer-groups ablation of PASK Fig. 5)"


def _position_bins_from_json(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError(f"position_bins in {TABLE_NAME} must be a JSON list of bin starts, got {value!r}")
    return tuple(value)


def _group_rows(costs: GroupCosts) -> str:
    rows = []
    for c, (name, group) in enumerate(zip(group_names(len(costs.groups)), costs.groups)):
        rows.append(
            f"| {name} | {group.start}-{group.stop - 1} | {costs.cost(Action.H, c):,} | {costs.cost(Action.L, c):,} |"
        )
    return "\n".join(rows)


def _reserve_rows(table: PolicyTable) -> str:
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


def _resolution_rows(table: PolicyTable) -> str:
    rows = []
    for tag, (key, _) in table._resolved.items():
        target = _cell(key) if key is not None else "no entry: H action and floor"
        rows.append(f"| {_cell('|'.join(tag))} | {target} |")
    return "\n".join(rows)


def _hub():
    """``hf_structkv.hub``, imported on first use: it imports the attention registry, which imports the mixed-precision
    cache, which imports this package, so a module-level import would be circular."""
    from .. import hub

    return hub


def _cell(key: str) -> str:
    """A lookup key as code in a Markdown table cell (its ``|`` escaped)."""
    return "`" + key.replace("|", "\\|") + "`"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_score(value: Any) -> bool:
    return _is_number(value) and value >= 0
