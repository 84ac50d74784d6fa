"""PASK policies: retention actions and payload costs, the frozen policy table, the online controller (Algorithm 2)."""

from .controller import PolicyController
from .costs import Action, GroupCosts, layer_groups
from .table import PolicyEntry, PolicyLookup, PolicyTable, illustrative_policy

__all__ = [
    "Action",
    "GroupCosts",
    "PolicyController",
    "PolicyEntry",
    "PolicyLookup",
    "PolicyTable",
    "illustrative_policy",
    "layer_groups",
]
