"""Save, load and share `CompactedCache` objects: safetensors + JSON files, model fingerprints, Hub upload, model cards.

A saved cache is a folder (or a Hub repository) of three files; loading reads JSON and safetensors only, so it never
executes code:

* ``cache.safetensors``: the context tensors only (never appended tokens). For a compacted layer ``i``:
  ``layers.{i}.keys`` ``[N, D]``, ``layers.{i}.values`` ``[N, D_v]`` (cache dtype), ``layers.{i}.bias`` ``[N]`` FP32,
  ``layers.{i}.offsets`` ``[H_kv + 1]`` int64; for a sliding-window layer:
  ``layers.{i}.window_keys`` ``[1, H_kv, w, D]``
  and ``layers.{i}.window_values`` ``[1, H_kv, w, D_v]``.
* ``config.json``: ``format_version``, ``hf_structkv_version``, ``original_length``, ``dtype``, ``layers`` (one
  description per layer: ``{"type": "compacted", "head_lengths": [...]}`` or ``{"type": "sliding",
  "sliding_window": w}``), ``context_nbytes`` / ``full_kv_nbytes``, and every key of ``cache.metadata`` (the model
  fingerprint under ``fingerprint``; by convention also ``method``, ``hyperparameters``, ``calibration``,
  ``quality`` and ``base_model``).
* ``README.md``: a model card rendered from ``model_cards/compacted_cache.md``.
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
import torch
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from . import __version__
from .attention.registry import enable
from .cache.compacted_layers import CompactedLayer, SharedContextSlidingLayer
from .validation import is_int

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from .cache.compacted import CompactedCache

__all__ = [
    "load_compacted_cache",
    "model_fingerprint",
    "push_compacted_cache",
    "render_model_card",
    "save_compacted_cache",
    "tokenizer_hash",
]

FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
TENSORS_NAME = "cache.safetensors"
CARD_NAME = "README.md"
CACHE_FILES = (CONFIG_NAME, TENSORS_NAME, CARD_NAME)

# Fingerprint fields that must match between the cache and the model it is served with (in this order, so the first
# difference is the one reported). "architecture" (a class name: LlamaForCausalLM and LlamaModel make the same keys),
# "name_or_path" (a local path or a Hub id) and "tokenizer_hash" (checked only when a tokenizer is given) are not.
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
# config.json keys written by this module; every other key comes from (and goes back to) ``cache.metadata``.
_FORMAT_KEYS = frozenset(
    {"format_version", "hf_structkv_version", "original_length", "dtype", "layers", "context_nbytes", "full_kv_nbytes"}
)
_DTYPES = {name: getattr(torch, name) for name in ("float64", "float32", "float16", "bfloat16")}
_TENSOR_SUFFIXES = {
    "compacted": ("keys", "values", "bias", "offsets"),
    "sliding": ("window_keys", "window_values"),
}
_CARD_KNOWN_KEYS = ("fingerprint", "base_model", "method", "hyperparameters", "calibration", "quality")


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
    """What a compacted cache depends on: the model's attention structure, RoPE and (optionally) tokenizer.

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


# ---------------------------------------------------------------------------------------------------- saving
def save_compacted_cache(cache: CompactedCache, save_directory: str | os.PathLike) -> None:
    """Write ``cache.safetensors``, ``config.json`` and ``README.md`` for ``cache`` into ``save_directory``.

    The cache is validated exactly as ``load`` would validate it, so a saved folder always loads. Each file is written
    to a temporary name and renamed into place, and ``config.json`` (which makes the folder a cache) is removed first
    and written last: a crash leaves the old cache, the new one, or a folder that ``load`` rejects, never a mix.

    Raises:
        ValueError: ``cache.metadata`` has no ``fingerprint``, uses a key reserved by the file format, is not
            JSON-serialisable, or the cache's tensors are inconsistent (mixed dtypes, NaN, a layer that does not fit
            the fingerprint).
    """
    _write_cache_folder(cache, Path(save_directory), repo_id=None)


def _write_cache_folder(cache: CompactedCache, directory: Path, repo_id: str | None) -> None:
    """`save_compacted_cache`, with the model card's usage snippet naming ``repo_id`` when given."""
    config = _cache_config(cache)
    tensors = _cache_tensors(cache)
    _validate(config, tensors)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / CONFIG_NAME).unlink(missing_ok=True)
    _replace_file(directory / TENSORS_NAME, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    card = render_model_card(config, repo_id=repo_id)
    _replace_file(directory / CARD_NAME, lambda tmp: tmp.write_text(card, encoding="utf-8"))
    text = json.dumps(config, indent=2, sort_keys=True, allow_nan=False) + "\n"
    _replace_file(directory / CONFIG_NAME, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _replace_file(path: Path, write: Callable[[Path], Any]) -> None:
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


def _cache_config(cache: CompactedCache) -> dict[str, Any]:
    """The ``config.json`` content of ``cache`` (JSON-normalised: what ``load`` will read back)."""
    metadata = dict(cache.metadata)
    if not isinstance(metadata.get("fingerprint"), dict):
        raise ValueError(
            "cache.metadata has no model fingerprint, so a loaded cache could not be checked against its model: "
            'build the cache with metadata={"fingerprint": model_fingerprint(model, tokenizer), ...} '
            "(from hf_structkv.hub import model_fingerprint)"
        )
    clash = sorted(_FORMAT_KEYS & metadata.keys())
    if clash:
        raise ValueError(f"cache.metadata uses keys reserved by the file format: {clash}; rename them")
    layers = list(cache.layers)
    context_only = cache.copy()  # the same context tensors, nothing appended
    config = {
        "format_version": FORMAT_VERSION,
        "hf_structkv_version": __version__,
        "original_length": cache.original_length,
        "dtype": _cache_dtype(layers),
        "layers": [_describe_layer(layer) for layer in layers],
        "context_nbytes": context_only.nbytes(),
        "full_kv_nbytes": context_only.full_nbytes(),
        **metadata,
    }
    try:
        return json.loads(json.dumps(config, allow_nan=False))
    except (TypeError, ValueError) as err:
        raise ValueError(f"cache.metadata must be JSON-serialisable (no tensors, no NaN): {err}") from None


def _cache_dtype(layers: list[CompactedLayer | SharedContextSlidingLayer]) -> str:
    """The one dtype of every layer's context keys and values, as a name (``"bfloat16"``)."""
    dtypes = {t.dtype for layer in layers for t in layer.context_tensors()[:2]}
    if len(dtypes) != 1:
        raise ValueError(f"the cache's context keys and values must share one dtype, got {sorted(map(str, dtypes))}")
    return str(dtypes.pop()).removeprefix("torch.")


def _layer_kind(layer: CompactedLayer | SharedContextSlidingLayer) -> str:
    """``"compacted"`` or ``"sliding"``: the layer's ``type`` in ``config.json``."""
    if isinstance(layer, CompactedLayer):
        return "compacted"
    if isinstance(layer, SharedContextSlidingLayer):
        return "sliding"
    raise TypeError(
        f"cannot save a {type(layer).__name__}: a CompactedCache holds CompactedLayer and SharedContextSlidingLayer "
        "layers"
    )


def _describe_layer(layer: CompactedLayer | SharedContextSlidingLayer) -> dict[str, Any]:
    """The ``config.json`` description of one layer."""
    if _layer_kind(layer) == "compacted":
        return {"type": "compacted", "head_lengths": layer.head_lengths()}
    return {"type": "sliding", "sliding_window": int(layer.sliding_window)}


def _cache_tensors(cache: CompactedCache) -> dict[str, torch.Tensor]:
    """The context tensors of every layer, on CPU, under their file names (``layers.{i}.keys``, ...)."""
    tensors = {}
    for i, layer in enumerate(cache.layers):
        suffixes = _TENSOR_SUFFIXES[_layer_kind(layer)]
        for suffix, tensor in zip(suffixes, layer.context_tensors(), strict=True):
            tensors[f"layers.{i}.{suffix}"] = tensor.detach().to("cpu").contiguous()
    return tensors


# ---------------------------------------------------------------------------------------------------- loading
def load_compacted_cache(
    cls: type[CompactedCache],
    path_or_repo_id: str | os.PathLike,
    revision: str | None = None,
    model: PreTrainedModel | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    token: str | None = None,
) -> CompactedCache:
    """Load a cache saved by `save_compacted_cache` from a local folder or a Hub repository.

    Reads ``config.json`` and ``cache.safetensors`` only (JSON + safetensors: no code runs) and validates them. With
    ``model``: checks the fingerprint, moves the tensors to ``model.device`` and calls ``enable(model)``. With
    ``tokenizer``: checks its vocabulary hash.

    Args:
        cls: the cache class to build (``CompactedCache``).
        path_or_repo_id: an existing folder, else a Hub repository id (downloaded with ``snapshot_download``).
        revision: Hub branch, tag or commit (ignored for a local folder).
        token: Hub token for private repositories.

    Raises:
        ValueError: naming the problem: a missing file, a truncated or corrupt ``cache.safetensors``, an unknown
            ``format_version``, tensors that do not match ``config.json``, NaN / inf values, or a model / tokenizer
            that is not the one the cache was built with.
    """
    folder = _resolve_folder(path_or_repo_id, revision, token)
    config = _read_config(folder)
    tensors = _read_tensors(folder)
    _validate(config, tensors)
    if model is not None:
        _check_same_model(config["fingerprint"], model_fingerprint(model))
    if tokenizer is not None:
        _check_same_tokenizer(config["fingerprint"], tokenizer)
    if model is not None:
        tensors = {name: tensor.to(model.device) for name, tensor in tensors.items()}
    layers = _build_layers(config, tensors)
    cache = cls(layers, metadata={key: value for key, value in config.items() if key not in _FORMAT_KEYS})
    if model is not None:
        enable(model)
    return cache


def _resolve_folder(
    path_or_repo_id: str | os.PathLike, revision: str | None, token: str | None, files: tuple[str, ...] = CACHE_FILES
) -> Path:
    """The local folder, else a snapshot of the Hub repository holding only ``files`` (by default the cache files)."""
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


def _read_config(folder: Path, name: str = CONFIG_NAME, what: str = "compacted cache") -> dict[str, Any]:
    """Parse ``folder / name`` (``config.json``; a JSON object) of a saved ``what``."""
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


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Load ``cache.safetensors`` on CPU."""
    path = folder / TENSORS_NAME
    if not path.is_file():
        raise ValueError(f"{folder} is not a complete compacted cache: {TENSORS_NAME} is missing")
    try:
        return load_file(path, device="cpu")
    except SafetensorError as err:
        raise ValueError(f"{path} is truncated or corrupt ({err}); download or save it again") from None


def _validate(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Check ``config.json`` and the tensors against each other and against the fingerprint's model structure."""
    _check_config(config)
    layers, fingerprint = config["layers"], config["fingerprint"]
    expected = {f"layers.{i}.{suffix}" for i, desc in enumerate(layers) for suffix in _TENSOR_SUFFIXES[desc["type"]]}
    if expected != tensors.keys():
        raise ValueError(
            f"{TENSORS_NAME} does not hold the tensor names {CONFIG_NAME} describes: missing "
            f"{sorted(expected - tensors.keys())}, unexpected {sorted(tensors.keys() - expected)}"
        )
    if len(layers) != fingerprint["num_hidden_layers"]:
        raise ValueError(
            f"{CONFIG_NAME} describes {len(layers)} layers but its fingerprint's model has "
            f"{fingerprint['num_hidden_layers']}"
        )
    if fingerprint["layer_types"] is not None and len(fingerprint["layer_types"]) != len(layers):
        raise ValueError(f"the fingerprint's layer_types must list one type per layer ({len(layers)})")
    dtype = _DTYPES[config["dtype"]]
    for i, desc in enumerate(layers):
        _check_layer_kind(i, desc["type"], fingerprint["layer_types"])
        if desc["type"] == "compacted":
            _check_compacted_layer(i, desc, tensors, dtype, fingerprint)
        else:
            _check_sliding_layer(i, desc, tensors, dtype, config["original_length"], fingerprint)
    for name in sorted(tensors):
        tensor = tensors[name]
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            bad = int((~torch.isfinite(tensor)).sum())
            raise ValueError(f"tensor {name} holds NaN or infinite values ({bad} entries)")


def _check_config(config: dict[str, Any]) -> None:
    """Check the format fields of ``config.json`` (version first: a newer format may change the others)."""
    version = config.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"unknown format_version {version!r} in {CONFIG_NAME} (this hf_structkv {__version__} reads format "
            f"{FORMAT_VERSION}); a newer hf_structkv may read it"
        )
    length = config.get("original_length")
    if not is_int(length) or length < 1:
        raise ValueError(f"original_length in {CONFIG_NAME} must be a positive integer, got {length!r}")
    if config.get("dtype") not in _DTYPES:
        raise ValueError(f"dtype in {CONFIG_NAME} must be one of {sorted(_DTYPES)}, got {config.get('dtype')!r}")
    layers = config.get("layers")
    if not isinstance(layers, list) or not layers:
        raise ValueError(f"layers in {CONFIG_NAME} must be a non-empty list of layer descriptions")
    for i, desc in enumerate(layers):
        _check_layer_description(i, desc, length)
    fingerprint = config.get("fingerprint")
    if not isinstance(fingerprint, dict):
        raise ValueError(f"{CONFIG_NAME} has no model fingerprint")
    missing = [field for field in STRUCTURE_FIELDS if field not in fingerprint]
    if missing:
        raise ValueError(f"the fingerprint in {CONFIG_NAME} lacks the fields {missing}")


def _check_layer_description(i: int, desc: Any, original_length: int) -> None:
    """One entry of ``layers``: a compacted layer's head lengths, or a sliding layer's window."""
    kind = desc.get("type") if isinstance(desc, dict) else None
    if kind == "compacted":
        lengths = desc.get("head_lengths")
        if (
            not isinstance(lengths, list)
            or not lengths
            or not all(is_int(n) and 0 <= n <= original_length for n in lengths)
        ):
            raise ValueError(
                f"layers[{i}].head_lengths in {CONFIG_NAME} must list one kept-entry count in "
                f"[0, {original_length}] per KV head, got {lengths!r}"
            )
    elif kind == "sliding":
        window = desc.get("sliding_window")
        if not is_int(window) or window < 2:
            raise ValueError(f"layers[{i}].sliding_window in {CONFIG_NAME} must be an integer >= 2, got {window!r}")
    else:
        raise ValueError(f"layers[{i}] in {CONFIG_NAME} must have type 'compacted' or 'sliding', got {desc!r}")


def _check_layer_kind(i: int, kind: str, layer_types: list[str] | None) -> None:
    """A sliding-window layer of the model must be stored as a sliding layer, every other layer as compacted."""
    if layer_types is None:
        return
    expected = "sliding" if "sliding" in layer_types[i] else "compacted"
    if kind != expected:
        raise ValueError(
            f"layer {i} is stored as a {kind} layer but the model's layer {i} is {layer_types[i]!r}: build the cache "
            "from DynamicCache(config=model.config) so that sliding-window layers stay sliding"
        )


def _check_compacted_layer(
    i: int, desc: dict[str, Any], tensors: dict[str, torch.Tensor], dtype: torch.dtype, fingerprint: dict[str, Any]
) -> None:
    """Shapes and dtypes of a compacted layer: keys ``[N, D]``, values ``[N, D_v]``, bias ``[N]`` FP32, offsets
    ``[H_kv + 1]`` int64 equal to the cumulative ``head_lengths`` (so starting at 0 and non-decreasing)."""
    lengths = desc["head_lengths"]
    if len(lengths) != fingerprint["num_key_value_heads"]:
        raise ValueError(
            f"layers[{i}].head_lengths lists {len(lengths)} KV heads but the fingerprint's model has "
            f"{fingerprint['num_key_value_heads']}"
        )
    prefix = f"layers.{i}."
    offsets = tensors[prefix + "offsets"]
    _check_tensor(prefix + "offsets", offsets, (len(lengths) + 1,), torch.int64)
    expected = [0]
    for n in lengths:
        expected.append(expected[-1] + n)
    if offsets.tolist() != expected:
        raise ValueError(
            f"tensor {prefix}offsets is {offsets.tolist()} but layers[{i}].head_lengths {lengths} in {CONFIG_NAME} "
            f"needs {expected} (offsets start at 0 and add each head's kept entries)"
        )
    rows = expected[-1]
    _check_tensor(prefix + "keys", tensors[prefix + "keys"], (rows, fingerprint["head_dim"]), dtype)
    _check_tensor(prefix + "values", tensors[prefix + "values"], (rows, None), dtype)
    _check_tensor(prefix + "bias", tensors[prefix + "bias"], (rows,), torch.float32)


def _check_sliding_layer(
    i: int,
    desc: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    dtype: torch.dtype,
    original_length: int,
    fingerprint: dict[str, Any],
) -> None:
    """Shapes of a sliding layer's window: ``[1, H_kv, w, D]`` keys and ``[1, H_kv, w, D_v]`` values with
    ``w = min(original_length, sliding_window - 1)`` (what transformers' ``DynamicSlidingWindowLayer`` keeps)."""
    prefix = f"layers.{i}."
    window = min(original_length, desc["sliding_window"] - 1)
    heads = fingerprint["num_key_value_heads"]
    _check_tensor(
        prefix + "window_keys", tensors[prefix + "window_keys"], (1, heads, window, fingerprint["head_dim"]), dtype
    )
    _check_tensor(prefix + "window_values", tensors[prefix + "window_values"], (1, heads, window, None), dtype)


def _check_tensor(name: str, tensor: torch.Tensor, shape: tuple[int | None, ...], dtype: torch.dtype) -> None:
    """``tensor`` has ``dtype`` and ``shape`` (``None`` matches any size)."""
    if tensor.dtype != dtype:
        raise ValueError(f"tensor {name} has dtype {tensor.dtype}, expected {dtype}")
    if tensor.dim() != len(shape) or any(want is not None and got != want for got, want in zip(tensor.shape, shape)):
        wanted = tuple("*" if n is None else n for n in shape)
        raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {wanted} from {CONFIG_NAME}")


def _check_same_model(saved: dict[str, Any], current: dict[str, Any], what: str = "cache") -> None:
    """The model-structure fields of the ``what``'s fingerprint equal the model's; names the first that differs."""
    for field in STRUCTURE_FIELDS:
        if saved[field] != current[field]:
            raise ValueError(
                f"this {what} was built for another model: {field} is {saved[field]!r} in the {what}'s fingerprint "
                f"but {current[field]!r} in the given model ({current['architecture']})"
            )


def _check_same_tokenizer(saved: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> None:
    """The tokenizer's vocabulary hash equals the one in the cache's fingerprint."""
    expected = saved.get("tokenizer_hash")
    if expected is None:
        raise ValueError(
            "this cache's fingerprint has no tokenizer hash, so tokenizer= cannot be checked: load without it, or "
            "save the cache with model_fingerprint(model, tokenizer)"
        )
    actual = tokenizer_hash(tokenizer)
    if actual != expected:
        raise ValueError(
            f"tokenizer mismatch: the cache was built with a tokenizer whose vocabulary hash is {expected[:16]}..., "
            f"the given tokenizer's is {actual[:16]}..."
        )


def _build_layers(
    config: dict[str, Any], tensors: dict[str, torch.Tensor]
) -> list[CompactedLayer | SharedContextSlidingLayer]:
    """The cache layers described by a validated ``config.json`` and its tensors."""
    length = config["original_length"]
    layers: list[CompactedLayer | SharedContextSlidingLayer] = []
    for i, desc in enumerate(config["layers"]):
        parts = [tensors[f"layers.{i}.{suffix}"] for suffix in _TENSOR_SUFFIXES[desc["type"]]]
        if desc["type"] == "compacted":
            layers.append(CompactedLayer(*parts, length))
        else:
            layers.append(SharedContextSlidingLayer(desc["sliding_window"], *parts, length))
    return layers


# ---------------------------------------------------------------------------------------------------- Hub
def push_compacted_cache(
    cache: CompactedCache,
    repo_id: str,
    private: bool | None = None,
    token: str | None = None,
    revision: str | None = None,
) -> str:
    """Save ``cache`` (with a model card whose snippet loads ``repo_id``) and upload it to a Hub model repository.

    Creates the repository if needed (``private`` applies only then) and the branch ``revision`` if given.

    Returns:
        The URL of the upload commit.
    """
    return _upload_folder(
        lambda folder: _write_cache_folder(cache, folder, repo_id=repo_id),
        CACHE_FILES,
        f"Upload compacted KV cache ({cache.original_length}-token context) with hf_structkv",
        repo_id,
        private=private,
        token=token,
        revision=revision,
    )


def _upload_folder(
    write: Callable[[Path], Any],
    files: tuple[str, ...],
    commit_message: str,
    repo_id: str,
    private: bool | None,
    token: str | None,
    revision: str | None,
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


# ---------------------------------------------------------------------------------------------------- model card
def render_model_card(cache_config: dict[str, Any], repo_id: str | None = None) -> str:
    """The ``README.md`` of a saved cache, from the ``model_cards/compacted_cache.md`` template.

    Args:
        cache_config: the ``config.json`` content (as written by `save_compacted_cache`).
        repo_id: the repository the usage snippet loads from (a placeholder when ``None``).
    """
    metadata = {key: value for key, value in cache_config.items() if key not in _FORMAT_KEYS}
    fingerprint = metadata.get("fingerprint") or {}
    base_model = _base_model(metadata)
    front_matter = ["library_name: hf_structkv", "tags:", "- hf_structkv", "- kv-cache", "- compacted-kv-cache"]
    if base_model:
        front_matter.append(f"base_model: {json.dumps(base_model)}")
    layers = cache_config["layers"]
    compacted = [desc for desc in layers if desc["type"] == "compacted"]
    kept = sum(sum(desc["head_lengths"]) for desc in compacted)
    full = sum(cache_config["original_length"] * len(desc["head_lengths"]) for desc in compacted)
    nbytes, full_nbytes = cache_config["context_nbytes"], cache_config["full_kv_nbytes"]
    others = {key: value for key, value in metadata.items() if key not in _CARD_KNOWN_KEYS}
    template = (importlib.resources.files("hf_structkv.model_cards") / "compacted_cache.md").read_text(encoding="utf-8")
    return string.Template(template).substitute(
        front_matter="\n".join(front_matter),
        model_name=base_model or fingerprint.get("architecture", "unknown model"),
        base_model=base_model or "<base model id>",
        repo_id=repo_id or "<this repository id or local folder>",
        original_length=cache_config["original_length"],
        kept_entries=f"{kept:,}",
        full_entries=f"{full:,}",
        entry_ratio=_ratio(kept, full),
        nbytes=_human_bytes(nbytes),
        full_nbytes=_human_bytes(full_nbytes),
        byte_ratio=_ratio(nbytes, full_nbytes),
        num_compacted=len(compacted),
        num_sliding=len(layers) - len(compacted),
        dtype=cache_config["dtype"],
        method=metadata.get("method", "not recorded"),
        hyperparameters=_markdown_items(metadata.get("hyperparameters")),
        calibration=_markdown_items(metadata.get("calibration")),
        quality=_markdown_items(metadata.get("quality")),
        other_metadata=f"```json\n{json.dumps(others, indent=2, sort_keys=True)}\n```" if others else "none",
        fingerprint=json.dumps(fingerprint, indent=2, sort_keys=True),
        hf_structkv_version=cache_config["hf_structkv_version"],
        format_version=cache_config["format_version"],
    )


def _base_model(metadata: dict[str, Any]) -> str | None:
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


def _markdown_items(value: Any) -> str:
    """A dict as a bullet list, anything else as text; "not recorded" when absent."""
    if value is None or value == {}:
        return "not recorded"
    if isinstance(value, dict):
        return "\n".join(
            f"- **{key}**: {json.dumps(item) if not isinstance(item, str) else item}"
            for key, item in sorted(value.items())
        )
    return str(value)


def _ratio(part: int, whole: int) -> str:
    """``part / whole`` as a percentage and a reduction factor."""
    if whole == 0:
        return "n/a"
    factor = f", {whole / part:.1f}x smaller" if part else ""
    return f"{100 * part / whole:.1f}%{factor}"


def _human_bytes(n: int) -> str:
    """``n`` bytes in MiB / KiB with the exact count."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit} ({n:,} bytes)"
    return f"{n:,} bytes"
