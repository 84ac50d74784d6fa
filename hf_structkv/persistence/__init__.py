"""What every saved hf_structkv artifact shares: folder or Hub resolution, atomic all-or-nothing saves, upload, model
fingerprints and their check, and model-card helpers.

Every artifact (`CompactedCache`, `PolicyTable`, `PrefillPolicy`, `HeadBudgets`) follows one convention built on this
package: ``Cls.from_pretrained(path_or_repo_id, *, model=None, tokenizer=None, revision=None, token=None)``,
``save_pretrained(directory)``, ``push_to_hub(repo_id, *, private=None, token=None, revision=None,
commit_message=None)`` and a ``README.md`` model card. Each artifact names its own JSON file (``config.json`` for a
compacted cache, ``policy_table.json``, ``prefill_policy.json``, ``head_budgets.json``), so no two artifacts give one
file name two meanings. Loading reads JSON and safetensors only: no code runs. Fingerprints live in `fingerprints`,
folders, locks and bounded JSON reading in `folders`.
"""

from __future__ import annotations

import importlib.resources
import json
import os
import string
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import huggingface_hub
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from .fingerprints import (
    FINGERPRINT_LIMITS,
    STRUCTURE_FIELDS,
    check_fingerprint,
    check_same_model,
    check_same_tokenizer,
    config_fingerprint,
    model_fingerprint,
    tokenizer_hash,
)
from .folders import (
    check_format_version,
    check_no_other_artifact,
    folder_lock,
    read_json_object,
    regular_file_size,
    remove_stale_temporaries,
    replace_file,
    resolve_folder,
    write_text_file,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "CARD_NAME",
    "FINGERPRINT_LIMITS",
    "STRUCTURE_FIELDS",
    "SavedArtifact",
    "base_model",
    "card_front_matter",
    "check_fingerprint",
    "check_format_version",
    "check_same_model",
    "check_same_tokenizer",
    "config_fingerprint",
    "human_bytes",
    "markdown_items",
    "model_fingerprint",
    "ratio_text",
    "read_json_object",
    "regular_file_size",
    "render_card",
    "replace_file",
    "resolve_folder",
    "tokenizer_hash",
    "upload_folder",
    "write_text_file",
]

CARD_NAME = "README.md"


# ---------------------------------------------------------------------------------------------------- Hub
def upload_folder(
    write: Callable[[Path], Any],
    files: tuple[str, ...],
    repo_id: str,
    *,
    commit_message: str,
    private: bool | None = None,
    token: str | None = None,
    revision: str | None = None,
) -> str:
    """Write ``files`` into a temporary folder through ``write(folder)`` and upload them to the Hub model repository
    ``repo_id`` (created if needed; ``private`` applies only then; branch ``revision`` created if given).

    Returns:
        The URL of the upload commit.
    """
    api = huggingface_hub.HfApi(token=token)
    with tempfile.TemporaryDirectory(prefix="hf_structkv_push_") as tmp:
        write(Path(tmp))
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision is not None:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=tmp,
            revision=revision,
            allow_patterns=list(files),
            commit_message=commit_message,
        )
    return str(commit.commit_url)


# ---------------------------------------------------------------------------------------------------- cards
def card_front_matter(tags: list[str], base: str | None) -> str:
    """The YAML front matter lines of a model card (between its ``---`` fences): the library, the tags ``hf_structkv``,
    ``kv-cache`` and ``tags``, and ``base_model`` when known."""
    lines = ["library_name: hf_structkv", "tags:", *(f"- {tag}" for tag in ("hf_structkv", "kv-cache", *tags))]
    if base:
        lines.append(f"base_model: {json.dumps(base)}")
    return "\n".join(lines)


def render_card(template_name: str, **fields: Any) -> str:
    """The model card template ``model_cards/{template_name}`` with its ``$fields`` substituted."""
    template = (importlib.resources.files("hf_structkv.model_cards") / template_name).read_text(encoding="utf-8")
    return string.Template(template).substitute(**fields)


def base_model(metadata: dict[str, Any]) -> str | None:
    """``metadata["base_model"]``, else the fingerprint's ``name_or_path`` when it is a ``namespace/name`` Hub id."""
    if metadata.get("base_model"):
        return str(metadata["base_model"])
    name = (metadata.get("fingerprint") or {}).get("name_or_path")
    if not isinstance(name, str) or name.count("/") != 1:
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def markdown_items(value: Any) -> str:
    """A dict as a bullet list, anything else as text; "not recorded" when absent."""
    if value is None or value == {}:
        return "not recorded"
    if isinstance(value, dict):
        return "\n".join(
            f"- **{key}**: {json.dumps(item) if not isinstance(item, str) else item}"
            for key, item in sorted(value.items())
        )
    return str(value)


def ratio_text(part: int, whole: int) -> str:
    """``part / whole`` as a percentage and a reduction factor."""
    if whole == 0:
        return "n/a"
    factor = f", {whole / part:.1f}x smaller" if part else ""
    return f"{100 * part / whole:.1f}%{factor}"


def human_bytes(n: int) -> str:
    """``n`` bytes in MiB / KiB with the exact count."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit} ({n:,} bytes)"
    return f"{n:,} bytes"


# ---------------------------------------------------------------------------------------------------- the convention
class SavedArtifact:
    """The persistence convention every hf_structkv artifact follows, written once.

    ``Cls.from_pretrained(path_or_repo_id, *, model=None, tokenizer=None, revision=None, token=None)`` resolves a
    folder (a local one, or a snapshot of a Hub repository holding only ``SAVED_FILES``; an artifact that reads a
    single file may also be given that file) and builds the artifact from it; ``save_pretrained(directory)`` writes
    the folder; ``push_to_hub(repo_id, *, private=None, token=None, revision=None, commit_message=None)`` writes it
    into a temporary folder (with a card whose usage snippet names ``repo_id``) and uploads it.

    A subclass sets ``SAVED_FILES`` and implements three hooks: ``_from_folder(source, *, model, tokenizer)`` (a
    classmethod: build and check the artifact from a resolved folder or file), ``_write_folder(directory, repo_id)``
    (write every file, all-or-nothing per file, the file that makes the folder an artifact last) and
    ``_commit_message()`` (the default message of an upload).

    A save is all-or-nothing for the folder as a whole, here for every artifact: it holds an exclusive advisory lock
    on the folder (`folders.folder_lock`, a ``flock`` of the directory itself) while it writes, and a load holds a
    shared one while it reads, so two processes saving into one folder at once serialise (the folder ends as one of
    the two artifacts, whole) and a reader sees the folder before or after a save, never during it. A lock rather
    than a fresh sibling folder swapped in: a folder cannot be replaced atomically while it keeps the user's other
    files (a calibration report beside a policy), and readers of a half-swapped folder would find nothing there. The
    lock binds only processes that take it; a compacted cache, the one artifact of two data files, also records the
    SHA-256 of its tensors in its ``config.json`` and refuses a mix on load whoever wrote it. A save removes the
    temporary files a save killed mid-write left (a failing save removes its own), and refuses a folder that holds
    another kind of artifact.
    """

    SAVED_FILES: tuple[str, ...] = ()

    @classmethod
    def from_pretrained(
        cls,
        path_or_repo_id: str | os.PathLike,
        *,
        model: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        revision: str | None = None,
        token: str | None = None,
    ):
        """Load what `save_pretrained` wrote, from a folder, a Hub repository or (where the artifact is one JSON
        file) that file. Reads JSON and safetensors only: no code runs.

        Args:
            model: when given, the artifact must have been built for it (its fingerprint is checked).
            tokenizer: when given, its vocabulary hash must equal the one recorded.
            revision: Hub branch, tag or commit (ignored for a local path).
            token: Hub token for private repositories.

        Raises:
            ValueError: naming the problem: a missing or invalid file, or a model / tokenizer the artifact was not
                built for.
        """
        path = _path_argument("path_or_repo_id", path_or_repo_id)
        if path.is_file():
            with folder_lock(path.parent, exclusive=False):
                return cls._from_folder(path, model=model, tokenizer=tokenizer)
        folder = resolve_folder(path_or_repo_id, cls.SAVED_FILES, revision=revision, token=token)
        with folder_lock(folder, exclusive=False):
            return cls._from_folder(folder, model=model, tokenizer=tokenizer)

    @classmethod
    def load(cls, path_or_repo_id: str | os.PathLike, **kwargs: Any):
        """`from_pretrained` under its 0.1 name."""
        return cls.from_pretrained(path_or_repo_id, **kwargs)

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write the artifact's files and its model card ``README.md`` into ``save_directory``, all-or-nothing for
        the folder (see the class docstring): under an exclusive lock, each file written to a temporary name and
        renamed into place.

        Raises:
            ValueError: ``save_directory`` is a file, or holds another kind of saved artifact; or the artifact is
                invalid (nothing is written then, and a folder this call created is removed again).
        """
        directory = _path_argument("save_directory", save_directory)
        if directory.exists() and not directory.is_dir():
            raise ValueError(f"save_directory {directory} is a file: give the folder to save into")
        created = not directory.exists()
        directory.mkdir(parents=True, exist_ok=True)
        try:
            with folder_lock(directory, exclusive=True):
                self.check_save_directory(directory)
                remove_stale_temporaries(directory, self.SAVED_FILES)
                self._write_folder(directory, repo_id=None)
        except BaseException:
            if created and not any(directory.iterdir()):
                directory.rmdir()
            raise

    @classmethod
    def check_save_directory(cls, directory: Path) -> None:
        """Refuse a ``directory`` that a save of this kind would spoil: one holding another kind of saved artifact
        (`folders.check_no_other_artifact`). ``save_pretrained`` runs it under the folder's lock; a command line runs
        it before any work.

        Raises:
            ValueError: naming the other artifact, its file and the fix.
        """
        if directory.is_dir():
            check_no_other_artifact(directory, cls.SAVED_FILES, cls.__name__)

    def push_to_hub(
        self,
        repo_id: str,
        *,
        private: bool | None = None,
        token: str | None = None,
        revision: str | None = None,
        commit_message: str | None = None,
    ) -> str:
        """Upload the saved form (with a card whose snippet loads ``repo_id``) to a Hub model repository.

        Creates the repository if needed (``private`` applies only then) and the branch ``revision`` if given;
        ``token`` is the Hub write token (``None``: the logged-in user's).

        Returns:
            The URL of the upload commit.
        """
        return upload_folder(
            lambda folder: self._write_folder(folder, repo_id=repo_id),
            self.SAVED_FILES,
            repo_id,
            commit_message=commit_message or self._commit_message(),
            private=private,
            token=token,
            revision=revision,
        )

    @classmethod
    def _from_folder(cls, source: Path, *, model: Any, tokenizer: Any):
        raise NotImplementedError(f"{cls.__name__} must implement _from_folder")

    def _write_folder(self, directory: Path, repo_id: str | None) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _write_folder")

    def _commit_message(self) -> str:
        return f"Upload {type(self).__name__} with hf_structkv"


def _path_argument(name: str, value: Any) -> Path:
    """``value`` as a ``Path`` (with ``~`` expanded), after checking it is a non-empty ``str`` or ``os.PathLike``."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str or os.PathLike (a folder or a Hub repository id), got {value!r}")
    if not os.fspath(value):
        raise ValueError(f"{name} is empty: give a folder (or a Hub repository id)")
    return Path(value).expanduser()
