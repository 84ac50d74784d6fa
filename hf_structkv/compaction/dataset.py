"""Compact many contexts: one `CompactedCache` folder per distinct context of a ``datasets.Dataset``.

`compact_dataset` is written for several processes (``accelerate launch``; see ``hf-structkv compact-dataset``):
the ``k``-th distinct context goes to process ``k % num_processes``, which writes it to a private temporary folder
(``out_dir/.partial/NAME``) and renames it to ``out_dir/NAME`` once saved, so a folder under its final name is
always complete. A rerun skips complete folders (after checking that they were made from the same text, model and
compaction settings) and redoes everything else. Each process lists its contexts in a part manifest; once every
process is done, the main process merges the parts into ``out_dir/manifest.jsonl`` (`merge_manifest`), one JSON
line per context in dataset order.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..cache.compacted import CompactedCache
from ..cache.compacted_files import CACHE_FILES, CONFIG_NAME
from ..persistence import STRUCTURE_FIELDS, model_fingerprint
from ..prompts import document_chat_parts
from ..validation import check_bool, check_int, is_hub_id
from .pipeline import compact
from .self_study import SelfStudy

__all__ = [
    "MANIFEST_NAME",
    "DatasetContext",
    "compact_dataset",
    "compact_document",
    "dataset_contexts",
    "load_rows",
    "merge_manifest",
]

MANIFEST_NAME = "manifest.jsonl"
DATA_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
_PART_PREFIX = "manifest.part-"
_PARTIAL_DIR = ".partial"
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_MODEL_FIELDS = (*STRUCTURE_FIELDS, "tokenizer_hash")


# ---------------------------------------------------------------------------------------------------- rows
def load_rows(data: str | os.PathLike, split: str | None = None) -> datasets.Dataset:
    """Open a local dataset as one ``datasets.Dataset``.

    Args:
        data: a ``.json`` / ``.jsonl`` (JSON lines), ``.csv`` or ``.parquet`` file; a folder written by
            ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``; anything else goes to ``datasets.load_dataset``
            (a folder of data files, or a dataset name already in the local Hugging Face cache).
        split: which split (default: ``"train"``, the only split of a data file; for a saved ``DatasetDict`` its one
            split when it has exactly one).

    Raises:
        ValueError: ``data`` names a data file (by its suffix) or a path (not a dataset name) that does not exist, a
            data file with another suffix, an empty data file or one that ``datasets`` cannot read as its suffix
            says; a ``split`` that is not there.
    """
    path = Path(data)
    if path.is_file():
        return _read_data_file(path, split)
    if path.is_dir() and ((path / "state.json").exists() or (path / "dataset_dict.json").exists()):
        return _one_split(datasets.load_from_disk(str(path)), split, str(path))
    if not path.exists() and (path.suffix.lower() in DATA_FILE_BUILDERS or not is_hub_id(str(data))):
        raise ValueError(
            f"data {str(data)!r} does not exist: pass a {'/'.join(DATA_FILE_BUILDERS)} file, a folder written by "
            "save_to_disk, or the name of a dataset in the local Hugging Face cache"
        )
    return _one_split(datasets.load_dataset(str(data), split=split), split, str(data))


def _read_data_file(path: Path, split: str | None) -> datasets.Dataset:
    builder = DATA_FILE_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise ValueError(f"data file {str(path)!r} has suffix {path.suffix!r}; use one of {sorted(DATA_FILE_BUILDERS)}")
    if split not in (None, "train"):
        raise ValueError(f"a data file has one split, 'train'; got split {split!r} for {str(path)!r}")
    if path.stat().st_size == 0:
        raise ValueError(f"data file {str(path)!r} is empty: it must hold one row per context")
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train")
    except (datasets.exceptions.DatasetGenerationError, ValueError) as err:
        raise ValueError(
            f"data file {str(path)!r} holds no rows readable as {builder}: {err.__cause__ or err}"
        ) from err


def _one_split(loaded, split: str | None, where: str) -> datasets.Dataset:
    if isinstance(loaded, datasets.Dataset):
        return loaded
    if not isinstance(loaded, datasets.DatasetDict):
        raise TypeError(f"{where} holds a {type(loaded).__name__}; compact-dataset needs a datasets.Dataset")
    if split is None and len(loaded) == 1:
        return next(iter(loaded.values()))
    if split not in loaded:
        raise ValueError(f"split must be one of {sorted(loaded)} for {where}, got {split!r}")
    return loaded[split]


@dataclass(frozen=True)
class DatasetContext:
    """One distinct context: its folder ``name``, the index of its first ``row`` in the dataset, its ``text``."""

    name: str
    row: int
    text: str

    @property
    def sha256(self) -> str:
        return _sha256(self.text)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def dataset_contexts(
    dataset: datasets.Dataset, text_column: str = "context", id_column: str | None = None
) -> list[DatasetContext]:
    """The distinct contexts of ``dataset`` in order of first appearance.

    A context is named by its ``id_column`` value (a folder name: letters, digits, ``_``, ``.``, ``-``, not starting
    with ``.`` or ``-``) or, without an id column, by the first 16 hex digits of its text's SHA-256. Rows repeating a
    context (e.g. one row per question) share it; two different texts under one name are an error, and so is a
    dataset without rows.
    """
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(
            f"dataset must be a datasets.Dataset, got {type(dataset).__name__}: open files with load_rows(path, "
            "split) and pick a split of a DatasetDict (dataset['train'])"
        )
    for role, column in (("text_column", text_column), ("id_column", id_column)):
        if column is not None and column not in dataset.column_names:
            raise ValueError(f"{role} {column!r} is not a column of the dataset; columns: {dataset.column_names}")
    if len(dataset) == 0:
        raise ValueError("dataset has no rows: give it one row per context")
    texts = dataset[text_column]
    ids = dataset[id_column] if id_column is not None else [None] * len(texts)
    contexts: dict[str, DatasetContext] = {}
    for row, (text, identifier) in enumerate(zip(texts, ids, strict=True)):
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"row {row}: column {text_column!r} must hold a non-empty text, got {text!r}")
        name = _folder_name(identifier, row, id_column) if id_column else _sha256(text)[:16]
        earlier = contexts.get(name)
        if earlier is None:
            contexts[name] = DatasetContext(name, row, text)
        elif earlier.text != text:
            raise ValueError(
                f"rows {earlier.row} and {row} have the same {id_column!r} {name!r} but different texts; give each "
                "context its own id"
            )
    return list(contexts.values())


def _folder_name(identifier: Any, row: int, id_column: str) -> str:
    name = str(identifier)
    if isinstance(identifier, bool) or not isinstance(identifier, (str, int)) or not _SAFE_NAME.fullmatch(name):
        raise ValueError(
            f"row {row}: {id_column!r} value {identifier!r} is not usable as a folder name; ids must be strings or "
            "ints of letters, digits, '_', '.', '-' (not starting with '.' or '-'), or leave id_column unset to name "
            "folders by a hash of the text"
        )
    if name.startswith(_PART_PREFIX) or name == MANIFEST_NAME:
        raise ValueError(f"row {row}: {id_column!r} value {name!r} is reserved for the manifest; rename it")
    return name


# ---------------------------------------------------------------------------------------------------- one document
def compact_document(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    document: str,
    keep_template: bool = False,
    **compact_kwargs,
) -> CompactedCache:
    """`compact` a document as the user turn of the tokenizer's chat template, ready for questions.

    With a chat template the context is everything up to the question (`document_chat_parts`); the rest of the
    turn is saved as ``metadata["question_suffix"]`` (which ``hf-structkv generate`` appends to each question) and,
    unless ``self_study`` is given, closes each self-study prompt. ``keep_template=True`` keeps the chat scaffold
    before the document (system turn, user-turn header) whole and compacts the document only (`compact`'s
    ``prefix=``). Without a chat template the text is compacted as it is. ``compact_kwargs`` go to `compact`.

    Raises:
        TypeError: ``keep_template`` is not a bool.
        ValueError: ``keep_template=True`` with a tokenizer that has no chat template, or together with ``prefix=``.
    """
    if check_bool("keep_template", keep_template) and "prefix" in compact_kwargs:
        raise ValueError("keep_template=True makes the chat scaffold the prefix; pass it or prefix=, not both")
    if not getattr(tokenizer, "chat_template", None):
        if keep_template:
            raise ValueError("keep_template=True needs a tokenizer with a chat template; drop it to compact the text")
        return compact(model, tokenizer, document, **compact_kwargs)
    opening, body, question_suffix = document_chat_parts(tokenizer, document)
    compact_kwargs.setdefault("self_study", SelfStudy(turn_suffix=question_suffix))
    if keep_template:
        cache = compact(model, tokenizer, body, prefix=opening, **compact_kwargs)
    else:
        cache = compact(model, tokenizer, opening + body, **compact_kwargs)
    cache.metadata["question_suffix"] = question_suffix
    return cache


# ---------------------------------------------------------------------------------------------------- many documents
def compact_dataset(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    dataset: datasets.Dataset,
    out_dir: str | os.PathLike,
    text_column: str = "context",
    id_column: str | None = None,
    process_index: int = 0,
    num_processes: int = 1,
    progress: bool = True,
    **compact_kwargs,
) -> list[dict[str, Any]]:
    """Compact this process's share of the distinct contexts of ``dataset`` into ``out_dir/NAME`` folders.

    Every process calls it with the same arguments but its own ``process_index``; the ``k``-th distinct context
    (`dataset_contexts`) is this process's when ``k % num_processes == process_index``. Each context is compacted
    by `compact_document` (``compact_kwargs`` go to `compact`; ``progress`` only drives this function's bar),
    saved to ``out_dir/.partial/NAME`` and renamed to ``out_dir/NAME``. A complete ``out_dir/NAME`` is reused
    without compacting (a ValueError if it holds another text or was made with another model or other
    ``compact_kwargs``); an incomplete one, or a ``.partial`` left by a killed run, is removed and redone.

    The process's manifest lines go to ``out_dir/manifest.part-IIIII-of-NNNNN.jsonl``; once every process is
    done, call `merge_manifest` once (the main process).

    Returns:
        The manifest records of this process's contexts (see `merge_manifest`), in dataset order.
    """
    num_processes = check_int("num_processes", num_processes, 1)
    process_index = check_int("process_index", process_index, 0, num_processes - 1)
    shard = dataset_contexts(dataset, text_column, id_column)[process_index::num_processes]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = _settings(compact_kwargs)
    fingerprint = json.loads(json.dumps(model_fingerprint(model, tokenizer)))
    part = out / f"{_PART_PREFIX}{process_index:05d}-of-{num_processes:05d}.jsonl"
    records = []
    bar = tqdm(
        shard, desc=f"compact-dataset {process_index + 1}/{num_processes}", position=process_index, disable=not progress
    )
    with part.open("w", encoding="utf-8") as lines:
        for context in bar:
            folder = out / context.name
            reused = _is_complete(folder)
            if reused:
                _check_reusable(folder, context, settings, fingerprint)
            else:
                if folder.exists():  # not made by compact_dataset's rename, so possibly cut short: redo it
                    shutil.rmtree(folder)
                _compact_into(folder, model, tokenizer, context, settings, compact_kwargs)
            record = {"id": context.name, "row": context.row, **_record(folder), "reused": reused}
            lines.write(json.dumps(record) + "\n")
            lines.flush()
            records.append(record)
    return records


def _settings(compact_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``compact_kwargs`` as JSON: plain values as they are, objects by their ``describe()`` or their type name."""
    settings = {}
    for key, value in sorted(compact_kwargs.items()):
        try:
            settings[key] = json.loads(json.dumps(value, allow_nan=False))
        except (TypeError, ValueError):
            describe = getattr(value, "describe", None)
            settings[key] = describe() if callable(describe) else f"<{type(value).__name__}>"
    return settings


def _is_complete(folder: Path) -> bool:
    """A folder holding every cache file (``config.json`` is written last, and the folder is renamed when done)."""
    return folder.is_dir() and all((folder / name).is_file() for name in CACHE_FILES)


def _check_reusable(folder: Path, context: DatasetContext, settings: dict, fingerprint: dict) -> None:
    config = _read_config(folder)
    saved = config.get("dataset") or {}
    problems = []
    if saved.get("text_sha256") != context.sha256:
        problems.append(f"another text than row {context.row}'s")
    if saved.get("settings") != settings:
        problems.append(f"compaction settings {saved.get('settings')} instead of {settings}")
    saved_model = config.get("fingerprint") or {}
    changed = [field for field in _MODEL_FIELDS if saved_model.get(field) != fingerprint.get(field)]
    if changed:
        problems.append(f"another model or tokenizer ({', '.join(changed)} differ)")
    if problems:
        raise ValueError(
            f"{folder} already holds a compacted cache made from {'; '.join(problems)}: delete it, or write to "
            "another out_dir"
        )


def _compact_into(
    folder: Path,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    context: DatasetContext,
    settings: dict,
    compact_kwargs: dict,
) -> None:
    """Compact ``context``, save it under ``out_dir/.partial/NAME``, then rename that folder to ``folder``."""
    partial = folder.parent / _PARTIAL_DIR / context.name
    if partial.exists():
        shutil.rmtree(partial)
    start = time.perf_counter()
    cache = compact_document(model, tokenizer, context.text, **compact_kwargs)
    cache.metadata["dataset"] = {
        "id": context.name,
        "row": context.row,
        "text_sha256": context.sha256,
        "settings": settings,
        "seconds": round(time.perf_counter() - start, 3),
    }
    cache.save_pretrained(partial)
    os.rename(partial, folder)


def _read_config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))


def _record(folder: Path) -> dict[str, Any]:
    """The manifest fields of a complete cache folder that its ``config.json`` holds."""
    config = _read_config(folder)
    return {
        "folder": folder.name,
        "length": config["original_length"],
        "bytes": config["context_nbytes"],
        "full_bytes": config["full_kv_nbytes"],
        "heldout_relative_loss": (config.get("quality") or {}).get("heldout_relative_loss_mean"),
        "seconds": (config.get("dataset") or {}).get("seconds"),
    }


def merge_manifest(out_dir: str | os.PathLike, num_processes: int = 1) -> list[dict[str, Any]]:
    """Merge the part manifests of the last `compact_dataset` run into ``out_dir/manifest.jsonl``.

    Call it once, after every process has returned. It reads the ``num_processes`` parts of that run, writes
    one line per context, sorted by dataset row, to a temporary file renamed into place, and removes every part
    manifest (also those of earlier, interrupted runs) and the emptied ``.partial`` folder.

    Each record: ``id`` (the folder name: the id column's value or the text hash), ``row`` (first dataset row of the
    context), ``folder`` (relative to ``out_dir``), ``length`` (context tokens), ``bytes`` (stored compacted
    context), ``full_bytes`` (the same context in a ``DynamicCache``), ``heldout_relative_loss`` (mean over KV
    heads; ``None`` for query-free methods), ``seconds`` (compacting it, when it was made) and ``reused`` (the folder
    was already complete in that run).
    """
    out = Path(out_dir)
    parts = [out / f"{_PART_PREFIX}{i:05d}-of-{num_processes:05d}.jsonl" for i in range(num_processes)]
    missing = [part.name for part in parts if not part.is_file()]
    if missing:
        raise ValueError(
            f"{out} lacks the part manifests {missing}: did every one of the {num_processes} processes finish "
            "compact_dataset?"
        )
    records = [json.loads(line) for part in parts for line in part.read_text(encoding="utf-8").splitlines() if line]
    records.sort(key=lambda record: record["row"])
    temporary = out / f".{MANIFEST_NAME}.tmp"
    temporary.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    os.replace(temporary, out / MANIFEST_NAME)
    for part in out.glob(f"{_PART_PREFIX}*.jsonl"):
        part.unlink()
    partial = out / _PARTIAL_DIR
    if partial.is_dir() and not any(partial.iterdir()):
        partial.rmdir()
    return records
