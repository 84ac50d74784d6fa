"""What every saved hf_structkv artifact shares: folder or Hub resolution, atomic writes, upload, model fingerprints
and their check, and model-card helpers.

Every artifact (`CompactedCache`, `PolicyTable`, `PrefillPolicy`, `HeadBudgets`) follows one convention built on this
module: ``Cls.from_pretrained(path_or_repo_id, *, model=None, tokenizer=None, revision=None, token=None)``,
``save_pretrained(directory)``, ``push_to_hub(repo_id, *, private=None, token=None, revision=None,
commit_message=None)`` and a ``README.md`` model card. Each artifact names its own JSON file (``config.json`` for a
compacted cache, ``policy_table.json``, ``prefill_policy.json``, ``head_budgets.json``), so no two artifacts give one
file name two meanings. Loading reads JSON and safetensors only: no code runs.
"""

from __future__ import annotations

import hashlib
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

from .version import __version__

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "CARD_NAME",
    "STRUCTURE_FIELDS",
    "SavedArtifact",
    "base_model",
    "card_front_matter",
    "check_same_model",
    "check_same_tokenizer",
    "human_bytes",
    "markdown_items",
    "model_fingerprint",
    "ratio_text",
    "read_json_object",
    "render_card",
    "replace_file",
    "resolve_folder",
    "tokenizer_hash",
    "upload_folder",
    "write_text_file",
]

CARD_NAME = "README.md"

# Fingerprint fields that must match between a saved artifact and the model it is used with (in this order, so the
# first difference is the one reported). "architecture" (a class name: LlamaForCausalLM and LlamaModel make the same
# keys), "name_or_path" (a local path or a Hub id) and "tokenizer_hash" (checked only when a tokenizer is given) are
# not.
STRUCTURE_FIELDS = (
    "model_type",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_size",
    "layer_types",
    "sliding_window",
    "rope_parameters",
)


# ---------------------------------------------------------------------------------------------------- fingerprints
def tokenizer_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 (hex) of the tokenizer's vocabulary (sorted ``get_vocab()`` items) and its special tokens.

    Deterministic across processes and independent of dict order; any object with ``get_vocab()`` works (special
    tokens are read from ``special_tokens_map`` when it has one).
    """
    payload = {
        "vocab": sorted(tokenizer.get_vocab().items()),
        "special_tokens": getattr(tokenizer, "special_tokens_map", None) or {},
    }
    encoded = json.dumps(payload, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8")
    return hashlib.sha256(encoded).hexdigest()


def model_fingerprint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None) -> dict[str, Any]:
    """What a saved artifact depends on: the model's attention structure, RoPE and (optionally) tokenizer.

    Returns a JSON-serialisable dict: ``architecture``, ``name_or_path`` (``None`` when unknown), ``model_type``,
    ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``hidden_size``,
    ``layer_types`` and ``sliding_window`` (``None`` when the config has none), ``rope_parameters`` (transformers
    5.x ``config.rope_parameters``, else ``rope_theta`` / ``rope_scaling``) and ``tokenizer_hash`` (``None``
    without ``tokenizer``). Multimodal models are described by their text (decoder) config.
    """
    config = model.config
    text = config.get_text_config(decoder=True)
    architectures = getattr(config, "architectures", None)
    heads = text.num_attention_heads
    fingerprint = {
        "architecture": architectures[0] if architectures else type(model).__name__,
        "name_or_path": getattr(config, "_name_or_path", None) or None,
        "model_type": text.model_type,
        "num_hidden_layers": text.num_hidden_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(text, "num_key_value_heads", None) or heads,
        "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads,
        "hidden_size": text.hidden_size,
        "layer_types": getattr(text, "layer_types", None),
        "sliding_window": getattr(text, "sliding_window", None),
        "rope_parameters": _rope_parameters(text),
        "tokenizer_hash": None if tokenizer is None else tokenizer_hash(tokenizer),
    }
    return json.loads(json.dumps(fingerprint, default=str))


def _rope_parameters(config: Any) -> dict[str, Any] | None:
    """``config.rope_parameters`` (transformers 5.x), else the older ``rope_theta`` / ``rope_scaling`` fields."""
    parameters = getattr(config, "rope_parameters", None)
    if parameters is not None:
        return parameters
    legacy = {name: getattr(config, name, None) for name in ("rope_theta", "rope_scaling")}
    return {name: value for name, value in legacy.items() if value is not None} or None


def check_same_model(saved: dict[str, Any], current: dict[str, Any], what: str = "cache") -> None:
    """The model-structure fields of the ``what``'s fingerprint equal the model's; names the first that differs."""
    for field in STRUCTURE_FIELDS:
        if saved[field] != current[field]:
            raise ValueError(
                f"this {what} was built for another model: {field} is {saved[field]!r} in the {what}'s fingerprint "
                f"but {current[field]!r} in the given model ({current['architecture']})"
            )


def check_same_tokenizer(saved: dict[str, Any], tokenizer: PreTrainedTokenizerBase, what: str = "cache") -> None:
    """The tokenizer's vocabulary hash equals the one in the ``what``'s fingerprint ``saved``."""
    expected = saved.get("tokenizer_hash")
    if expected is None:
        raise ValueError(
            f"this {what}'s fingerprint has no tokenizer hash, so tokenizer= cannot be checked: load without it, or "
            f"save the {what} with model_fingerprint(model, tokenizer)"
        )
    actual = tokenizer_hash(tokenizer)
    if actual != expected:
        raise ValueError(
            f"tokenizer mismatch: the {what} was built with a tokenizer whose vocabulary hash is {expected[:16]}..., "
            f"the given tokenizer's is {actual[:16]}..."
        )


# ---------------------------------------------------------------------------------------------------- files
def resolve_folder(
    path_or_repo_id: str | os.PathLike, files: tuple[str, ...], *, revision: str | None = None, token: str | None = None
) -> Path:
    """The local folder ``path_or_repo_id``, else a snapshot of that Hub repository holding only ``files``.

    Raises:
        ValueError: ``path_or_repo_id`` is neither an existing folder nor a valid Hub repository id.
    """
    if Path(path_or_repo_id).is_dir():
        return Path(path_or_repo_id)
    repo_id = str(path_or_repo_id)
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ValueError(f"{repo_id!r} is neither an existing folder nor a Hub repository id") from None
    return Path(
        huggingface_hub.snapshot_download(
            repo_id,
            revision=revision,
            token=token,
            allow_patterns=list(files),
            library_name="hf_structkv",
            library_version=__version__,
        )
    )


def read_json_object(folder: Path, name: str, what: str) -> dict[str, Any]:
    """Parse ``folder / name``, the JSON object of a saved ``what`` (named in the errors).

    Raises:
        ValueError: the file is missing, is not UTF-8 JSON, or holds something other than an object.
    """
    path = folder / name
    if not path.is_file():
        raise ValueError(f"{folder} is not a saved {what}: {name} is missing")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def replace_file(path: Path, write: Callable[[Path], Any]) -> None:
    """Write ``path`` through ``write(tmp)`` on a temporary file beside it, then rename it into place (with the
    permissions a plain ``open`` would give, not ``mkstemp``'s owner-only 0600)."""
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_file(path: Path, text: str) -> None:
    """`replace_file` for a UTF-8 text file."""
    replace_file(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


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
        path = Path(path_or_repo_id)
        if path.is_file():
            return cls._from_folder(path, model=model, tokenizer=tokenizer)
        folder = resolve_folder(path_or_repo_id, cls.SAVED_FILES, revision=revision, token=token)
        return cls._from_folder(folder, model=model, tokenizer=tokenizer)

    @classmethod
    def load(cls, path_or_repo_id: str | os.PathLike, **kwargs: Any):
        """`from_pretrained` under its 0.1 name."""
        return cls.from_pretrained(path_or_repo_id, **kwargs)

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write the artifact's files and its model card ``README.md`` into ``save_directory`` (each file written to a
        temporary name and renamed into place)."""
        self._write_folder(Path(save_directory), repo_id=None)

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
