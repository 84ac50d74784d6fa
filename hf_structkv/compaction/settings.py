"""What ``compact(...)`` is asked to do, validated once: `CompactionSettings` and the names it accepts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..validation import check_bool
from .chunks import Context
from .head_compaction import HEAD_METHODS
from .head_method import CalibratedMethod
from .queries import DEFAULT_CAP
from .self_study import SelfStudy

__all__ = ["DEFAULT_REFIT_GUARD", "METHODS", "QUERY_TIERS", "CompactionSettings"]

METHODS = tuple(sorted(HEAD_METHODS))
QUERY_TIERS = ("repeat", "self_study")
DEFAULT_REFIT_GUARD = 0.2
"""``compact``'s default ``refit_guard`` for refitting methods: per head, 20% of the fitting queries decide between the
refit and plain eviction of the same selection (`CalibratedMethod.complete`). The paper always refits
(``refit_guard=0``); on the embedded model some heads' value solves overfit the calibration queries (held-out loss
above 10 for LOO and AM-HAK on a SQuAD document at 10x), which the guard turns into eviction."""


@dataclass(frozen=True)
class CompactionSettings:
    """The keyword arguments of `compact` (each documented there), checked and completed on construction.

    Completed: ``hparams`` gets ``refit_guard=DEFAULT_REFIT_GUARD`` for a calibrated method that does not set it, and
    ``self_study=None`` becomes ``SelfStudy()``.

    Raises:
        ValueError: an unknown ``method`` or ``queries`` tier (for a method that needs queries), a ``ratio`` that is
            not a finite number >= 1, a ``heldout_fraction`` outside ``[0, 1)``, a bad hyper-parameter of the method.
        TypeError: ``block_replay`` is not a bool, ``self_study`` is not a `SelfStudy` or None.
    """

    ratio: float = 50.0
    method: str = "kv_surgeon"
    queries: str = "repeat"
    budgets: Any = "auto"
    chunk_tokens: int | None = None
    seed: int = 0
    progress: bool = True
    on_policy: bool = True
    query_cap: int = DEFAULT_CAP
    heldout_fraction: float = 0.1
    self_study: SelfStudy | None = None
    prefill_chunk_tokens: int | None = 1024
    block_replay: bool = True
    prefix: Context | None = None
    hparams: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        ratio = self.ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 1 <= ratio < math.inf:
            raise ValueError(f"ratio must be a finite number >= 1 (original / kept entries), got {ratio!r}")
        hparams = dict(self.hparams)
        if issubclass(HEAD_METHODS[self.method], CalibratedMethod):
            hparams.setdefault("refit_guard", DEFAULT_REFIT_GUARD)
        object.__setattr__(self, "hparams", hparams)
        HEAD_METHODS[self.method](**hparams)  # validates the hyper-parameters before the long prefill
        if self.needs_queries and self.queries not in QUERY_TIERS:
            raise ValueError(f"queries must be one of {QUERY_TIERS} for method {self.method!r}, got {self.queries!r}")
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction!r}")
        check_bool("block_replay", self.block_replay)
        if self.self_study is None:
            object.__setattr__(self, "self_study", SelfStudy())
        elif not isinstance(self.self_study, SelfStudy):
            raise TypeError(f"self_study must be a SelfStudy or None, got {type(self.self_study).__name__}")

    @property
    def needs_queries(self) -> bool:
        """Whether ``method`` is fitted to calibration queries."""
        return HEAD_METHODS[self.method].needs_queries

    def check_tokenizer(self, tokenizer: object) -> None:
        """A method that needs queries needs the tokenizer for its calibration prompts.

        Raises:
            ValueError: ``tokenizer`` is None and the method needs queries.
        """
        if self.needs_queries and tokenizer is None:
            raise ValueError(f"method {self.method!r} needs the tokenizer for its calibration prompts; pass tokenizer=")
