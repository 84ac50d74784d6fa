"""Single-bucket interventions ``π_{q,a}`` (PASK §3.4): action ``a`` on every occurrence of bucket ``q``, ``H``
everywhere else, during full autoregressive generation; and the exact window shortcut.

Decode: `BucketIntervention` is a `RetentionPolicy` (the cache asks it for one controller per sequence) whose
controller returns ``a`` in the bucket's layer group for every token having the bucket's tag among its candidates
(`buckets` occurrence rule) and ``H`` otherwise. Prefill: `prefill_intervention_plan` is the prompt plan ``[1, P, 3]``
with ``a`` in the bucket's group for the prompt tokens carrying its label, outside the sinks and the recent window.

Window shortcut (decode): an action takes effect only when its token leaves the recent window. In ``generate``,
forward ``k`` (``k = 0`` is the prompt) produces generated token ``k`` and, before its attention, commits the tokens
more than ``window`` positions behind the token it processes; generated token ``i`` is committed first by forward
``i + window + 2``. A trajectory of ``T`` tokens runs forwards ``0 .. T − 1``, so an occurrence at ``i`` can change
anything only if ``i <= T − 3 − window``. When no occurrence of ``q`` on the reference trajectory is that early, the
intervened generation repeats the reference forward by forward (same tokens, hence same tags and occurrences): its
trajectory, text and verdict are the reference's, and the case is skipped (`reaches_generation`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..attention.attention_mass import TokenStatistics
from ..policy.costs import Action, GroupCosts
from ..policy.retention import RetentionController, RetentionPolicy
from ..quant.int4_centred import check_int4_keys
from ..structure.tags import StructuralTag
from ..validation import check_int
from .buckets import Bucket
from .references import ReferenceTrajectory

__all__ = [
    "BucketIntervention",
    "occurrences",
    "prefill_intervention_plan",
    "prefill_positions",
    "reaches_generation",
]


@dataclass(frozen=True)
class BucketIntervention(RetentionPolicy):
    """The decode intervention ``π_{q,a}`` as a `RetentionPolicy`.

    Attributes:
        costs: the model's layer-group costs.
        bucket: ``q`` (a full tag key and a layer group).
        action: ``a`` (``R`` or ``L``).
        sink_tokens, window, tag_view, position_bins: as the all-high reference policy's (the bucket key is a tag
            of that view).
        int4_keys: the key layout of an ``L`` intervention's INT4 tokens (the calibration's).
    """

    costs: GroupCosts
    bucket: Bucket
    action: Action
    sink_tokens: int
    window: int
    tag_view: str = "full"
    position_bins: tuple[int, ...] = ()
    int4_keys: str = "row"

    def __post_init__(self) -> None:
        check_int4_keys(self.int4_keys)
        groups = len(self.costs.groups)
        if not isinstance(self.bucket, Bucket) or self.bucket.groups != groups or not 0 <= self.bucket.group < groups:
            raise ValueError(
                f"bucket must be a Bucket(key, group, groups={groups}) with a group of the costs' {groups} layer "
                f"groups, got {self.bucket!r}"
            )
        StructuralTag.from_key(self.bucket.key)
        if self.action not in (Action.R, Action.L):
            raise ValueError(f"an intervention applies R or L, got {self.action!r}")

    def controller(self, costs: GroupCosts) -> _InterventionController:
        if costs != self.costs:
            raise ValueError(f"the intervention was built for group costs {self.costs}, the model's are {costs}")
        return _InterventionController(self)


class _InterventionController(RetentionController):
    """Per sequence: ``a`` in the bucket's group for occurrences, ``H`` otherwise; stop tokens ``None`` (free)."""

    def __init__(self, policy: BucketIntervention) -> None:
        self._policy = policy
        groups = len(policy.costs.groups)
        self._high = (Action.H,) * groups
        self._lowered = tuple(policy.action if c == policy.bucket.group else Action.H for c in range(groups))
        self._costs = {actions: policy.costs.total(actions) for actions in (self._high, self._lowered)}
        self._scheduled = [0]

    @property
    def scheduled_bits(self) -> int:
        return self._scheduled[-1]

    @property
    def num_steps(self) -> int:
        return len(self._scheduled) - 1

    def step(
        self, candidates: Sequence[StructuralTag] | None, statistics: TokenStatistics | None = None
    ) -> tuple[Action, ...] | None:
        """``a`` in the bucket's group if the bucket's tag is among ``candidates`` (``statistics`` unused: an
        intervention records no attention statistics)."""
        if candidates is None:
            self._scheduled.append(self._scheduled[-1])
            return None
        hit = any("|".join(tag) == self._policy.bucket.key for tag in candidates)
        actions = self._lowered if hit else self._high
        self._scheduled.append(self._scheduled[-1] + self._costs[actions])
        return actions

    def rollback(self, num_steps: int) -> None:
        check_int("num_steps", num_steps, 0, self.num_steps, counts="steps taken")
        del self._scheduled[num_steps + 1 :]


def occurrences(reference: ReferenceTrajectory, key: str) -> list[int]:
    """Indices of the generated tokens of ``reference`` having ``key`` among their candidate tags."""
    return [i for i, tags in enumerate(reference.tags) if tags is not None and key in tags]


def reaches_generation(reference: ReferenceTrajectory, key: str, window: int) -> bool:
    """Whether a decode intervention on tag ``key`` can change ``reference``'s generation: some occurrence ``i``
    with ``i <= T − 3 − window`` (module docstring). ``False`` means the intervened run is the reference."""
    last = len(reference.tokens) - 3 - window
    return any(i <= last for i in occurrences(reference, key))


def prefill_intervention_plan(
    reference: ReferenceTrajectory, bucket: Bucket, action: Action, sink_tokens: int, window: int
) -> torch.Tensor:
    """The prompt plan ``[1, P, 3]`` of a prefill intervention: ``action`` in ``bucket.group`` for prompt tokens
    carrying the label ``bucket.key``, except the first ``sink_tokens`` and the last ``window`` (kept ``H``)."""
    n = len(reference.prompt_ids)
    plan = torch.full((1, n, 3), int(Action.H), dtype=torch.int64)
    for t in prefill_positions(reference, bucket.key, sink_tokens, window):
        plan[0, t, bucket.group] = int(action)
    return plan


def prefill_positions(reference: ReferenceTrajectory, label: str, sink_tokens: int, window: int) -> list[int]:
    """Prompt positions an intervention on ``label`` lowers: carrying it, outside the sinks and the recent window."""
    n = len(reference.prompt_labels)
    return [t for t in range(sink_tokens, n - window) if label in reference.prompt_labels[t]]
