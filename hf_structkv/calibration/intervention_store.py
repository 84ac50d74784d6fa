"""`InterventionStore`: one measurement per (case, reference tokens, bucket, action) in a `JsonLinesStore`, the
shared shape of the Runtime-V caches (`VerdictStore`: verdicts; `LikelihoodStore`: likelihood losses)."""

from __future__ import annotations

from typing import Any

from ..policy.costs import Action
from .buckets import Bucket
from .jsonl_store import JsonLinesStore
from .references import ReferenceTrajectory, key_digest

__all__ = ["InterventionStore"]


class InterventionStore(JsonLinesStore):
    """Measurements of interventions ``(bucket, action)`` on calibration cases, one line each:
    ``{"case", "reference", "bucket", "action", FIELD}``, where ``reference`` is a hash of the case's reference
    tokens (a case whose reference changed is not matched). Subclasses name ``FIELD``, describe it (``EXPECTED``)
    and check it (`valid_value`)."""

    ID_FIELDS = ("case", "reference", "bucket", "action")
    FIELD = "value"
    EXPECTED = "a measurement"

    @classmethod
    def valid_value(cls, value: Any) -> bool:
        """Whether ``value`` is a well-formed measurement (read lines failing it are skipped, puts refused)."""
        raise NotImplementedError

    @classmethod
    def accepts(cls, fields: dict[str, Any]) -> bool:
        return cls.valid_value(fields.get(cls.FIELD))

    def get(self, reference: ReferenceTrajectory, bucket: Bucket, action: Action) -> Any:
        """The stored measurement of intervention ``(bucket, action)`` on ``reference``'s case, ``None`` when
        absent."""
        record = self.get_record(self._identity(reference, bucket, action))
        return None if record is None else record[self.FIELD]

    def put(self, reference: ReferenceTrajectory, bucket: Bucket, action: Action, value: Any) -> None:
        """Store ``value`` of intervention ``(bucket, action)`` on ``reference``'s case (appended and flushed at once).

        Raises:
            TypeError: ``value`` is not a well-formed measurement (`valid_value`).
        """
        if not self.valid_value(value):
            raise TypeError(f"{self.FIELD} must be {self.EXPECTED}, got {value!r}")
        self.put_record(self._identity(reference, bucket, action), {self.FIELD: value})

    @staticmethod
    def _identity(reference: ReferenceTrajectory, bucket: Bucket, action: Action) -> tuple[str, str, str, str]:
        if action not in (Action.L, Action.R):
            raise ValueError(f"an intervention applies R or L, got {action!r}")
        return reference.case_id, key_digest(list(reference.tokens)), str(bucket), action.name
