"""`DevelopmentStore`: the development cases of complete candidates kept on disk, so that a stopped, repeated or
grown calibration never generates a candidate's development case twice.

The development selection (eq. 9) generates every development case under each evaluated candidate (minutes per
candidate on a CPU). The candidates of a path are built from the calibration cases only, so a re-run with the same
calibration split (resumed after a stop, with more candidates per path, or with more development cases) meets the
same candidates again: with a store, `evaluate_controller` reads each case it has already generated under a
candidate and appends each new one as soon as it is scored.

One JSON-lines file (`JsonLinesStore`) per generation key (as `VerdictStore`'s, with the stage), named
``development-<hash>.jsonl``; each line after the key line is one case ``{"case", "candidate", "valid",
"prompt_bits", "prompt_tokens", "decode_bits", "decode_tokens", "full_bits"}``, where ``candidate`` is
`candidate_digest` of the policies the case was generated under.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..validation import is_int
from .jsonl_store import JsonLinesStore
from .references import key_digest

__all__ = ["DevCase", "DevelopmentStore", "candidate_digest"]

# What a policy file records about its making (card fields): they do not change a generation under the policy.
_RECORD_FIELDS = ("hf_structkv_version", "thresholds", "calibration", "provenance", "description", "fingerprint")


def candidate_digest(policy, prefill_policy=None) -> str:
    """The hash naming a candidate: its decode table's and prefill policy's files without their card fields
    (thresholds, calibration record, provenance, description, fingerprint, version), i.e. what serving reads."""
    served = [
        None if p is None else {k: v for k, v in p.to_json_dict().items() if k not in _RECORD_FIELDS}
        for p in (policy, prefill_policy)
    ]
    return key_digest(served)


@dataclass(frozen=True)
class DevCase:
    """One development case generated under one candidate.

    Attributes:
        valid: the AST checker's verdict.
        prompt_bits, prompt_tokens: scheduled payload of the prompt and its length.
        decode_bits, decode_tokens: scheduled payload of the generated tokens and how many were decided.
        full_bits: a token's Full-KV payload.
    """

    valid: bool
    prompt_bits: float
    prompt_tokens: int
    decode_bits: float
    decode_tokens: int
    full_bits: float


class DevelopmentStore(JsonLinesStore):
    """The development cases of one generation key (module docstring; `get` reads, `put` appends one line)."""

    ID_FIELDS = ("case", "candidate")
    PREFIX = "development"

    @staticmethod
    def accepts(fields: dict[str, Any]) -> bool:
        numbers = ("prompt_bits", "decode_bits", "full_bits")
        counts = ("prompt_tokens", "decode_tokens")
        return (
            isinstance(fields.get("valid"), bool)
            and all(isinstance(fields.get(n), (int, float)) and not isinstance(fields.get(n), bool) for n in numbers)
            and all(is_int(fields.get(n)) for n in counts)
        )

    def get(self, case_id: str, candidate: str) -> DevCase | None:
        """The stored case ``case_id`` under the candidate named ``candidate`` (`candidate_digest`), ``None`` when
        absent."""
        record = self.get_record((case_id, candidate))
        return None if record is None else DevCase(**{name: record[name] for name in DevCase.__dataclass_fields__})

    def put(self, case_id: str, candidate: str, case: DevCase) -> None:
        """Store ``case`` (case ``case_id`` generated under ``candidate``), appended and flushed at once."""
        if not isinstance(case, DevCase):
            raise TypeError(f"case must be a DevCase, got {type(case).__name__}")
        if not self.accepts(asdict(case)):
            raise ValueError(f"case must hold a bool verdict, numeric payloads and integer token counts, got {case!r}")
        self.put_record((case_id, candidate), asdict(case))
