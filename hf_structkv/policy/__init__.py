"""PASK policies: retention actions and payload costs, the frozen policy table, the online controller (Algorithm 2)."""

from .baselines import H2O, CriticalKV, MiKV, SnapKV, StreamingLLM
from .controller import PolicyController
from .costs import Action, GroupCosts, layer_groups
from .prefill import (
    PrefillPlan,
    PrefillPolicy,
    batch_prefill_plan,
    calibrated_prefill_policy,
    illustrative_prefill_policy,
    plan_prefill,
)
from .retention import RetentionController, RetentionPolicy
from .shipped import SHIPPED_PAIRS
from .table import PolicyEntry, PolicyLookup, PolicyTable, calibrated_policy, illustrative_policy

__all__ = [
    "Action",
    "CriticalKV",
    "H2O",
    "MiKV",
    "SnapKV",
    "StreamingLLM",
    "GroupCosts",
    "PolicyController",
    "PolicyEntry",
    "PolicyLookup",
    "PolicyTable",
    "PrefillPlan",
    "RetentionController",
    "SHIPPED_PAIRS",
    "RetentionPolicy",
    "PrefillPolicy",
    "batch_prefill_plan",
    "calibrated_policy",
    "calibrated_prefill_policy",
    "illustrative_prefill_policy",
    "illustrative_policy",
    "layer_groups",
    "plan_prefill",
]
