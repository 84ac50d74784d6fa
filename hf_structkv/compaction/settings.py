"""What ``compact(...)`` is asked to do, validated once: `CompactionSettings` and the names it accepts."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..validation import check_bool, check_int, is_number
from .chunks import Context
from .head_compaction import HEAD_METHODS
from .head_method import CalibratedMethod
from .head_storage import STORAGE_CHOICES, check_storage
from .queries import DEFAULT_CAP
from .self_study import SelfStudy

__all__ = [
    "BUDGET_KEYWORDS",
    "DEFAULT_RATIO",
    "DEFAULT_REFIT_GUARD",
    "MAX_LOSS_RATIOS",
    "METHODS",
    "QUERY_TIERS",
    "CompactionSettings",
    "check_budgets",
]

METHODS = tuple(sorted(HEAD_METHODS))
QUERY_TIERS = ("repeat", "self_study")
BUDGET_KEYWORDS = ("auto", "uniform")
DEFAULT_RATIO = 50.0
"""``compact``'s ratio when neither ``ratio`` nor ``max_loss`` is given."""
MAX_LOSS_RATIOS = (128, 96, 64, 48, 32, 24, 16, 12, 8, 6, 4, 3, 2, 1.5)
"""The sizes ``compact(max_loss=x)`` tries per KV head, fewest bytes first: each a ratio as ``ratio=`` counts it (the
head keeps ``max(1, floor(T / r))`` entries, or their bytes for ``"int4"`` / ``"auto"`` storage); a head that meets
``x`` at none of them is kept whole (every entry, bias 0, original values: loss 0)."""
DEFAULT_REFIT_GUARD = 0.2
"""``compact``'s default ``refit_guard`` for refitting methods: per head, 20% of the fitting queries decide between the
refit and plain eviction of the same selection (`CalibratedMethod.complete`). The paper always refits
(``refit_guard=0``); on the embedded model some heads' value solves overfit the calibration queries (held-out loss
above 10 for LOO and AM-HAK on a SQuAD document at 10x), which the guard turns into eviction."""


def check_budgets(budgets: Any) -> None:
    """Check ``compact``'s ``budgets`` argument without reading anything: one of ``BUDGET_KEYWORDS``, an object with
    ``token_budgets``, or the path or Hub repository id (``namespace/name``) of saved head budgets. A word without
    ``/`` that is neither a keyword nor an existing path (a mistyped keyword) is refused here, listing what is
    accepted; a missing path with ``/`` is refused by ``HeadBudgets.load`` (`persistence.resolve_folder`), never asked
    of the Hub either.

    Raises:
        TypeError: ``budgets`` is none of a string, a path or an object with ``token_budgets``.
        ValueError: a word that is no keyword and no existing path.
    """
    if callable(getattr(budgets, "token_budgets", None)):
        return
    if not isinstance(budgets, (str, os.PathLike)):
        raise TypeError(
            f"budgets must be one of {BUDGET_KEYWORDS}, a HeadBudgets (an object with token_budgets(ratio, length)), "
            f"the path of a saved one or its Hub repository id, got {type(budgets).__name__}"
        )
    text = os.fspath(budgets)
    if text in BUDGET_KEYWORDS or "/" in text or (text and Path(text).exists()):
        return
    raise ValueError(
        f"budgets must be one of {BUDGET_KEYWORDS}, the path of a saved head-budgets folder or file, or a Hub "
        f"repository id 'namespace/name'; {text!r} is no such keyword and no existing file or folder"
    )


@dataclass(frozen=True)
class CompactionSettings:
    """The keyword arguments of `compact` (each documented there), checked and completed on construction.

    Completed: ``hparams`` gets ``refit_guard=DEFAULT_REFIT_GUARD`` for a calibrated method that does not set it, and
    ``self_study=None`` becomes ``SelfStudy()``.

    Completed too: ``ratio=None`` becomes `DEFAULT_RATIO` unless ``max_loss`` is given.

    Raises:
        ValueError: an unknown ``method`` or ``queries`` tier (for a method that needs queries), a ``ratio`` that is
            not a finite number >= 1, a ``heldout_fraction`` outside ``[0, 1)``, a bad hyper-parameter of the method,
            ``budgets`` refused by `check_budgets`; a ``max_loss`` that is not a finite number > 0, or given with
            ``ratio``, with ``budgets`` other than ``"auto"``, with ``heldout_fraction=0`` or with a query-free
            method.
        TypeError: ``block_replay`` is not a bool, ``self_study`` is not a `SelfStudy` or None, ``budgets`` of
            another type (`check_budgets`).
    """

    ratio: float | None = None
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
    storage: str = "bf16"
    key_group: int | None = None
    max_loss: float | None = None
    hparams: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        self._check_size()
        hparams = dict(self.hparams)
        if issubclass(HEAD_METHODS[self.method], CalibratedMethod):
            hparams.setdefault("refit_guard", DEFAULT_REFIT_GUARD)
        object.__setattr__(self, "hparams", hparams)
        HEAD_METHODS[self.method](**hparams)  # validates the hyper-parameters before the long prefill
        if self.needs_queries and self.queries not in QUERY_TIERS:
            raise ValueError(f"queries must be one of {QUERY_TIERS} for method {self.method!r}, got {self.queries!r}")
        check_budgets(self.budgets)
        check_storage(self.storage, STORAGE_CHOICES)
        if self.storage == "auto" and not self.needs_queries:
            raise ValueError(
                f"storage='auto' chooses each head's storage by its calibration loss; method {self.method!r} uses no "
                "calibration queries: pass storage='bf16' or 'int4', or a calibrated method"
            )
        check_int("key_group", self.key_group, 1, counts="kept entries per row of INT4 key scales", none_ok=True)
        if not is_number(self.heldout_fraction) or not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction!r}")
        check_bool("block_replay", self.block_replay)
        check_int("seed", self.seed, 0, 2**63 - 1)
        check_int("query_cap", self.query_cap, 1, counts="calibration queries per KV head")
        if self.self_study is None:
            object.__setattr__(self, "self_study", SelfStudy())
        elif not isinstance(self.self_study, SelfStudy):
            raise TypeError(f"self_study must be a SelfStudy or None, got {type(self.self_study).__name__}")

    def _check_size(self) -> None:
        """``ratio`` (None: `DEFAULT_RATIO`) or ``max_loss``, not both, and what ``max_loss`` needs."""
        if self.max_loss is None:
            ratio = DEFAULT_RATIO if self.ratio is None else self.ratio
            if not is_number(ratio) or not 1 <= ratio:
                raise ValueError(f"ratio must be a finite number >= 1 (original / kept entries), got {ratio!r}")
            object.__setattr__(self, "ratio", ratio)
            return
        if not is_number(self.max_loss) or not self.max_loss > 0:
            raise ValueError(
                f"max_loss must be a finite number > 0 (the held-out relative loss each KV head may reach), got "
                f"{self.max_loss!r}"
            )
        if self.ratio is not None:
            raise ValueError(
                f"ratio={self.ratio!r} and max_loss={self.max_loss!r} exclude each other: max_loss chooses each KV "
                "head's size; pass one of them"
            )
        if not isinstance(self.budgets, str) or self.budgets != "auto":
            raise ValueError(
                "budgets has no effect with max_loss (each KV head's size is chosen by its held-out loss); leave "
                "budgets out"
            )
        if not self.needs_queries:
            raise ValueError(
                f"max_loss measures each head on held-out calibration queries; method {self.method!r} uses none: "
                "pass a calibrated method such as 'kv_surgeon'"
            )
        if not (is_number(self.heldout_fraction) and self.heldout_fraction > 0):
            raise ValueError(
                f"max_loss needs held-out queries: heldout_fraction must be in (0, 1), got {self.heldout_fraction!r}"
            )

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
