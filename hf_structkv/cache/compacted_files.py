"""A `CompactedCache` on disk and on the Hub: safetensors + JSON files and a model card.

A saved cache is a folder (or a Hub repository) of three files; loading reads JSON and safetensors only, so it never
executes code:

* ``cache.safetensors``: the context tensors only (never appended tokens). For a compacted layer ``i``:
  ``layers.{i}.keys`` ``[N, D]``, ``layers.{i}.values`` ``[N, D_v]`` (cache dtype), ``layers.{i}.bias`` ``[N]`` FP32,
  ``layers.{i}.offsets`` ``[H_kv + 1]`` int64 (with INT4 heads, format 2: keys and values hold the other heads'
  rows only, followed by ``layers.{i}.key_codes`` / ``key_scales`` / ``key_offsets`` / ``value_codes`` /
  ``value_scales``, see `compacted_checks.INT4_SUFFIXES`); for a sliding-window layer:
  ``layers.{i}.window_keys`` ``[1, H_kv, w, D]``
  and ``layers.{i}.window_values`` ``[1, H_kv, w, D_v]``.
* ``config.json``: ``format_version``, ``hf_structkv_version``, ``original_length``, ``dtype``, ``layers`` (one
  description per layer: ``{"type": "compacted", "head_lengths": [...]}`` (with INT4 heads also ``"head_storage":
  ["int4", "bf16", ...]`` and ``"key_group": g | null``) or ``{"type": "sliding",
  "sliding_window": w}``), ``context_nbytes`` / ``full_kv_nbytes``, ``tensors_sha256`` (the SHA-256 of
  ``cache.safetensors``: a folder holding one save's config and another's tensors is refused, whoever wrote it;
  caches saved by 0.1 lack it), and every key of ``cache.metadata`` (the model
  fingerprint under ``fingerprint``; by convention also ``method``, ``hyperparameters``, ``calibration``,
  ``quality`` and ``base_model``).
* ``README.md``: a model card rendered from ``model_cards/compacted_cache.md``.

The functions here work on a cache's layers and metadata; `CompactedCache` (a `persistence.SavedArtifact`) calls them
from its ``from_pretrained``, ``save_pretrained`` and ``push_to_hub``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from ..attention.compacted_inputs import QuantizedHeads
from ..persistence import (
    CARD_NAME,
    base_model,
    card_front_matter,
    check_same_model,
    check_same_tokenizer,
    human_bytes,
    markdown_items,
    model_fingerprint,
    ratio_text,
    read_json_object,
    regular_file_size,
    render_card,
    replace_file,
    write_text_file,
)
from ..validation import is_int
from ..version import __version__
from .compacted_checks import (
    CONFIG_NAME,
    FIRST_FORMAT_VERSION,
    FORMAT_VERSION,
    TENSORS_NAME,
    check_cache_format_version,
    tensor_suffixes,
    validate_cache_files,
)
from .compacted_layers import CompactedLayer, SharedContextSlidingLayer

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "CACHE_FILES",
    "CONFIG_NAME",
    "TENSORS_NAME",
    "check_config_is_a_cache",
    "read_cache_folder",
    "render_model_card",
    "write_cache_folder",
]

CACHE_FILES = (CONFIG_NAME, TENSORS_NAME, CARD_NAME)
# config.json keys written by this module; every other key comes from (and goes back to) ``cache.metadata``.
FORMAT_KEYS = frozenset(
    {
        "format_version",
        "hf_structkv_version",
        "original_length",
        "dtype",
        "layers",
        "context_nbytes",
        "full_kv_nbytes",
        "tensors_sha256",
    }
)
MAX_HEADER_BYTES = 100_000_000
"""The largest safetensors header read (the limit the safetensors library itself enforces)."""
_CARD_KNOWN_KEYS = ("fingerprint", "base_model", "method", "hyperparameters", "calibration", "quality")

CacheLayer = CompactedLayer | SharedContextSlidingLayer


# ---------------------------------------------------------------------------------------------------- saving
def write_cache_folder(
    layers: Sequence[CacheLayer], metadata: dict[str, Any], directory: Path, repo_id: str | None = None
) -> None:
    """Write ``cache.safetensors``, ``config.json`` and ``README.md`` of a cache's ``layers`` and ``metadata``.

    The cache is validated exactly as loading would validate it, so a saved folder always loads. ``config.json``
    records the SHA-256 of the tensors file it belongs to. Each file is written to a temporary name and renamed into
    place, and ``config.json`` (which makes the folder a cache) is removed first and written last: a crash leaves the
    old cache, the new one, or a folder that loading rejects, never a mix (`SavedArtifact.save_pretrained` holds
    the folder's lock around it). The model card's usage snippet names ``repo_id`` when given.

    Raises:
        ValueError: ``metadata`` has no ``fingerprint``, uses a key reserved by the file format, is not
            JSON-serialisable, or the tensors are inconsistent (mixed dtypes, NaN, a layer that does not fit the
            fingerprint); ``directory`` holds a ``config.json`` that is not a compacted cache's (a model's, or head
            budgets saved by 0.1).
    """
    config = cache_config(layers, metadata)
    tensors = _cache_tensors(layers)
    validate_cache_files(config, tensors)
    data = save(tensors, metadata={"format": "pt"})
    config["tensors_sha256"] = hashlib.sha256(data).hexdigest()
    directory.mkdir(parents=True, exist_ok=True)
    check_config_is_a_cache(directory)
    (directory / CONFIG_NAME).unlink(missing_ok=True)
    replace_file(directory / TENSORS_NAME, lambda tmp: tmp.write_bytes(data))
    write_text_file(directory / CARD_NAME, render_model_card(config, repo_id=repo_id))
    write_text_file(directory / CONFIG_NAME, json.dumps(config, indent=2, sort_keys=True, allow_nan=False) + "\n")


def check_config_is_a_cache(directory: Path) -> None:
    """A ``config.json`` already in ``directory`` is a compacted cache's (one with ``layers`` and
    ``original_length``), so a save never overwrites a model's configuration or 0.1 head budgets."""
    if not (directory / CONFIG_NAME).exists():
        return
    try:
        existing = read_json_object(directory, CONFIG_NAME, "compacted cache")
    except ValueError:
        existing = None
    if existing is None or not {"layers", "original_length"} <= existing.keys():
        raise ValueError(
            f"{directory / CONFIG_NAME} is not a compacted cache's configuration (a model's, or other hf_structkv "
            "files?); saving a cache there would overwrite it: save the cache into a folder of its own"
        )


def cache_config(layers: Sequence[CacheLayer], metadata: dict[str, Any]) -> dict[str, Any]:
    """The ``config.json`` content of a cache (JSON-normalised: what loading will read back)."""
    metadata = dict(metadata)
    if not isinstance(metadata.get("fingerprint"), dict):
        raise ValueError(
            "cache.metadata has no model fingerprint, so a loaded cache could not be checked against its model: "
            'build the cache with metadata={"fingerprint": model_fingerprint(model, tokenizer), ...} '
            "(from hf_structkv.persistence import model_fingerprint)"
        )
    clash = sorted(FORMAT_KEYS & metadata.keys())
    if clash:
        raise ValueError(f"cache.metadata uses keys reserved by the file format: {clash}; rename them")
    context_only = [layer.fresh_copy() for layer in layers]  # the same context tensors, nothing appended
    quantized = any(getattr(layer, "quantized", None) is not None for layer in layers)
    config = {
        "format_version": FORMAT_VERSION if quantized else FIRST_FORMAT_VERSION,
        "hf_structkv_version": __version__,
        "original_length": layers[0].original_length,
        "dtype": _cache_dtype(layers),
        "layers": [_describe_layer(layer) for layer in layers],
        "context_nbytes": sum(layer.nbytes() for layer in context_only),
        "full_kv_nbytes": sum(layer.full_nbytes() for layer in context_only),
        **metadata,
    }
    try:
        return json.loads(json.dumps(config, allow_nan=False))
    except (TypeError, ValueError) as err:
        raise ValueError(f"cache.metadata must be JSON-serialisable (no tensors, no NaN): {err}") from None


def _cache_dtype(layers: Sequence[CacheLayer]) -> str:
    """The one dtype of every layer's context keys and values, as a name (``"bfloat16"``)."""
    dtypes = {t.dtype for layer in layers for t in layer.context_tensors()[:2]}
    if len(dtypes) != 1:
        raise ValueError(f"the cache's context keys and values must share one dtype, got {sorted(map(str, dtypes))}")
    return str(dtypes.pop()).removeprefix("torch.")


def _layer_kind(layer: CacheLayer) -> str:
    """``"compacted"`` or ``"sliding"``: the layer's ``type`` in ``config.json``."""
    if isinstance(layer, CompactedLayer):
        return "compacted"
    if isinstance(layer, SharedContextSlidingLayer):
        return "sliding"
    raise TypeError(
        f"cannot save a {type(layer).__name__}: a CompactedCache holds CompactedLayer and SharedContextSlidingLayer "
        "layers"
    )


def _describe_layer(layer: CacheLayer) -> dict[str, Any]:
    """The ``config.json`` description of one layer."""
    if _layer_kind(layer) == "compacted" and layer.quantized is not None:
        storage = {"head_storage": layer.head_storage(), "key_group": layer.quantized.key_group}
        return {"type": "compacted", "head_lengths": layer.head_lengths(), **storage}
    if _layer_kind(layer) == "compacted":
        return {"type": "compacted", "head_lengths": layer.head_lengths()}
    return {"type": "sliding", "sliding_window": int(layer.sliding_window)}


def _cache_tensors(layers: Sequence[CacheLayer]) -> dict[str, torch.Tensor]:
    """The context tensors of every layer, on CPU, under their file names (``layers.{i}.keys``, ...)."""
    tensors = {}
    for i, layer in enumerate(layers):
        suffixes = tensor_suffixes(_describe_layer(layer))
        for suffix, tensor in zip(suffixes, layer.context_tensors(), strict=True):
            tensors[f"layers.{i}.{suffix}"] = tensor.detach().to("cpu").contiguous()
    return tensors


# ---------------------------------------------------------------------------------------------------- loading
def read_cache_folder(
    folder: Path,
    *,
    model: PreTrainedModel | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> tuple[list[CacheLayer], dict[str, Any]]:
    """The layers and metadata of a cache saved by `write_cache_folder` into ``folder`` (a local folder, or a Hub
    snapshot that `persistence.resolve_folder` made).

    Reads ``config.json`` and ``cache.safetensors`` only (JSON + safetensors: no code runs) and validates them. With
    ``model``: checks the fingerprint and moves the tensors to ``model.device``. With ``tokenizer``: checks its
    vocabulary hash.

    Raises:
        ValueError: naming the problem: not a folder, a missing file, a truncated or corrupt ``cache.safetensors``,
            an unknown ``format_version``, tensors that do not match ``config.json``, NaN / inf values, or a model /
            tokenizer that is not the one the cache was built with.
    """
    if not folder.is_dir():
        raise ValueError(f"{folder} is a file: a compacted cache is loaded from its folder (or a Hub repository id)")
    config = read_json_object(folder, CONFIG_NAME, "compacted cache")
    check_cache_format_version(config.get("format_version"))  # a newer format may size others
    data = _read_tensors_file(folder, config)
    tensors = _parse_tensors(folder / TENSORS_NAME, data)
    validate_cache_files(config, tensors)
    _check_tensors_belong_to_config(config, data)
    del data
    if model is not None:
        check_same_model(config["fingerprint"], model_fingerprint(model))
    if tokenizer is not None:
        check_same_tokenizer(config["fingerprint"], tokenizer)
    if model is not None:
        tensors = {name: tensor.to(model.device) for name, tensor in tensors.items()}
    metadata = {key: value for key, value in config.items() if key not in FORMAT_KEYS}
    return _build_layers(config, tensors), metadata


def _read_tensors_file(folder: Path, config: dict[str, Any]) -> bytes:
    """The bytes of ``cache.safetensors``, read into memory: the loaded tensors are the process's own, so truncating
    or rewriting the file after loading changes nothing served (no memory map, no SIGBUS), and the bytes checked are
    the bytes used. Before reading, the file must be a regular file no larger than the tensors ``context_nbytes``
    records plus a safetensors header (`MAX_HEADER_BYTES`), so an endless device or an edited size never fills
    memory."""
    path = folder / TENSORS_NAME
    nbytes = config.get("context_nbytes")
    if not is_int(nbytes) or nbytes < 0:
        raise ValueError(f"context_nbytes in {CONFIG_NAME} is {nbytes!r}, not the byte count of the cache's tensors")
    try:
        regular_file_size(path, 8 + MAX_HEADER_BYTES + nbytes, f"a compacted cache ({CONFIG_NAME}'s context_nbytes)")
        return path.read_bytes()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        raise ValueError(f"{folder} is not a complete compacted cache: {TENSORS_NAME} is missing") from None
    except OSError as err:
        raise ValueError(f"{path} cannot be read ({err.strerror or err})") from None


def _parse_tensors(path: Path, data: bytes) -> dict[str, torch.Tensor]:
    """The CPU tensors in the safetensors ``data`` (copied out of it, so they own their memory)."""
    try:
        return load(data)
    except SafetensorError as err:
        raise ValueError(f"{path} is truncated or corrupt ({err}); download or save it again") from None


def _check_tensors_belong_to_config(config: dict[str, Any], data: bytes) -> None:
    """``cache.safetensors`` is the file ``config.json`` was saved with (its SHA-256 recorded as ``tensors_sha256``;
    caches saved by 0.1 have none to check)."""
    expected = config.get("tensors_sha256")
    if expected is not None and hashlib.sha256(data).hexdigest() != expected:
        raise ValueError(
            f"{TENSORS_NAME} is not the file {CONFIG_NAME} was saved with (its SHA-256 differs from tensors_sha256): "
            "the folder holds parts of two saves (written at once without hf_structkv's lock, or copied by hand); "
            "save or download the cache again"
        )


def _build_layers(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> list[CacheLayer]:
    """The cache layers described by a validated ``config.json`` and its tensors."""
    length = config["original_length"]
    layers: list[CacheLayer] = []
    for i, desc in enumerate(config["layers"]):
        parts = [tensors[f"layers.{i}.{suffix}"] for suffix in tensor_suffixes(desc)]
        if desc["type"] == "compacted" and "head_storage" in desc:
            int4_heads = [kind == "int4" for kind in desc["head_storage"]]
            quantized = QuantizedHeads.build(tuple(parts[4:]), int4_heads, desc["key_group"], desc["head_lengths"])
            layers.append(CompactedLayer(*parts[:4], length, quantized))
        elif desc["type"] == "compacted":
            layers.append(CompactedLayer(*parts, length))
        else:
            layers.append(SharedContextSlidingLayer(desc["sliding_window"], *parts, length))
    return layers


# ---------------------------------------------------------------------------------------------------- model card
def render_model_card(cache_config: dict[str, Any], repo_id: str | None = None) -> str:
    """The ``README.md`` of a saved cache, from the ``model_cards/compacted_cache.md`` template.

    Args:
        cache_config: the ``config.json`` content (as `write_cache_folder` writes it).
        repo_id: the repository the usage snippet loads from (a placeholder when ``None``).
    """
    metadata = {key: value for key, value in cache_config.items() if key not in FORMAT_KEYS}
    fingerprint = metadata.get("fingerprint") or {}
    base = base_model(metadata)
    layers = cache_config["layers"]
    compacted = [desc for desc in layers if desc["type"] == "compacted"]
    kept = sum(sum(desc["head_lengths"]) for desc in compacted)
    full = sum(cache_config["original_length"] * len(desc["head_lengths"]) for desc in compacted)
    nbytes, full_nbytes = cache_config["context_nbytes"], cache_config["full_kv_nbytes"]
    others = {key: value for key, value in metadata.items() if key not in _CARD_KNOWN_KEYS}
    return render_card(
        "compacted_cache.md",
        front_matter=card_front_matter(["compacted-kv-cache"], base),
        model_name=base or fingerprint.get("architecture", "unknown model"),
        base_model=base or "<base model id>",
        repo_id=repo_id or "<this repository id or local folder>",
        original_length=cache_config["original_length"],
        kept_entries=f"{kept:,}",
        full_entries=f"{full:,}",
        entry_ratio=ratio_text(kept, full),
        nbytes=human_bytes(nbytes),
        full_nbytes=human_bytes(full_nbytes),
        byte_ratio=ratio_text(nbytes, full_nbytes),
        num_compacted=len(compacted),
        num_sliding=len(layers) - len(compacted),
        dtype=cache_config["dtype"],
        storage=_storage_text(compacted, cache_config["dtype"]),
        method=metadata.get("method", "not recorded"),
        hyperparameters=markdown_items(metadata.get("hyperparameters")),
        calibration=markdown_items(metadata.get("calibration")),
        quality=markdown_items(metadata.get("quality")),
        other_metadata=f"```json\n{json.dumps(others, indent=2, sort_keys=True)}\n```" if others else "none",
        fingerprint=json.dumps(fingerprint, indent=2, sort_keys=True),
        hf_structkv_version=cache_config["hf_structkv_version"],
        format_version=cache_config["format_version"],
    )


def _storage_text(compacted: list[dict[str, Any]], dtype: str) -> str:
    """How the compacted layers' KV heads are stored, for the card (INT4 heads counted, with their key groups)."""
    storages = [kind for desc in compacted for kind in desc.get("head_storage", ["bf16"] * len(desc["head_lengths"]))]
    int4 = storages.count("int4")
    if int4 == 0:
        return f"every KV head in {dtype}"
    groups = sorted({str(desc["key_group"] or "one per head") for desc in compacted if "head_storage" in desc})
    return (
        f"{int4} of {len(storages)} KV heads in INT4 (packed codes; keys with FP16 scales and offsets per channel, "
        f"key groups: {', '.join(groups)}; values with an FP16 scale per row), the others in {dtype}"
    )
