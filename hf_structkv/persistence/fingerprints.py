"""Model fingerprints: what a saved artifact depends on (attention structure, RoPE, tokenizer), the sane limits a
loaded fingerprint is held to before anything is sized by it, and the checks that a model or tokenizer is the one
an artifact was built for."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from ..validation import is_int

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "FINGERPRINT_LIMITS",
    "STRUCTURE_FIELDS",
    "check_fingerprint",
    "check_same_model",
    "check_same_tokenizer",
    "config_fingerprint",
    "model_fingerprint",
    "tokenizer_hash",
]

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

FINGERPRINT_LIMITS = {
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 8192,
    "hidden_size": 2**20,
}
"""The largest value a loaded fingerprint may hold in each size field: roughly 8x the largest published decoder
(126 layers, 128 heads, head_dim 256, hidden size 16384). A file is sized by its fingerprint (one budget list per
layer, one cost per head), so these bounds are what keeps a one-number edit from allocating gigabytes."""


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


def config_fingerprint(config: PretrainedConfig) -> dict[str, Any]:
    """The structure part of a fingerprint, from a transformers config (a multimodal one is described by its text
    decoder config): ``name_or_path`` and the `STRUCTURE_FIELDS`, JSON-normalised.

    The attention function reads it from the ``config`` of the attention module it serves, so a cache loaded without
    ``model=`` is still checked against the model at its first forward.
    """
    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    fingerprint = {
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
    }
    return json.loads(json.dumps(fingerprint, default=str))


def model_fingerprint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None = None) -> dict[str, Any]:
    """What a saved artifact depends on: the model's attention structure, RoPE and (optionally) tokenizer.

    Returns a JSON-serialisable dict: ``architecture``, ``name_or_path`` (``None`` when unknown), ``model_type``,
    ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``hidden_size``,
    ``layer_types`` and ``sliding_window`` (``None`` when the config has none), ``rope_parameters`` (transformers
    5.x ``config.rope_parameters``, else ``rope_theta`` / ``rope_scaling``) and ``tokenizer_hash`` (``None``
    without ``tokenizer``). Multimodal models are described by their text (decoder) config.
    """
    architectures = getattr(model.config, "architectures", None)
    return {
        "architecture": architectures[0] if architectures else type(model).__name__,
        **config_fingerprint(model.config),
        "tokenizer_hash": None if tokenizer is None else tokenizer_hash(tokenizer),
    }


def _rope_parameters(config: Any) -> dict[str, Any] | None:
    """``config.rope_parameters`` (transformers 5.x), else the older ``rope_theta`` / ``rope_scaling`` fields."""
    parameters = getattr(config, "rope_parameters", None)
    if parameters is not None:
        return parameters
    legacy = {name: getattr(config, name, None) for name in ("rope_theta", "rope_scaling")}
    return {name: value for name, value in legacy.items() if value is not None} or None


def check_fingerprint(fingerprint: Any, where: str) -> None:
    """A loaded fingerprint has every structure field with a sane type and size, before anything is sized by it.

    Args:
        where: names the fingerprint in the errors (``"the fingerprint in config.json"``).

    Raises:
        ValueError: not an object, a missing structure field, a size that is not an integer in ``[1, limit]``
            (`FINGERPRINT_LIMITS`), ``layer_types`` that is not one string per layer, a ``sliding_window`` that is
            not a positive integer or null, a ``model_type`` that is not a string.
    """
    if not isinstance(fingerprint, dict):
        raise ValueError(f"{where} must be a JSON object (a model fingerprint), got {type(fingerprint).__name__}")
    missing = [field for field in STRUCTURE_FIELDS if field not in fingerprint]
    if missing:
        raise ValueError(
            f"{where} lacks the fields {missing}; build it with hf_structkv.persistence.model_fingerprint(model)"
        )
    for field, limit in FINGERPRINT_LIMITS.items():
        value = fingerprint[field]
        if not is_int(value) or not 1 <= value <= limit:
            raise ValueError(f"{field} in {where} must be an integer in [1, {limit}], got {value!r}")
    if not isinstance(fingerprint["model_type"], str):
        raise ValueError(f"model_type in {where} must be a string, got {fingerprint['model_type']!r}")
    types = fingerprint["layer_types"]
    layers = fingerprint["num_hidden_layers"]
    if types is not None and (
        not isinstance(types, list) or len(types) != layers or not all(isinstance(t, str) for t in types)
    ):
        raise ValueError(f"layer_types in {where} must be null or list one type name per layer ({layers})")
    window = fingerprint["sliding_window"]
    if window is not None and (not is_int(window) or window < 1):
        raise ValueError(f"sliding_window in {where} must be null or a positive integer, got {window!r}")
    if fingerprint["rope_parameters"] is not None and not isinstance(fingerprint["rope_parameters"], dict):
        raise ValueError(f"rope_parameters in {where} must be null or a JSON object")


def check_same_model(saved: dict[str, Any], current: dict[str, Any], what: str = "cache") -> None:
    """The model-structure fields of the ``what``'s fingerprint equal the model's; names the first that differs."""
    for field in STRUCTURE_FIELDS:
        if saved[field] != current[field]:
            model = current.get("architecture") or current["model_type"]
            raise ValueError(
                f"this {what} was built for another model: {field} is {saved[field]!r} in the {what}'s fingerprint "
                f"but {current[field]!r} in the given model ({model})"
            )


def check_same_tokenizer(saved: dict[str, Any], tokenizer: PreTrainedTokenizerBase, what: str = "cache") -> None:
    """The tokenizer's vocabulary hash equals the one in the ``what``'s fingerprint ``saved``."""
    expected = saved.get("tokenizer_hash")
    if expected is None:
        raise ValueError(
            f"this {what}'s fingerprint has no tokenizer hash, so tokenizer= cannot be checked: load without it, or "
            f"save the {what} with model_fingerprint(model, tokenizer)"
        )
    if not isinstance(expected, str):
        raise ValueError(f"tokenizer_hash in the {what}'s fingerprint must be a hex string, got {expected!r}")
    actual = tokenizer_hash(tokenizer)
    if actual != expected:
        raise ValueError(
            f"tokenizer mismatch: the {what} was built with a tokenizer whose vocabulary hash is {expected[:16]}..., "
            f"the given tokenizer's is {actual[:16]}..."
        )
