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

from .intervention_store import InterventionStore

__all__ = ["VerdictStore"]


class VerdictStore(InterventionStore):
    """The verdicts of one generation key (module docstring; `get` reads, `put` appends one line)."""

    PREFIX = "verdicts"
    FIELD = "valid"
    EXPECTED = "a bool (the AST checker's verdict)"

    @classmethod
    def valid_value(cls, value: Any) -> bool:
        return isinstance(value, bool)
