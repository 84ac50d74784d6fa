"""What a `StructuredMixedPrecisionCache` needs from a retention policy, so PASK's table, calibration interventions
and decode-time baselines run on the same cache with the same budget accounting.

A *retention policy* (`RetentionPolicy`) is a frozen object with ``costs`` (`GroupCosts` of the model it was built
for), ``sink_tokens``, ``window``, the structural view its tags must come in (``tag_view``, ``position_bins``), and
``controller(costs)``, which makes one fresh *controller* per sequence; ``attention_statistics()`` says whether the
cache must record attention mass for it. A controller (`RetentionController`) is stepped once per generated token,
in token order, when the token is about to leave the recent window; it returns one `Action` per layer group
(``None`` for a stop token) and keeps a ledger of what it scheduled so that speculative decoding can roll it back.
Controllers of policies that record attention statistics also plan the prompt (`RetentionController.plan_prompt`).
`PolicyTable` (with `PolicyController`, Algorithm 2) is the reference implementation.

Both are abstract base classes: every member the cache reads is declared here, with a default where one makes
sense, and an implementation inherits from them (a frozen dataclass may).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from ..attention.attention_mass import AttentionMass, TokenStatistics
from ..structure.tags import StructuralTag
from .costs import Action, GroupCosts

__all__ = ["RetentionController", "RetentionPolicy", "check_retention_policy"]


class RetentionController(ABC):
    """Per-sequence decisions. State changes only in `step` (appends one decision), `rollback` (drops decisions) and
    `plan_prompt` (once, before the first step, for policies that record attention statistics)."""

    @property
    @abstractmethod
    def scheduled_bits(self) -> int | float:
        """``Σ M(a)`` over the steps so far, in bits (B.3 cost convention; stop tokens free)."""

    @property
    @abstractmethod
    def num_steps(self) -> int:
        """The number of `step` calls so far (stop tokens included)."""

    @abstractmethod
    def step(
        self, candidates: Sequence[StructuralTag] | None, statistics: TokenStatistics | None = None
    ) -> tuple[Action, ...] | None:
        """Decide the next generated token from its candidate tags (``()`` = unresolved, ``None`` = stop token).

        ``statistics`` is the cache's `TokenStatistics` of the token when the policy's `attention_statistics`
        returns an `AttentionMass`, else ``None``."""

    @abstractmethod
    def rollback(self, num_steps: int) -> None:
        """Restore the exact state after the first ``num_steps`` steps."""

    def plan_prompt(self, mass: torch.Tensor, real: torch.Tensor, weighted: torch.Tensor | None = None) -> torch.Tensor:
        """The prompt's actions, int64 ``[P, groups]`` of `Action` values, from the attention mass FP32
        ``[groups, P]`` each prompt slot received, which slots are real (bool ``[P]``, ``False`` for left padding)
        and, for value-weighted statistics, the value-weighted mass FP32 ``[groups, P]`` (else ``None``).

        The cache calls it once, after the prompt forward, only for policies whose `attention_statistics` returns an
        `AttentionMass`; those controllers override it. The default raises ``NotImplementedError``."""
        raise NotImplementedError(
            f"{type(self).__name__} does not plan the prompt: only controllers of policies whose "
            "attention_statistics() returns an AttentionMass do (pass a prefill_plan to the cache instead)"
        )


class RetentionPolicy(ABC):
    """A frozen retention policy for one model's layer dimensions.

    Attributes:
        costs: the `GroupCosts` of the model the policy was built for.
        sink_tokens: the first positions kept ``H`` whatever the controller decides.
        window: the recent window (tokens kept at full precision before their action applies, >= 1).
        tag_view: the view of the structural tags the policy decides from (`TAG_VIEWS`); the cache's processor must
            emit it. Default ``"full"``.
        position_bins: the bin starts of the ``"position_bins"`` view, ``()`` otherwise (the default).
        int4_keys: the key layout of its ``L`` action, ``"row"`` (the default, PASK B.5), ``"centred"`` or
            ``"centred-g128"`` (`hf_structkv.quant.int4_centred`): what a cache serves it with unless told otherwise.
    """

    costs: GroupCosts
    sink_tokens: int
    window: int
    tag_view: str = "full"
    position_bins: tuple[int, ...] = ()
    int4_keys: str = "row"

    @abstractmethod
    def controller(self, costs: GroupCosts) -> RetentionController:
        """A fresh controller for one sequence of a model with ``costs`` (raise ``ValueError`` on a mismatch)."""

    def attention_statistics(self) -> AttentionMass | None:
        """A fresh `AttentionMass` for the cache to fill during attention when the policy decides from attention
        statistics (its controllers then plan the prompt and get `TokenStatistics` in `RetentionController.step`);
        ``None`` (the default) records nothing."""
        return None


def check_retention_policy(policy) -> RetentionPolicy:
    """``policy`` if it is a `RetentionPolicy`, else ``TypeError`` naming the argument and what it must be."""
    if not isinstance(policy, RetentionPolicy):
        raise TypeError(
            "policy must be a RetentionPolicy (a PolicyTable such as PolicyTable.all_high(model.config), or a "
            f"baseline of hf_structkv.policy.baselines), got {type(policy).__name__}"
        )
    return policy
