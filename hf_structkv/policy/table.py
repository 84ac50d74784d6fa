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
  ``"reference"``), ``description`` and ``fingerprint`` (`persistence.model_fingerprint`, or ``null`` for a table
  that only depends on the layer dimensions, such as the all-high reference).
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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

from ..persistence import CARD_NAME, check_format_version, model_fingerprint
from ..quant.int4_centred import check_int4_keys
from ..structure.tags import NEXT, ROLES, STATES, TAG_CLASSES, StructuralTag, check_tag_view, view_vocabulary
from ..validation import is_int, is_number
from ..version import __version__
from .controller import PolicyController
from .costs import GROUP_COUNTS, Action, GroupCosts, group_names, layer_groups
from .entries import PolicyEntry, PolicyLookup, all_high_entries, merge_lookups
from .policy_file import PolicyFile, shipped_policy
from .policy_json import (
    CONVENTIONS,
    FORMAT_VERSION,
    TABLE_NAME,
    conventions_with_keys,
    costs_from_json,
    costs_to_json,
    entry_from_json,
    entry_to_json,
    int4_keys_of_conventions,
    json_object,
)
from .retention import RetentionPolicy
from .shipped import CALIBRATED, shipped_pair_folders
from .table_card import render_table_card

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

DEFAULT_SINK_TOKENS = 4
"""Positions at the start of the sequence (prompt included) kept ``H`` as attention sinks (StreamingLLM's usual 4)."""
DEFAULT_WINDOW = 32
"""Most recent generated tokens kept ``H``; a scheduled ``L`` / ``R`` applies when a token leaves this window. 32 is
the middle of the recent-window range PASK's baselines are tuned over (16-128) and leaves the one-token tag delay of
the logits processor far inside the window."""
ILLUSTRATIVE_POLICY = "qwen2.5-coder-0.5b-instruct-illustrative"

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


@dataclass(frozen=True)
class PolicyTable(PolicyFile, RetentionPolicy):
    """The frozen record a PASK controller runs from (A.4): the reference `RetentionPolicy`. Validated on
    construction; compare with ``==``.

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
        fingerprint: `persistence.model_fingerprint` of the model the table was built for, or ``None`` when it
            depends only on the layer dimensions in ``costs`` (required for calibrated tables).
        int4_keys: the key layout its ``L`` action stores (``"row"``, PASK B.5, ``"centred"`` or ``"centred-g128"``,
            `hf_structkv.quant.int4_centred`): a cache serves the table with it unless told otherwise; saved as the
            ``quantizer`` convention.
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
    int4_keys: str = "row"

    _FILE_NAME: ClassVar[str] = TABLE_NAME
    SAVED_FILES: ClassVar[tuple[str, ...]] = (TABLE_NAME, CARD_NAME)
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
        self._check_cost_values()

    def _check_entries(self) -> None:
        valid = _valid_keys(self.family, self.tag_view, self.position_bins)
        groups = len(self.costs.groups)
        for key, entry in self.entries.items():
            if key not in valid:
                raise ValueError(
                    f"unknown lookup key {key!r} for the {self.family} vocabulary under tag_view={self.tag_view!r}: a "
                    "key of entries is 'class', 'class|role', 'class|role|state' or 'class|role|state|next' over the "
                    "tags of hf_structkv.structure.tags.view_vocabulary"
                )
            if not isinstance(entry, PolicyEntry):
                raise TypeError(f"entries[{key!r}] must be a PolicyEntry, got {type(entry).__name__}")
            if len(entry.action) != groups:
                raise ValueError(
                    f"entries[{key!r}] has {len(entry.action)} layer groups but the table has {groups} "
                    f"({', '.join(group_names(groups))})"
                )

    def _check_scalars(self) -> None:
        check_int4_keys(self.int4_keys)
        if not is_number(self.budget) or not 0 <= self.budget <= 1:
            raise ValueError(
                f"budget (B_D) must be a number in [0, 1] (decode_budget in the file), got {self.budget!r}"
            )
        states = STATES[self.family]
        for state, bits in self.reserve_by_state.items():
            if state not in states:
                raise ValueError(f"reserve_by_state has unknown state {state!r}; {self.family} states are {states}")
            if not is_number(bits) or bits < 0:
                raise ValueError(f"reserve_by_state[{state!r}] must be a finite number of bits >= 0, got {bits!r}")
        if not is_number(self.reserve_pooled) or self.reserve_pooled < 0:
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
        return merge_lookups(list(resolved.values()))

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
        int4_keys: str = "row",
    ) -> PolicyTable:
        """The all-high reference policy (A.4): ``B_D = 1``, ``H`` actions and floors everywhere, ``Γ = 0``.

        Args:
            config_or_costs: a `GroupCosts`, a transformers config, or a model (whose fingerprint is then recorded).
            tag_view, position_bins: the tag view its generations record (the reference of a structural-ablation
                calibration).
            int4_keys: the INT4 key layout it records (it lowers nothing: the layout of a calibration's policies and
                of a prefill plan served beside it).
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
            int4_keys=int4_keys,
            provenance="reference",
            description="The all-high reference policy: every generated token kept in high precision in every layer.",
            fingerprint=None if model is None else model_fingerprint(model),
        )

    # ------------------------------------------------------------------------------------------------ JSON
    def controller(self, costs: GroupCosts) -> PolicyController:
        """A fresh `PolicyController` (Algorithm 2) for one sequence of a model with ``costs``."""
        return PolicyController(self, costs)

    def to_json_dict(self) -> dict[str, Any]:
        """The ``policy_table.json`` content (see the module docstring)."""
        return {
            "format_version": FORMAT_VERSION,
            "hf_structkv_version": __version__,
            "family": self.family,
            "vocabulary": _vocabulary(self.family),
            "conventions": conventions_with_keys(CONVENTIONS, self.int4_keys),
            "group_costs": costs_to_json(self.costs),
            "decode_budget": self.budget,
            "sink_tokens": self.sink_tokens,
            "window": self.window,
            "tag_view": self.tag_view,
            "position_bins": list(self.position_bins),
            "reserve": {"by_state": dict(self.reserve_by_state), "pooled": self.reserve_pooled},
            "entries": {key: entry_to_json(entry) for key, entry in sorted(self.entries.items())},
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
        check_format_version(record.get("format_version"), FORMAT_VERSION, TABLE_NAME)
        required = set(_JSON_FIELDS) - set(_OPTIONAL_JSON_FIELDS)
        unknown, missing = sorted(record.keys() - set(_JSON_FIELDS)), sorted(required - record.keys())
        if unknown or missing:
            raise ValueError(f"{TABLE_NAME} has unknown fields {unknown} and lacks the fields {missing}")
        family = record["family"]
        if not isinstance(family, str) or family not in ROLES:
            raise ValueError(f"family in {TABLE_NAME} must be one of {tuple(ROLES)}, got {family!r}")
        if record["vocabulary"] != _vocabulary(family):
            raise ValueError(
                f"the tag vocabulary in {TABLE_NAME} is not hf_structkv's {family} vocabulary "
                f"{_vocabulary(family)}: the table was compiled for other tags"
            )
        int4_keys = int4_keys_of_conventions(json_object(record["conventions"], "conventions"), CONVENTIONS, TABLE_NAME)
        reserve = json_object(record["reserve"], "reserve", ("by_state", "pooled"))
        return cls(
            family=family,
            costs=costs_from_json(record["group_costs"]),
            entries={
                key: entry_from_json(key, value) for key, value in json_object(record["entries"], "entries").items()
            },
            budget=record["decode_budget"],
            reserve_by_state=json_object(reserve["by_state"], "reserve.by_state"),
            reserve_pooled=reserve["pooled"],
            sink_tokens=record["sink_tokens"],
            window=record["window"],
            tag_view=record.get("tag_view", _OPTIONAL_JSON_FIELDS["tag_view"]),
            position_bins=_position_bins_from_json(record.get("position_bins", _OPTIONAL_JSON_FIELDS["position_bins"])),
            int4_keys=int4_keys,
            **cls._records_from_json(record),
        )

    # ------------------------------------------------------------------------------------------------ card
    def render_card(self, repo_id: str | None = None) -> str:
        """The ``README.md`` of a saved table (`render_table_card`)."""
        return render_table_card(self, repo_id=repo_id)


def illustrative_policy(model: Any = None) -> PolicyTable:
    """The hand-written, **not calibrated** policy table shipped for the embedded model (Qwen2.5-Coder-0.5B-Instruct):
    scaffold tokens cheap (``R`` / ``L``), dispatch keys and required values ``H``, free generation ``L``,
    ``B_D = 0.5``. It promises no accuracy; `calibrated_policy` is the table Algorithm 1 produced.

    Args:
        model: when given, checked against the table's fingerprint and costs.
    """
    return shipped_policy(PolicyTable, ILLUSTRATIVE_POLICY, model)


def calibrated_policy(model: Any = None, name: str = CALIBRATED) -> PolicyTable:
    """The decode policy table calibrated by `hf_structkv.calibrate` (PASK Algorithm 1) for the embedded model, of the
    shipped pair ``name`` (`SHIPPED_PAIRS`; ``"calibrated"``: the default pair); the table's card and
    ``calibration`` record say on what data, with which thresholds, the realised ``B_D`` and the development
    accuracy against all-high.

    Args:
        model: when given, checked against the table's fingerprint and costs.
        name: ``"calibrated"`` or a key of `SHIPPED_PAIRS` (ValueError otherwise).
    """
    return shipped_policy(PolicyTable, shipped_pair_folders(name)[0], model)


def _position_bins_from_json(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise ValueError(f"position_bins in {TABLE_NAME} must be a JSON list of bin starts, got {value!r}")
    return tuple(value)
