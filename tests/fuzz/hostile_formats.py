"""The fixed catalogue of hostile edits of the saved formats: every JSON file's fields (seeded samples of values,
types, nesting and sizes, and removals), whole-file replacements (empty, not JSON, too deep, too large, a folder,
an endless device), the safetensors header (dtypes, shapes, offsets, names, the length prefix) and raw bytes of
``cache.safetensors`` (truncated, extended, flipped, unservable values), the 0.1 files, and the INT4 fields of
format 2 (`int4_cases`: ``head_storage``, ``key_group`` and the five INT4 tensors)."""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hostile_artifacts import (
    DATA_V0_1,
    INT4_CACHE,
    INT4_KEY_GROUP,
    KINDS,
    Artifacts,
    edited,
    json_paths,
    judge_cache,
    judge_json_artifact,
    nested,
    path_words,
    rehash,
    safetensors_parts,
    write_json,
    write_safetensors,
)
from hostile_outcomes import Case
from safetensors.torch import load_file, save_file

HOSTILE_VALUES = (None, True, False, 0, -1, 1, 2.5, -0.0, 10**30, 1e308, "", "x", "0", [], {}, [[]], [None], nested(30))
"""What a field is replaced by: wrong types, signs and sizes (a 30-deep list is within the nesting bound)."""
EDITS_PER_FILE = 110
REMOVALS_PER_FILE = 20
TENSOR_NAMES = ("layers.0.keys", "layers.1.values", "layers.1.bias", "layers.0.offsets")


def format_cases(arts: Artifacts, work: Path, seed: int = 0) -> list[Case]:
    rng = random.Random(seed)
    cases = []
    for kind in KINDS:
        cases += _field_edits(arts, work, kind, rng)
        cases += _whole_file_cases(arts, work, kind)
    cases += _header_edits(arts, work)
    cases += _byte_edits(arts, work, rng)
    cases += _value_edits(arts, work)
    cases += _old_files(arts, work)
    cases += int4_cases(arts, work)
    return cases


def _judge(arts: Artifacts, kind: str, folder: Path, record: Any = None, **options) -> str | None:
    if kind == "cache":
        return judge_cache(arts, folder, **options)
    return judge_json_artifact(kind, folder, record)


def _field_edits(arts: Artifacts, work: Path, kind: str, rng: random.Random) -> list[Case]:
    """Seeded edits of the fields of ``kind``'s JSON file: a hostile value at a path, or the path removed."""
    record, name = arts.record(kind), KINDS[kind][1]
    paths = json_paths(record)
    pairs = sorted({(path, i) for path in paths for i in range(len(HOSTILE_VALUES))}, key=str)
    chosen = [(path, HOSTILE_VALUES[i], False) for path, i in rng.sample(pairs, min(EDITS_PER_FILE, len(pairs)))]
    chosen += [(path, None, True) for path in rng.sample(paths, min(REMOVALS_PER_FILE, len(paths)))]
    cases = []
    for n, (path, value, delete) in enumerate(chosen):
        mutated = edited(record, path, value, delete=delete)
        label = f"{'remove' if delete else 'set'} {'.'.join(map(str, path))}" + ("" if delete else f" = {value!r:.40}")

        def run(n=n, mutated=mutated):
            folder = arts.copy(kind, work / f"{kind}-field-{n}")
            write_json(folder / name, mutated)
            return _judge(arts, kind, folder, mutated)

        cases.append(Case("formats", name if kind != "cache" else "config.json (cache)", label, run, path_words(path)))
    return cases


def _whole_file_cases(arts: Artifacts, work: Path, kind: str) -> list[Case]:
    """``kind``'s JSON file replaced whole: refusals must name the file."""
    name = KINDS[kind][1]
    text = (arts.root / kind / name).read_text()
    contents: dict[str, Callable[[Path], None]] = {
        "empty": lambda p: p.write_bytes(b""),
        "null": lambda p: p.write_text("null"),
        "a list": lambda p: p.write_text("[1, 2]"),
        "an empty object": lambda p: p.write_text("{}"),
        "not JSON": lambda p: p.write_text("format_version = 1"),
        "NaN literal": lambda p: p.write_text(text[:-2] + ', "nan_field": NaN}'),
        "not UTF-8": lambda p: p.write_bytes(b"\xff\xfe{\x00}"),
        "truncated": lambda p: p.write_text(text[: len(text) // 2]),
        "100000 deep": lambda p: p.write_text('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}"),
        "65 deep": lambda p: p.write_text('{"x": ' + "[" * 65 + "]" * 65 + "}"),
        "a 5000-digit integer": lambda p: p.write_text('{"format_version": ' + "9" * 5000 + "}"),
        "a repeated key": lambda p: p.write_text(text.rstrip()[:-1] + ', "format_version": 1}'),
        "80 MB (sparse)": lambda p: os.truncate(p, 80 * 2**20),
        "a folder": lambda p: (p.unlink(), p.mkdir()),
        "missing": lambda p: p.unlink(),
        "a link to /dev/zero": lambda p: (p.unlink(), p.symlink_to("/dev/zero")),
        "a link to itself": lambda p: (p.unlink(), p.symlink_to(p.name)),
    }
    cases = []
    for n, (label, make) in enumerate(contents.items()):

        def run(n=n, make=make):
            folder = arts.copy(kind, work / f"{kind}-file-{n}")
            make(folder / name)
            return _judge(arts, kind, folder, None)

        target = name if kind != "cache" else "config.json (cache)"
        cases.append(Case("formats", target, f"file is {label}", run, (name, "folder", "format_version")))
    return cases


def _header_edits(arts: Artifacts, work: Path) -> list[Case]:
    """Edits of the safetensors header of ``cache.safetensors``, each with the content hash left stale (the hash
    refuses them) and recomputed (the checks behind it must)."""
    header, data = safetensors_parts(arts.root / "cache" / "cache.safetensors")
    edits: list[tuple[str, Callable[[dict], Any]]] = []
    for tensor in TENSOR_NAMES:
        start, stop = header[tensor]["data_offsets"]
        shape = header[tensor]["shape"]
        for dtype in ("F16", "BF16", "F64", "I64", "U8", "BOOL", "F8_E4M3", "XYZ", 5):
            edits.append((f"{tensor} dtype {dtype}", _set(tensor, "dtype", dtype)))
        for new_shape in ([], [0], shape[::-1], [shape[0] * 2, *shape[1:]], [10**12, 16], [-1, 16], [2**64], "x"):
            edits.append((f"{tensor} shape {new_shape}", _set(tensor, "shape", new_shape)))
        for offsets in ([0, 0], [start + 1, stop + 1], [start, stop + 4], [0, 10**12], [-4, stop], [stop, start]):
            edits.append((f"{tensor} data_offsets {offsets}", _set(tensor, "data_offsets", offsets)))
    edits += [
        ("layers.0.keys renamed layers.00.keys", _rename("layers.0.keys", "layers.00.keys")),
        ("layers.0.keys renamed layers.2.keys", _rename("layers.0.keys", "layers.2.keys")),
        ("layers.1.bias removed", lambda h: h.pop("layers.1.bias")),
        ("an extra empty tensor", lambda h: h.update(extra={"dtype": "F32", "shape": [0], "data_offsets": [0, 0]})),
        ("__metadata__ holds a number", lambda h: h.update(__metadata__={"format": 5})),
        ("__metadata__ is a list", lambda h: h.update(__metadata__=[])),
        ("__metadata__ holds 1 MB", lambda h: h.update(__metadata__={"format": "pt", "x": "y" * 2**20})),
        ("the header is a list", lambda h: [h]),
    ]
    cases = []
    for n, (label, edit) in enumerate(edits):
        for fresh_hash in (False, True):

            def run(n=n, edit=edit, fresh_hash=fresh_hash):
                folder = arts.copy("cache", work / f"header-{n}-{fresh_hash}")
                edited_header = _apply(edit, header)
                write_safetensors(folder / "cache.safetensors", edited_header, data)
                if fresh_hash:
                    rehash(folder)
                return judge_cache(arts, folder)

            hash_note = "hash recomputed" if fresh_hash else "hash stale"
            words = ("cache.safetensors", "tensors_sha256", "layers.")
            cases.append(Case("formats", "cache.safetensors header", f"{label} ({hash_note})", run, words))
    for n, prefix in enumerate((0, 7, 2**63, 2**64 - 1, None)):

        def run(n=n, prefix=prefix):
            folder = arts.copy("cache", work / f"prefix-{n}")
            path = folder / "cache.safetensors"
            raw = path.read_bytes()
            size = len(raw) - 8 + 1 if prefix is None else prefix
            path.write_bytes(size.to_bytes(8, "little") + raw[8:])
            rehash(folder)
            return judge_cache(arts, folder)

        label = f"header length prefix {'past the end' if prefix is None else prefix}"
        cases.append(Case("formats", "cache.safetensors header", label, run, ("cache.safetensors",)))
    return cases


def _set(tensor: str, field: str, value: Any) -> Callable[[dict], None]:
    return lambda header: header[tensor].__setitem__(field, value)


def _rename(old: str, new: str) -> Callable[[dict], None]:
    return lambda header: header.__setitem__(new, header.pop(old))


def _apply(edit: Callable[[dict], Any], header: dict) -> Any:
    """The header after ``edit`` (a copy; an edit that returns a value replaces the header with it)."""
    copied = {key: dict(value) if isinstance(value, dict) else value for key, value in header.items()}
    returned = edit(copied)
    return returned if isinstance(returned, list) else copied


def _byte_edits(arts: Artifacts, work: Path, rng: random.Random) -> list[Case]:
    """Raw bytes of ``cache.safetensors``: truncated, extended, seeded byte flips (hash recomputed: a flip that still
    gives a servable cache may load, as another cache), and the file replaced by a folder or an endless device."""
    raw = (arts.root / "cache" / "cache.safetensors").read_bytes()
    header_end = 8 + int.from_bytes(raw[:8], "little")
    edits: list[tuple[str, Callable[[Path], None], bool]] = []
    for size in (0, 4, 8, 9, header_end - 1, header_end, len(raw) - 1):
        edits.append((f"truncated to {size} bytes", lambda p, size=size: p.write_bytes(raw[:size]), True))
    edits.append(("8 zero bytes appended", lambda p: p.write_bytes(raw + bytes(8)), True))
    nan_data = raw[:header_end] + b"\xff" * (len(raw) - header_end)
    edits.append(("every data byte 0xFF (NaN)", lambda p: p.write_bytes(nan_data), True))
    for where, low, high, count in (("header", 8, header_end, 8), ("data", header_end, len(raw), 16)):
        for position in sorted(rng.sample(range(low, high), count)):
            flip = rng.randrange(1, 256)
            edits.append((f"{where} byte {position} xor {flip}", _flip(raw, position, flip), True))
    edits.append(("a data byte flipped, hash stale", _flip(raw, len(raw) - 3, 0x40), False))
    edits.append(("a folder", lambda p: (p.unlink(), p.mkdir()), False))
    edits.append(("missing", lambda p: p.unlink(), False))
    edits.append(("a link to /dev/zero", lambda p: (p.unlink(), p.symlink_to("/dev/zero")), False))
    cases = []
    for n, (label, make, fresh_hash) in enumerate(edits):

        def run(n=n, make=make, fresh_hash=fresh_hash):
            folder = arts.copy("cache", work / f"bytes-{n}")
            make(folder / "cache.safetensors")
            if fresh_hash:
                rehash(folder)
            return judge_cache(arts, folder, same_tensors=False)

        words = ("cache.safetensors", "tensors_sha256", "layers.", "tensor")
        cases.append(Case("formats", "cache.safetensors bytes", label, run, words))
    return cases


def _flip(raw: bytes, position: int, mask: int) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        data = bytearray(raw)
        data[position] ^= mask
        path.write_bytes(bytes(data))

    return write


def _value_edits(arts: Artifacts, work: Path) -> list[Case]:
    """One stored number replaced (through safetensors, hash recomputed): finite values the model cannot serve must
    be refused, small ones load."""
    values = (1e10, 1e19, 3e38, float("nan"), float("inf"), -float("inf"), 1e-45, -0.0, 88.0, 89.0, -89.0)
    cases = []
    for tensor in ("layers.0.keys", "layers.1.values", "layers.0.bias"):
        for value in values:

            def run(tensor=tensor, value=value):
                folder = arts.copy("cache", work / f"value-{tensor}-{value}")
                path = folder / "cache.safetensors"
                tensors = load_file(path)
                tensors[tensor].view(-1)[0] = value
                save_file(tensors, path, metadata={"format": "pt"})
                rehash(folder)
                return judge_cache(arts, folder, same_tensors=False)

            cases.append(Case("formats", "cache.safetensors values", f"{tensor}[0] = {value}", run, (tensor,)))
    return cases


def _old_files(arts: Artifacts, work: Path) -> list[Case]:
    """The files 0.1 saved: they load as they are; their tensors carry no content hash, so a stored number edited
    in place must still be refused when unservable."""
    cases = []
    for folder_name, kind in (("compacted_cache", "cache"), ("policy_table", "table"), ("head_budgets", "budgets")):

        def run(folder_name=folder_name, kind=kind):
            folder = work / f"v0_1-{folder_name}"
            shutil.rmtree(folder, ignore_errors=True)
            shutil.copytree(DATA_V0_1 / folder_name, folder)
            if kind == "cache":
                return judge_cache(arts, folder, same_tensors=False)
            file = "config.json" if kind == "budgets" else KINDS[kind][1]
            return judge_json_artifact(kind, folder, json.loads((folder / file).read_text()))

        cases.append(Case("formats", "0.1 files", f"{folder_name} as saved by 0.1", run, ()))
    for value in (3e38, float("nan"), 1e-3):

        def run(value=value):
            folder = work / f"v0_1-edited-{value}"
            shutil.rmtree(folder, ignore_errors=True)
            shutil.copytree(DATA_V0_1 / "compacted_cache", folder)
            tensors = load_file(folder / "cache.safetensors")
            tensors["layers.0.keys"][0, 0] = value
            save_file(tensors, folder / "cache.safetensors", metadata={"format": "pt"})
            return judge_cache(arts, folder, same_tensors=False)

        label = f"0.1 cache with layers.0.keys[0, 0] = {value}"
        cases.append(Case("formats", "0.1 files", label, run, ("layers.0.keys",)))
    return cases


INT4_TENSORS = ("key_codes", "key_scales", "key_offsets", "value_codes", "value_scales")
HEAD_STORAGE_EDITS = (
    None,
    "int4",
    [],
    ["int4"],
    ["bf16", "int4", "int4"],
    ["bf16", "int8"],
    ["bf16", None],
    [0, 1],
    ["int4", "int4"],
    ["bf16", "bf16"],
    ["int4", "bf16"],
)
"""``layers[0].head_storage`` (saved ``["bf16", "int4"]``): wrong types and lengths, an unknown storage, and valid
lists the tensors do not match (a head's storage flipped)."""
KEY_GROUP_EDITS = (0, -1, 2.5, "8", True, [8], 10**30, None, 1, 4, 16)
"""``layers[0].key_group`` (saved 8): invalid values, and valid ones the key scales' rows do not match (12 INT4
entries: 2 rows of scales in groups of 8, 1 with null or 16, 12 with 1, 3 with 4)."""


def int4_cases(arts: Artifacts, work: Path) -> list[Case]:
    """Hostile edits of the INT4 fields of a format 2 cache (`INT4_CACHE`): ``layers[0].head_storage`` and
    ``key_group`` set (`HEAD_STORAGE_EDITS`, `KEY_GROUP_EDITS`) or removed, each with the config's content hash left
    as saved (it covers the tensors only); and each INT4 tensor of layer 0 removed, cast to another dtype, cut by a row
    or given a NaN or infinite number (hash recomputed). Each must be refused naming the field or tensor."""
    config = json.loads((arts.root / INT4_CACHE / "config.json").read_text())
    assert (
        config["layers"][0]["head_storage"] == ["bf16", "int4"] and config["layers"][0]["key_group"] == INT4_KEY_GROUP
    )
    edits: list[tuple[str, Callable[[Path], None], tuple[str, ...]]] = []
    for field, values in (("head_storage", HEAD_STORAGE_EDITS), ("key_group", KEY_GROUP_EDITS)):
        path = ("layers", 0, field)
        for value in values:
            edits.append((f"set layers.0.{field} = {value!r:.40}", _config_edit(config, path, value), (field,)))
        edits.append((f"remove layers.0.{field}", _config_edit(config, path, None, delete=True), (field,)))
    for suffix in INT4_TENSORS:
        name = f"layers.0.{suffix}"
        words = (name,)
        edits.append((f"{name} removed", _tensor_edit(lambda t, name=name: t.pop(name)), words))
        other = torch.float32 if suffix.endswith(("scales", "offsets")) else torch.int8
        edits.append((f"{name} as {other}", _tensor_edit(_cast(name, other)), words))
        edits.append((f"{name} without its last row", _tensor_edit(_cut(name)), words))
        if suffix.endswith(("scales", "offsets")):
            for value in (float("nan"), float("inf"), -float("inf")):
                edits.append((f"{name}[0] = {value}", _tensor_edit(_number(name, value)), words))
    cases = []
    for n, (label, make, words) in enumerate(edits):

        def run(n=n, make=make):
            folder = arts.copy(INT4_CACHE, work / f"int4-{n}")
            make(folder)
            return judge_cache(arts, folder, original=INT4_CACHE)

        cases.append(Case("formats", "INT4 fields (format 2 cache)", label, run, words))
    return cases


def _config_edit(config: dict, path: tuple, value: Any, delete: bool = False) -> Callable[[Path], None]:
    mutated = edited(config, path, value, delete=delete)
    return lambda folder: write_json(folder / "config.json", mutated)


def _tensor_edit(edit: Callable[[dict], Any]) -> Callable[[Path], None]:
    """Apply ``edit`` to the folder's tensors, save them and record their new hash."""

    def make(folder: Path) -> None:
        tensors = load_file(folder / "cache.safetensors")
        edit(tensors)
        save_file(tensors, folder / "cache.safetensors", metadata={"format": "pt"})
        rehash(folder)

    return make


def _cast(name: str, dtype: torch.dtype) -> Callable[[dict], None]:
    return lambda tensors: tensors.__setitem__(name, tensors[name].to(dtype))


def _cut(name: str) -> Callable[[dict], None]:
    return lambda tensors: tensors.__setitem__(name, tensors[name][:-1].clone())


def _number(name: str, value: float) -> Callable[[dict], None]:
    return lambda tensors: tensors[name].view(-1).__setitem__(0, value)
