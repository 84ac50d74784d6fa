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

    `get` reads (the file's new lines too, when a verdict is missing); `put` appends one line to the file and
    remembers it (the only method that writes). Several processes may share one file (e.g. two calibrations of
    overlapping splits in one cache folder): each appends its lines in single writes and reads the others' lines when
    it opens the file and when a verdict it needs is missing, so none generates what another already stored.

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
        self._offset = 0  # bytes of the file read (complete lines only)
        if self.path.is_file():
            self._read()

    @classmethod
    def open(cls, cache_dir: str | Path, key: dict[str, Any]) -> VerdictStore:
        """The store of ``key`` in ``cache_dir`` (``verdicts-<hash of key>.jsonl``)."""
        return cls(Path(cache_dir) / f"verdicts-{key_digest(key)}.jsonl", key)

    def __len__(self) -> int:
        return len(self._verdicts)

    def get(self, reference: ReferenceTrajectory, bucket: Bucket, action: Action) -> bool | None:
        """The stored verdict of intervention ``(bucket, action)`` on ``reference``'s case, ``None`` when absent;
        a verdict missing here is looked for among the lines other processes appended since the last read."""
        line_key = self._line_key(reference, bucket, action)
        if line_key not in self._verdicts and not self._fresh:
            self._read_new()
        return self._verdicts.get(line_key)

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
        self._read_new()  # past our own line (and any other process's before it)
        self._verdicts[line_key] = valid

    def _start_file(self) -> None:
        """Create the file with its key line; when another process created it meanwhile with the same key, append to
        it instead (and read its verdicts); a file of another key is started anew."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        head = json.dumps({"key": self.key}) + "\n"
        try:
            with self.path.open("x", encoding="utf-8") as file:
                file.write(head)
        except FileExistsError:
            self._read()
            if self._fresh:
                self.path.write_text(head, encoding="utf-8")
        if self._fresh:
            self._fresh, self._offset = False, len(head.encode("utf-8"))

    @staticmethod
    def _line_key(reference: ReferenceTrajectory, bucket: Bucket, action: Action) -> tuple[str, str, str, str]:
        if action not in (Action.L, Action.R):
            raise ValueError(f"an intervention applies R or L, got {action!r}")
        return reference.case_id, key_digest(list(reference.tokens)), str(bucket), action.name

    def _read(self) -> None:
        """Check the key line, then read every complete verdict line (`_read_new`)."""
        with self.path.open("rb") as file:
            first = file.readline()
        try:
            head = json.loads(first) if first.endswith(b"\n") else None
        except json.JSONDecodeError:
            head = None
        if not isinstance(head, dict) or head.get("key") != self.key:
            return  # another key, or no key line: the first put starts the file anew
        self._fresh, self._offset = False, len(first)
        self._read_new()

    def _read_new(self) -> None:
        """Read the complete lines past what was read (another process's verdicts appended meanwhile)."""
        with self.path.open("rb") as file:
            file.seek(self._offset)
            chunk = file.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        self._cut = len(complete) < len(chunk)  # the file ends inside a line: a crash (or a line being written)
        for raw in complete.decode("utf-8").splitlines():
            try:
                line = json.loads(raw)
                entry = (line["case"], line["reference"], line["bucket"], line["action"])
                valid = line["valid"]
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut by a crash
            if isinstance(valid, bool) and all(isinstance(part, str) for part in entry):
                self._verdicts[entry] = valid
