"""`CalibrationTask`: what Algorithm 1 needs to know about a benchmark, so that one machinery calibrates on any.

Calibration only ever does six things with a case: names it (`case_id`, `category`), generates it under a policy
(`generate`; a decode intervention's policy, a prefill plan or a candidate prefill policy), rebuilds the logits
processor of that generation (`processor`: a resumed intervention replays the shared tokens through a fresh one),
scores the reply (`score`), and, for the prefill stage, labels the prompt's tokens (`prompt_labels`). A task
implements these for its cases, grammar and metric: `BfclTask` (function calls, BFCL's AST checker, the tool-schema
span labels) and `SpiderTask` (SQL, Spider's exact-set match; decode-only: a DDL prompt has no span labels).

A task is stateless: the model and tokenizer are passed to each call.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from ..policy.prefill import PrefillPolicy
from ..policy.retention import RetentionPolicy
from ..structure.processor import StructuralLogitsProcessor
from ..structured_generation import StructuredOutput

__all__ = ["CalibrationTask"]


class CalibrationTask(ABC):
    """The benchmark-specific half of a calibration (module docstring).

    Attributes:
        name: the benchmark as the calibrated table's description names it (``"BFCL"``).
        family: the tag vocabulary family of the task's grammar (``"function_calling"`` or ``"sql"``): the family of
            the all-high reference policy and of every candidate table.
        labels_prompts: whether `prompt_labels` gives span labels (`PROMPT_LABELS`), i.e. whether the prefill stage
            can run on the task.
        cache_key: what the on-disk caches' keys add for this task (`generation_key`); ``{}`` for BFCL, whose keys
            predate tasks.
        case_type, case_source: the class of a case and where cases come from (named in errors).
    """

    name: ClassVar[str]
    family: ClassVar[str]
    labels_prompts: ClassVar[bool]
    cache_key: ClassVar[Mapping[str, Any]]
    case_type: ClassVar[type]
    case_source: ClassVar[str]

    def check_cases(self, cases: Sequence, argument: str) -> None:
        """Raise ``ValueError`` naming ``argument`` unless ``cases`` is a non-empty list of `case_type` objects."""
        if isinstance(cases, self.case_type) or not cases or not all(isinstance(c, self.case_type) for c in cases):
            raise ValueError(
                f"{argument} must be a non-empty list of {self.case_type.__name__} objects ({self.case_source})"
            )

    @abstractmethod
    def case_id(self, case) -> str:
        """The case's unique id (the key of its cached reference, verdicts and development results)."""

    @abstractmethod
    def category(self, case) -> str:
        """The case's category: the groups the ``"position_bins"`` view sizes its bins over (C.5)."""

    @abstractmethod
    def generate(
        self,
        model,
        tokenizer,
        case,
        policy: RetentionPolicy,
        max_new_tokens: int,
        prefill_plan: torch.Tensor | None = None,
        prefill_policy: PrefillPolicy | None = None,
    ) -> StructuredOutput:
        """One greedy generation of ``case`` alone (batch 1, no padding) under its grammar on a mixed-precision cache
        with ``policy`` (its processor built as `processor` builds it).

        Args:
            prefill_plan: optional prompt actions ``[1, P, 3]``.
            prefill_policy: alternatively a `PrefillPolicy` whose plan of the prompt is applied (tasks with
                `labels_prompts` only).

        Returns:
            The `StructuredOutput`: ``sequences`` ``[1, P + n]``, ``prompt_length`` ``P``, the processor and cache.
        """

    @abstractmethod
    def processor(self, tokenizer, case, policy: RetentionPolicy) -> StructuralLogitsProcessor:
        """A fresh processor of ``case``'s grammar emitting ``policy``'s tag view and position bins, as `generate`
        builds it."""

    @abstractmethod
    def score(self, case, text: str, stopped: bool) -> bool:
        """The verdict on one reply: ``text`` the generated text (special tokens removed), ``stopped`` whether the
        generation ended with a stop token (``False``: cut by ``max_new_tokens``)."""

    @abstractmethod
    def prompt_labels(self, tokenizer, case) -> list[tuple[str, ...]]:
        """Per token of the prompt `generate` builds, its span labels (`token_labels`); raises ``ValueError`` for a
        task without `labels_prompts`."""
