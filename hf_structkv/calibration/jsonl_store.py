"""`JsonLinesStore`: records of one key in one JSON-lines file that several processes append to.

The on-disk caches of a calibration (`VerdictStore`: Runtime-V verdicts; `DevelopmentStore`: development cases of
complete candidates) share this format. The first line is ``{"key": ...}`` (what decides the stored results besides
a record's identity); each further line is one record, a JSON object whose identity fields (strings) name what it
measured and whose other fields are the measurement. A last line cut by a crash is ignored; a file whose first line
holds another key (a hash collision in the file name) is started anew by the first `put_record`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .references import key_digest

__all__ = ["JsonLinesStore"]


class JsonLinesStore:
    """The records of one key (module docstring).

    `get_record` reads (the file's new lines too, when a record is missing); `put_record` appends one line and
    remembers it (the only method that writes). Several processes may share one file: each appends its lines in single
    writes and reads the others' lines when it opens the file and when a record it needs is missing, so none repeats
    what another already stored. Subclasses name the identity fields (`ID_FIELDS`), the file name's prefix (`PREFIX`)
    and which read records they accept (`accepts`).

    Args:
        path: the JSON-lines file (created by the first `put_record`).
        key: the key the file belongs to (JSON-serialisable).
    """

    ID_FIELDS: tuple[str, ...] = ()
    PREFIX = "records"

    def __init__(self, path: str | Path, key: dict[str, Any]):
        self.path = Path(path)
        self.key = json.loads(json.dumps(key))
        self._records: dict[tuple[str, ...], dict[str, Any]] = {}
        self._fresh = True  # the next put (re)writes the key line first
        self._cut = False  # the file ends inside a line (a crash): the next put ends it first
        self._offset = 0  # bytes of the file read (complete lines only)
        if self.path.is_file():
            self._read()

    @classmethod
    def open(cls, cache_dir: str | Path, key: dict[str, Any]):
        """The store of ``key`` in ``cache_dir`` (``<PREFIX>-<hash of key>.jsonl``)."""
        return cls(Path(cache_dir) / f"{cls.PREFIX}-{key_digest(key)}.jsonl", key)

    def __len__(self) -> int:
        return len(self._records)

    @staticmethod
    def accepts(fields: dict[str, Any]) -> bool:
        """Whether a read record's measurement fields are well-formed (others are skipped as unreadable)."""
        return True

    def get_record(self, identity: tuple[str, ...]) -> dict[str, Any] | None:
        """The measurement fields stored under ``identity`` (one string per `ID_FIELDS`), ``None`` when absent; a
        record missing here is looked for among the lines other processes appended since the last read."""
        if identity not in self._records and not self._fresh:
            self._read_new()
        return self._records.get(identity)

    def put_record(self, identity: tuple[str, ...], fields: dict[str, Any]) -> None:
        """Store ``fields`` under ``identity`` (one line, appended and flushed at once)."""
        if len(identity) != len(self.ID_FIELDS) or not all(isinstance(part, str) for part in identity):
            raise ValueError(f"identity must be {len(self.ID_FIELDS)} strings {self.ID_FIELDS}, got {identity!r}")
        line = {**dict(zip(self.ID_FIELDS, identity, strict=True)), **fields}
        if self._fresh:
            self._start_file()
        with self.path.open("a", encoding="utf-8") as file:
            file.write(("\n" if self._cut else "") + json.dumps(line) + "\n")  # one write: appends do not interleave
        self._cut = False
        self._read_new()  # past our own line (and any other process's before it)
        self._records[tuple(identity)] = json.loads(json.dumps(fields))

    def _start_file(self) -> None:
        """Create the file with its key line; when another process created it meanwhile with the same key, append to
        it instead (and read its records); a file of another key is started anew."""
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

    def _read(self) -> None:
        """Check the key line, then read every complete record line (`_read_new`)."""
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
        """Read the complete lines past what was read (another process's records appended meanwhile)."""
        with self.path.open("rb") as file:
            file.seek(self._offset)
            chunk = file.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        self._cut = len(complete) < len(chunk)  # the file ends inside a line: a crash (or a line being written)
        for raw in complete.decode("utf-8").splitlines():
            try:
                line = json.loads(raw)
                identity = tuple(line.pop(name) for name in self.ID_FIELDS)
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
                continue  # a line cut by a crash
            if all(isinstance(part, str) for part in identity) and self.accepts(line):
                self._records[identity] = line
