"""Checks of a saved `CompactedCache`'s ``config.json`` and ``cache.safetensors`` against each other and against the
model structure recorded in its fingerprint (`compacted_files` runs them before every save and after every load).

Beyond shapes and dtypes, the stored numbers must be servable: every key and value within `value_limit` and every
bias within `BIAS_LIMIT` (finite is not enough: a key of 3e38 is finite, but its attention scores are not), and the
recorded sizes (``context_nbytes``, ``full_kv_nbytes``) must be what the tensors and ``original_length`` give, so an
edited ``original_length`` is refused rather than served at the wrong positions.

Format 2 adds compacted layers with INT4 heads (``head_storage`` and ``key_group`` in the layer's description, five
more tensors: `INT4_SUFFIXES`); a cache without them is written as format 1, which every hf_structkv reads, and both
formats load.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from ..attention.compacted_inputs import key_groups
from ..persistence import check_fingerprint, check_format_version
from ..validation import is_int

__all__ = [
    "BIAS_LIMIT",
    "CONFIG_NAME",
    "DTYPES",
    "FORMAT_VERSION",
    "TENSORS_NAME",
    "INT4_SUFFIXES",
    "TENSOR_SUFFIXES",
    "check_cache_format_version",
    "tensor_suffixes",
    "validate_cache_files",
    "value_limit",
]

FORMAT_VERSION = 2
"""The newest format written and read (2: INT4 heads); format 1 files (no INT4 head) load as well."""
FIRST_FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
TENSORS_NAME = "cache.safetensors"
DTYPES = {name: getattr(torch, name) for name in ("float64", "float32", "float16", "bfloat16")}
# The tensors of one layer, by the layer's ``type`` in config.json, in the order of ``layer.context_tensors()``.
TENSOR_SUFFIXES = {
    "compacted": ("keys", "values", "bias", "offsets"),
    "sliding": ("window_keys", "window_values"),
}
INT4_SUFFIXES = ("key_codes", "key_scales", "key_offsets", "value_codes", "value_scales")
"""The tensors a compacted layer with INT4 heads adds after its ``keys, values, bias, offsets`` (`QuantizedHeads`):
key codes ``[M, ceil(D / 2)]`` uint8, key scales and key offsets ``[G, D]`` fp16, value codes ``[M, ceil(D_v / 2)]``
uint8, value scales ``[M, 1]`` fp16 (``M``: entries of the INT4 heads, ``G``: their groups of ``key_group``)."""
STORAGES = ("bf16", "int4")
FP32_MAX = torch.finfo(torch.float32).max
BIAS_LIMIT = math.log(FP32_MAX)
"""The largest ``|bias|`` stored (~88.72): a bias is the log of an attention multiplier, and ``e^bias`` beyond it
is not a float32 number (KV-Surgeon's refit keeps ``|bias| <= bias_bound``, 3 by default)."""
_SHA256 = re.compile(r"[0-9a-f]{64}")


def value_limit(head_dim: int) -> float:
    """The largest ``|x|`` of a stored key or value of a model with ``head_dim``: ``sqrt(FP32_MAX / sqrt(D))``.

    The attention function forms the scores ``q·k / sqrt(D)`` in float32; with ``|q_i|, |k_i| <= B`` a score is at
    most ``D B^2 / sqrt(D)``, finite exactly when ``B <= sqrt(FP32_MAX / sqrt(D))`` (~6.5e18 for D = 64, far above
    any real key). Values share the bound: the attention output is their convex combination and the input of the
    output projection, so it must keep the same headroom.
    """
    return math.sqrt(FP32_MAX / math.sqrt(head_dim))


def check_cache_format_version(value: Any) -> None:
    """``format_version`` is 1 or `FORMAT_VERSION` (ValueError naming the file otherwise)."""
    if not (is_int(value) and value == FIRST_FORMAT_VERSION):
        check_format_version(value, FORMAT_VERSION, CONFIG_NAME)


def tensor_suffixes(desc: dict[str, Any]) -> tuple[str, ...]:
    """The tensor names of a (checked) layer description, in the order of ``layer.context_tensors()``."""
    return TENSOR_SUFFIXES[desc["type"]] + (INT4_SUFFIXES if "head_storage" in desc else ())


def validate_cache_files(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Check ``config.json`` and the tensors against each other and against the fingerprint's model structure."""
    _check_config(config)
    layers, fingerprint = config["layers"], config["fingerprint"]
    expected = {f"layers.{i}.{suffix}" for i, desc in enumerate(layers) for suffix in tensor_suffixes(desc)}
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
    dtype = DTYPES[config["dtype"]]
    for i, desc in enumerate(layers):
        _check_layer_kind(i, desc["type"], fingerprint["layer_types"])
        if desc["type"] == "compacted":
            _check_compacted_layer(i, desc, tensors, dtype, fingerprint)
        else:
            _check_sliding_layer(i, desc, tensors, dtype, config["original_length"], fingerprint)
    _check_magnitudes(tensors, fingerprint["head_dim"])
    _check_sizes(config, tensors)


def _check_magnitudes(tensors: dict[str, torch.Tensor], head_dim: int) -> None:
    """Every float tensor finite, biases within `BIAS_LIMIT`, keys and values within `value_limit`."""
    for name in sorted(tensors):
        tensor = tensors[name]
        if not tensor.is_floating_point():
            continue
        if not torch.isfinite(tensor).all():
            bad = int((~torch.isfinite(tensor)).sum())
            raise ValueError(f"tensor {name} holds NaN or infinite values ({bad} entries)")
        limit = BIAS_LIMIT if name.endswith(".bias") else value_limit(head_dim)
        peak = float(tensor.abs().max()) if tensor.numel() else 0.0
        if peak > limit:
            raise ValueError(
                f"tensor {name} holds |x| = {peak:.4g}, above the {limit:.4g} its attention scores can be served with "
                "in float32 (see hf_structkv.cache.compacted_checks.value_limit): the cache is corrupt"
            )


def _check_sizes(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """``context_nbytes`` is the tensors' bytes and ``full_kv_nbytes`` the bytes of ``original_length`` tokens in
    every layer (a compacted layer's ``T * H_kv * (D + D_v)`` elements, a sliding layer's window as stored)."""
    context = sum(t.numel() * t.element_size() for t in tensors.values())
    full = 0
    for i, desc in enumerate(config["layers"]):
        prefix = f"layers.{i}."
        if desc["type"] == "compacted":
            keys, values = tensors[prefix + "keys"], tensors[prefix + "values"]
            width = keys.shape[-1] + values.shape[-1]
            full += config["original_length"] * len(desc["head_lengths"]) * width * keys.element_size()
        else:
            full += sum(
                t.numel() * t.element_size()
                for t in (tensors[prefix + "window_keys"], tensors[prefix + "window_values"])
            )
    for name, expected in (("context_nbytes", context), ("full_kv_nbytes", full)):
        if config.get(name) != expected or not is_int(config.get(name)):
            raise ValueError(
                f"{name} in {CONFIG_NAME} is {config.get(name)!r} but the tensors and original_length "
                f"({config['original_length']}) give {expected}: {CONFIG_NAME} was edited or belongs to another cache"
            )


def _check_config(config: dict[str, Any]) -> None:
    """Check the format fields of ``config.json`` (version first: a newer format may change the others; the
    fingerprint next: it sizes everything else)."""
    check_cache_format_version(config.get("format_version"))
    check_fingerprint(config.get("fingerprint"), f"the fingerprint in {CONFIG_NAME}")
    length = config.get("original_length")
    if not is_int(length) or length < 1:
        raise ValueError(f"original_length in {CONFIG_NAME} must be a positive integer, got {length!r}")
    if not isinstance(config.get("dtype"), str) or config["dtype"] not in DTYPES:
        raise ValueError(f"dtype in {CONFIG_NAME} must be one of {sorted(DTYPES)}, got {config.get('dtype')!r}")
    digest = config.get("tensors_sha256")
    if digest is not None and (not isinstance(digest, str) or not _SHA256.fullmatch(digest)):
        raise ValueError(f"tensors_sha256 in {CONFIG_NAME} must be 64 lowercase hex digits, got {digest!r}")
    layers = config.get("layers")
    if not isinstance(layers, list) or not layers:
        raise ValueError(f"layers in {CONFIG_NAME} must be a non-empty list of layer descriptions")
    for i, desc in enumerate(layers):
        _check_layer_description(i, desc, length)
        if "head_storage" in desc and config["format_version"] == FIRST_FORMAT_VERSION:
            raise ValueError(
                f"layers[{i}].head_storage in {CONFIG_NAME} needs format_version {FORMAT_VERSION} (INT4 heads), but "
                f"the file says format_version {FIRST_FORMAT_VERSION}: it was edited"
            )


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
        if "head_storage" in desc or "key_group" in desc:
            _check_int4_description(i, desc)
    elif kind == "sliding":
        window = desc.get("sliding_window")
        if not is_int(window) or window < 2:
            raise ValueError(f"layers[{i}].sliding_window in {CONFIG_NAME} must be an integer >= 2, got {window!r}")
    else:
        raise ValueError(f"layers[{i}] in {CONFIG_NAME} must have type 'compacted' or 'sliding', got {desc!r}")


def _check_int4_description(i: int, desc: dict[str, Any]) -> None:
    """A compacted layer with INT4 heads: ``head_storage`` one of `STORAGES` per KV head, ``key_group`` null or an
    integer >= 1."""
    storage, group = desc.get("head_storage"), desc.get("key_group")
    if not isinstance(storage, list) or len(storage) != len(desc["head_lengths"]):
        raise ValueError(
            f"layers[{i}].head_storage in {CONFIG_NAME} must list one storage per KV head "
            f"({len(desc['head_lengths'])}), got {storage!r}"
        )
    if any(not isinstance(kind, str) or kind not in STORAGES for kind in storage):
        raise ValueError(f"layers[{i}].head_storage in {CONFIG_NAME} must hold only {list(STORAGES)}, got {storage!r}")
    if "key_group" not in desc or (group is not None and (not is_int(group) or group < 1)):
        raise ValueError(
            f"layers[{i}].key_group in {CONFIG_NAME} must be null (one row of key scales per head) or an integer "
            f">= 1, got {group!r}"
        )


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
    int4_heads = [kind == "int4" for kind in desc.get("head_storage", ["bf16"] * len(lengths))]
    dim, rows = fingerprint["head_dim"], expected[-1]
    plain_rows = sum(n for n, is_int4 in zip(lengths, int4_heads) if not is_int4)
    sizes = f"layers[{i}].head_lengths" + (", head_storage and key_group" if "head_storage" in desc else "")
    _check_tensor(prefix + "keys", tensors[prefix + "keys"], (plain_rows, dim), dtype, sizes)
    _check_tensor(prefix + "values", tensors[prefix + "values"], (plain_rows, None), dtype, sizes)
    _check_tensor(prefix + "bias", tensors[prefix + "bias"], (rows,), torch.float32, sizes)
    if "head_storage" in desc:
        value_dim = tensors[prefix + "values"].shape[-1]
        int4_rows = rows - plain_rows
        groups = sum(key_groups(n, desc["key_group"]) for n, is_int4 in zip(lengths, int4_heads) if is_int4)
        for suffix, shape, kind in (
            ("key_codes", (int4_rows, (dim + 1) // 2), torch.uint8),
            ("key_scales", (groups, dim), torch.float16),
            ("key_offsets", (groups, dim), torch.float16),
            ("value_codes", (int4_rows, (value_dim + 1) // 2), torch.uint8),
            ("value_scales", (int4_rows, 1), torch.float16),
        ):
            _check_tensor(prefix + suffix, tensors[prefix + suffix], shape, kind, sizes)


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


def _check_tensor(
    name: str, tensor: torch.Tensor, shape: tuple[int | None, ...], dtype: torch.dtype, sizes: str = ""
) -> None:
    """``tensor`` has ``dtype`` and ``shape`` (``None`` matches any size); ``sizes``: the fields of ``config.json``
    the shape comes from, named by the refusal."""
    if tensor.dtype != dtype:
        raise ValueError(f"tensor {name} has dtype {tensor.dtype}, expected {dtype}")
    if tensor.dim() != len(shape) or any(want is not None and got != want for got, want in zip(tensor.shape, shape)):
        wanted, source = tuple("*" if n is None else n for n in shape), f"{sizes} in " if sizes else ""
        raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {wanted} from {source}{CONFIG_NAME}")
