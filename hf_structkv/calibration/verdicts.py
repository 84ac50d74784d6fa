"""`VerdictStore`: Runtime-V verdicts kept on disk, so that a stopped or repeated calibration never generates the same
intervention twice.

Runtime-V is the calibration's cost (one complete generation per needed ``(bucket, action, case)``, tens of seconds
each on a CPU). With a store, `intervention_runs` asks it before generating and appends each new verdict as soon as
its generation ends: a run that stops (a killed job, a session limit) resumes where it stopped, and a re-run with
other thresholds or tolerances generates nothing.

One JSON-lines file (`JsonLinesStore`) per generation key (model fingerprint, dtype, package version, generation cap,
window, sinks, tag view, stage, layer groups: what decides an intervened generation besides the case and the
intervention), named by the key's hash, in the calibration cache folder. Each line after the key line is one verdict
``{"case", "reference", "bucket", "action", "valid"}``, where ``reference`` is a hash of the case's reference tokens
(a case whose reference changed is not matched).
"""

from __future__ import annotations

from typing import Any

from ..policy.costs import Action
from .buckets import Bucket
from .jsonl_store import JsonLinesStore
from .references import ReferenceTrajectory, key_digest

__all__ = ["VerdictStore"]


class VerdictStore(JsonLinesStore):
    """The verdicts of one generation key (module docstring; `get` reads, `put` appends one line).

    Args:
        path: the JSON-lines file (created by the first `put`).
        key: the generation key the file belongs to (JSON-serialisable).
    """

    ID_FIELDS = ("case", "reference", "bucket", "action")
    PREFIX = "verdicts"

    @staticmethod
    def accepts(fields: dict[str, Any]) -> bool:
        return isinstance(fields.get("valid"), bool)

    def get(self, reference: ReferenceTrajectory, bucket: Bucket, action: Action) -> bool | None:
        """The stored verdict of intervention ``(bucket, action)`` on ``reference``'s case, ``None`` when absent."""
        record = self.get_record(self._identity(reference, bucket, action))
        return None if record is None else record["valid"]

    def put(self, reference: ReferenceTrajectory, bucket: Bucket, action: Action, valid: bool) -> None:
        """Store the verdict ``valid`` of intervention ``(bucket, action)`` on ``reference``'s case (appended and
        flushed at once)."""
        if not isinstance(valid, bool):
            raise TypeError(f"valid must be a bool (the AST checker's verdict), got {type(valid).__name__}")
        self.put_record(self._identity(reference, bucket, action), {"valid": valid})

    @staticmethod
    def _identity(reference: ReferenceTrajectory, bucket: Bucket, action: Action) -> tuple[str, str, str, str]:
        if action not in (Action.L, Action.R):
            raise ValueError(f"an intervention applies R or L, got {action!r}")
        return reference.case_id, key_digest(list(reference.tokens)), str(bucket), action.name
