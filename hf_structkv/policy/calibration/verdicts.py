"""`VerdictStore`: Runtime-V verdicts kept on disk, so that a stopped or repeated calibration never generates the same
intervention twice.

Runtime-V is the calibration's cost (one complete generation per needed ``(bucket, action, case)``, tens of seconds
each on a CPU). With a store, `intervention_runs` asks it before generating and appends each new verdict as soon as
its generation ends: a run that stops (a killed job, a session limit) resumes where it stopped, and a re-run with
other thresholds or tolerances generates nothing.

One JSON-lines file per generation key (model fingerprint, dtype, package version, generation cap, window, sinks,
tag view, stage, layer groups: what decides an intervened generation besides the case and the intervention), named
by the key's hash, in the calibration cache folder. Its first line is ``{"key": ...}``; each further line is one
verdict ``{"case", "reference", "bucket", "action", "valid"}``, where ``reference`` is a hash of the case's reference
tokens (a case whose reference changed is not matched). A last line cut by a crash is ignored; a file whose first
line holds another key (a hash collision) is started anew.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..costs import Action
from .buckets import Bucket
from .references import ReferenceTrajectory, key_digest

__all__ = ["VerdictStore"]


class VerdictStore:
    """The verdicts of one generation key (module docstring).

    `get` reads; `put` appends one line to the file and remembers it (the only method that changes state). Several
    processes may share one file (e.g. one calibration per category into one cache folder): each appends its lines
    in single writes and reads the others' when it opens the file.

    Args:
        path: the JSON-lines file (created by the first `put`).
        key: the generation key the file belongs to (JSON-serialisable).
    """

    def __init__(self, path: str | Path, key: dict[str, Any]):
        self.path = Path(path)
        self.key = json.loads(json.dumps(key))
        self._verdicts: dict[tuple[str, str, str, str], bool] = {}
        self._fresh = True  # the next put (re)writes the key line first
        self._cut = False  # the file ends inside a line (a crash): the next put ends it first
        if self.path.is_file():
            self._read()

    @classmethod
    def open(cls, cache_dir: str | Path, key: dict[str, Any]) -> VerdictStore:
        """The store of ``key`` in ``cache_dir`` (``verdicts-<hash of key>.jsonl``)."""
        return cls(Path(cache_dir) / f"verdicts-{key_digest(key)}.jsonl", key)

    def __len__(self) -> int:
        return len(self._verdicts)

    def get(self, reference: ReferenceTrajectory, bucket: Bucket, action: Action) -> bool | None:
        """The stored verdict of intervention ``(bucket, action)`` on ``reference``'s case, ``None`` when absent."""
        return self._verdicts.get(self._line_key(reference, bucket, action))

    def put(self, reference: ReferenceTrajectory, bucket: Bucket, action: Action, valid: bool) -> None:
        """Store the verdict ``valid`` of intervention ``(bucket, action)`` on ``reference``'s case (appended and
        flushed at once)."""
        if not isinstance(valid, bool):
            raise TypeError(f"valid must be a bool (the AST checker's verdict), got {type(valid).__name__}")
        line_key = self._line_key(reference, bucket, action)
        case, tokens, bucket_text, action_name = line_key
        line = {"case": case, "reference": tokens, "bucket": bucket_text, "action": action_name, "valid": valid}
        if self._fresh:
            self._start_file()
        with self.path.open("a", encoding="utf-8") as file:
            file.write(("\n" if self._cut else "") + json.dumps(line) + "\n")  # one write: appends do not interleave
        self._cut = False
        self._verdicts[line_key] = valid

    def _start_file(self) -> None:
        """Create the file with its key line; when another process created it meanwhile with the same key, append to
        it instead (and read its verdicts); a file of another key is started anew."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with self.path.open("x", encoding="utf-8") as file:
                file.write(json.dumps({"key": self.key}) + "\n")
        except FileExistsError:
            self._read()
            if self._fresh:
                self.path.write_text(json.dumps({"key": self.key}) + "\n", encoding="utf-8")
        self._fresh = False

    @staticmethod
    def _line_key(reference: ReferenceTrajectory, bucket: Bucket, action: Action) -> tuple[str, str, str, str]:
        if action not in (Action.L, Action.R):
            raise ValueError(f"an intervention applies R or L, got {action!r}")
        return reference.case_id, key_digest(list(reference.tokens)), str(bucket), action.name

    def _read(self) -> None:
        text = self.path.read_text(encoding="utf-8")
        lines = text.splitlines()
        try:
            head = json.loads(lines[0]) if lines else None
        except json.JSONDecodeError:
            head = None
        if not isinstance(head, dict) or head.get("key") != self.key:
            return  # another key, or no key line: the first put starts the file anew
        self._fresh, self._cut = False, not text.endswith("\n")
        for raw in lines[1:]:
            try:
                line = json.loads(raw)
                entry = (line["case"], line["reference"], line["bucket"], line["action"])
                valid = line["valid"]
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut by a crash
            if isinstance(valid, bool) and all(isinstance(part, str) for part in entry):
                self._verdicts[entry] = valid
