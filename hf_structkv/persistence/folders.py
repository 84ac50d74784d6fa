"""The folders of saved artifacts: telling a local path from a Hub repository id, bounded JSON reading, atomic file
writes, the advisory lock that makes a folder's save all-or-nothing, and the rule that one artifact is never saved
over another's files."""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import huggingface_hub
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from ..validation import is_int
from ..version import __version__

try:  # POSIX; elsewhere saves are not serialised between processes (a compacted cache still refuses a mix)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

__all__ = [
    "ARTIFACT_MARKERS",
    "LOCAL_SUFFIXES",
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "check_format_version",
    "check_no_other_artifact",
    "folder_lock",
    "read_json_object",
    "regular_file_size",
    "remove_stale_temporaries",
    "replace_file",
    "resolve_folder",
    "write_text_file",
]

ARTIFACT_MARKERS = {
    "CompactedCache": "cache.safetensors",
    "PolicyTable": "policy_table.json",
    "PrefillPolicy": "prefill_policy.json",
    "HeadBudgets": "head_budgets.json",
}
"""The file that makes a folder a saved artifact of each kind (each in that artifact's ``SAVED_FILES``): a save
refuses a folder holding another kind's marker, so no artifact overwrites another's card or JSON."""
LOCAL_SUFFIXES = (".json", ".safetensors", ".md", ".jsonl")
"""Endings that make a string a file path, never a Hub repository id."""
MAX_JSON_BYTES = 64 * 2**20
"""The largest JSON file a load reads (the biggest shipped policy file is under 100 KiB)."""
MAX_JSON_DEPTH = 64
"""The deepest nesting of objects and lists a loaded JSON file may have (a shipped file nests at most 5 deep)."""
_TEMPORARY = ".{name}.*.tmp"  # the names `replace_file` writes beside ``name``


# ---------------------------------------------------------------------------------------------------- resolving
def resolve_folder(
    path_or_repo_id: str | os.PathLike, files: tuple[str, ...], *, revision: str | None = None, token: str | None = None
) -> Path:
    """The local folder ``path_or_repo_id``, else a snapshot of the Hub repository ``namespace/name`` holding only
    ``files``.

    A string that looks like a local path is never sent to the Hub: an absolute path, one starting with ``.``, ``~``
    or holding a backslash or more than one ``/``, one ending in a file suffix (`LOCAL_SUFFIXES`), one whose first
    component exists here, or one that is not of the form ``namespace/name``.

    Raises:
        ValueError: a local-looking path that does not exist (named, with what exists of it), a string that is
            neither a folder nor a Hub repository id, or a repository that could not be downloaded (the Hub's
            reason, offline mode included).
    """
    path = Path(path_or_repo_id).expanduser()
    if path.is_dir():
        return path
    text = os.fspath(path_or_repo_id)
    reason = _local_reason(text)
    if reason is None:
        try:
            validate_repo_id(text)
        except HFValidationError:
            reason = "it is not a valid Hub repository id"
    if reason is not None:
        raise ValueError(
            f"{text!r} is neither an existing folder nor a Hub repository id: {reason}, and no such file or folder "
            f"exists{_existing_part(path)}"
        )
    try:
        folder = huggingface_hub.snapshot_download(
            text,
            revision=revision,
            token=token,
            allow_patterns=list(files),
            library_name="hf_structkv",
            library_version=__version__,
        )
    except OSError as err:  # the Hub's errors: HTTP errors, offline mode, a missing repository or revision
        raise ValueError(
            f"{text!r} is not a local folder and could not be downloaded from the Hub ({type(err).__name__}: {err}); "
            "check the path or the repository id (and HF_HUB_OFFLINE, the token, the revision)"
        ) from None
    return Path(folder)


def _local_reason(text: str) -> str | None:
    """Why ``text`` is a local path and not a Hub id, or ``None`` when it may be ``namespace/name``."""
    if not text or text.startswith((".", "~", "/")) or os.path.isabs(text):
        return "it is a local path"
    if "\\" in text or (os.sep != "/" and os.sep in text):
        return "it is a local path"
    if text.lower().endswith(LOCAL_SUFFIXES):
        return "it names a file"
    if text.count("/") != 1:
        return "a Hub repository id is namespace/name"
    if Path(text.split("/")[0]).exists():
        return f"its first part {text.split('/')[0]!r} is a local path"
    return None


def _existing_part(path: Path) -> str:
    """``" (the folder X exists; it holds: ...)"`` for the deepest existing ancestor of a missing relative path."""
    for parent in path.parents:
        if str(parent) not in ("", ".") and parent.is_dir():
            names = sorted(p.name for p in parent.iterdir())[:8]
            return f" ({parent} exists and holds {names})"
    return ""


# ---------------------------------------------------------------------------------------------------- reading
def read_json_object(folder: Path, name: str, what: str) -> dict[str, Any]:
    """Parse ``folder / name``, the JSON object of a saved ``what`` (named in the errors).

    The file is bounded before it is parsed (`MAX_JSON_BYTES`) and after (`MAX_JSON_DEPTH`), and an object that
    repeats a key is refused (the later value would silently win).

    Raises:
        ValueError: the file is missing, unreadable, not a regular file (``/dev/zero``, a pipe), too large, not UTF-8
            JSON (``NaN`` and ``Infinity`` included), nested too deeply, repeats a key, holds an integer too long to
            parse, or holds something other than an object.
    """
    path = folder / name
    try:
        size = regular_file_size(path, MAX_JSON_BYTES, f"a saved {what}")
        with open(path, "rb") as file:
            text = file.read(size).decode("utf-8")  # what the file held when checked, never more
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        raise ValueError(f"{folder} is not a saved {what}: {name} is missing") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    except OSError as err:  # unreadable: permissions, a symbolic-link loop
        raise ValueError(f"{path} cannot be read ({err.strerror or err}): not a saved {what}") from None
    try:
        config = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError(f"{path} nests lists or objects too deeply to be a saved {what}") from None
    except ValueError as err:  # JSONDecodeError, a repeated key, an integer longer than Python parses
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    if _depth(config) > MAX_JSON_DEPTH:
        raise ValueError(f"{path} nests lists or objects more than {MAX_JSON_DEPTH} deep: not a saved {what}")
    return config


def regular_file_size(path: Path, limit: int, what: str) -> int:
    """The size of ``path``, a regular file (a link to one is followed) of at most ``limit`` bytes: a device such as
    ``/dev/zero``, a pipe or a folder is refused before anything is read from it.

    Raises:
        FileNotFoundError, OSError: from ``stat`` (a missing or unreadable path).
        ValueError: naming ``path`` and ``what`` it should hold: not a regular file, or larger than ``limit``.
    """
    info = path.stat()
    if stat.S_ISDIR(info.st_mode):
        raise IsADirectoryError(path)
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path} is not a regular file (a device or a pipe?): {what} holds a file there")
    if info.st_size > limit:
        raise ValueError(f"{path} is {info.st_size:,} bytes, more than {what} holds ({limit:,} at most)")
    return info.st_size


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number (a saved file never holds NaN or Infinity)")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise ValueError(f"an object repeats the keys {repeated}")
    return dict(pairs)


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON (a scalar is 0), computed without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth + 1)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def check_format_version(value: Any, supported: int, file_name: str) -> None:
    """``format_version`` is the integer ``supported`` (``true`` and ``1.0`` are not ``1``).

    Raises:
        ValueError: naming the file, the version found and the one this hf_structkv reads.
    """
    if not is_int(value) or value != supported:
        raise ValueError(
            f"unknown format_version {value!r} in {file_name} (this hf_structkv {__version__} reads format "
            f"{supported}, an integer); a newer hf_structkv may read it"
        )


# ---------------------------------------------------------------------------------------------------- writing
def replace_file(path: Path, write: Callable[[Path], Any]) -> None:
    """Write ``path`` through ``write(tmp)`` on a temporary file beside it, then rename it into place (with the
    permissions a plain ``open`` would give, not ``mkstemp``'s owner-only 0600). The temporary file is removed when
    ``write`` raises."""
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


@contextlib.contextmanager
def folder_lock(folder: Path, *, exclusive: bool) -> Iterator[None]:
    """Hold an advisory ``flock`` on the directory ``folder`` itself (no lock file is left behind): exclusive while
    a save writes it, shared while a load reads it. Released by the kernel when the process dies, so a crashed
    save never blocks the next one. Where locking is unavailable (no ``fcntl``, an unreadable folder, a file system
    without ``flock``) it does nothing."""
    if fcntl is None:
        yield
        return
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        except OSError:
            pass  # a file system without flock: the content hash of a compacted cache still refuses a mix
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def remove_stale_temporaries(folder: Path, names: tuple[str, ...]) -> None:
    """Remove the temporary files that a save of ``names`` killed mid-write left in ``folder`` (call it holding the
    exclusive `folder_lock`: no cooperating save is writing them)."""
    for name in names:
        for tmp in folder.glob(_TEMPORARY.format(name=_glob_escape(name))):
            tmp.unlink(missing_ok=True)


def _glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def check_no_other_artifact(folder: Path, own_files: tuple[str, ...], what: str) -> None:
    """Refuse to save the artifact ``what`` (which writes ``own_files``) into a folder that holds another kind of
    saved artifact (`ARTIFACT_MARKERS`).

    Raises:
        ValueError: naming the other artifact, its file and the fix.
    """
    for kind, marker in ARTIFACT_MARKERS.items():
        if marker not in own_files and (folder / marker).exists():
            raise ValueError(
                f"{folder} holds a saved {kind} ({marker}); saving the {what} there would overwrite its files "
                "(README.md at least): save it into a folder of its own"
            )
