"""Per-head budgets: how one global compaction ratio is shared among the KV heads of a model.

KV-Surgeon seed, appendix "Compaction ratio and per-head budgets" (restated in ``design/ALGORITHMS.md`` §1): head
``(l, h)`` keeps its own fraction ``r_lh`` of the context, the mean over heads is ``1/ratio``, every head is capped at
``r_lh <= 0.75`` and the budget a capped head cannot use goes to the other heads in proportion to their shares.

* `HeadBudgets`: the ratio-agnostic shares of one model (with its fingerprint and how they were computed),
  `HeadBudgets.token_budgets` turns them into kept-entry counts for a ratio and a context length; saved as JSON
  (``head_budgets.json`` + a model card ``README.md``; folders saved before the rename hold ``config.json`` and still
  load), loadable from a folder, a JSON file or the Hub.
* `UniformBudgets`: ``compact(budgets="uniform")``'s floor rule, with the same ``token_budgets`` interface.
* `default_head_budgets`: the allocation shipped for the embedded default model.

How the shares are measured and solved for is `budget_sensitivity` (`compute_head_budgets`).
"""

from __future__ import annotations

import importlib.resources
import json
import math
import numbers
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..persistence import (
    CARD_NAME,
    SavedArtifact,
    base_model,
    card_front_matter,
    check_fingerprint,
    check_format_version,
    check_same_model,
    check_same_tokenizer,
    model_fingerprint,
    read_json_object,
    write_text_file,
)
from ..validation import check_int, is_number
from ..version import __version__

__all__ = [
    "BUDGETS_NAME",
    "CAP_FRACTION",
    "HeadBudgets",
    "UniformBudgets",
    "default_head_budgets",
    "global_layers",
    "water_fill",
    "is_real",
    "largest_remainder",
]

FORMAT_NAME = "hf_structkv_head_budgets"
FORMAT_VERSION = 1
CAP_FRACTION = 0.75
MAX_LENGTH = 2**40
"""The longest context `token_budgets` accepts (its water fill runs in float64, exact far beyond any real context)."""
BUDGETS_NAME = "head_budgets.json"
LEGACY_BUDGETS_NAME = "config.json"  # the file name before the rename: it collided with a CompactedCache's
DEFAULT_MODEL_BUDGETS = "qwen2.5-coder-0.5b-instruct"
_JSON_FIELDS = frozenset(
    {"format", "format_version", "hf_structkv_version", "cap_fraction", "weights", "fingerprint", "provenance"}
)
"""The fields of ``head_budgets.json`` (``provenance`` may be missing); another field would be dropped on a save."""
_LAYER_KEY = re.compile(r"0|[1-9][0-9]{0,5}")  # a layer index as JSON keys spell it: no sign, no leading zero


# ---------------------------------------------------------------------------------------------------- allocation
def water_fill(weights: Sequence[float], total: float, lower: float, upper: float) -> list[float]:
    """``x_h = clip(c * w_h, lower, upper)`` with the one ``c`` that makes ``Σ x_h = total``.

    This is the fixed point of "cap every head above ``upper`` (and lift every head below ``lower``), share what is
    left among the free heads in proportion to their weights, repeat until stable", solved exactly: ``g(c) =
    Σ clip(c w_h, lower, upper)`` is non-decreasing and piecewise linear with breakpoints ``lower / w_h`` and
    ``upper / w_h``; a sweep over the sorted breakpoints finds the segment where ``g`` reaches ``total``. Heads of
    weight 0 stay at ``lower``, unless the positive-weight heads are all at ``upper`` and budget is left: then that
    rest is split evenly among them. Needs ``n * lower <= total <= n * upper``.
    """
    n = len(weights)
    events = sorted(
        [(lower / w, w) for w in weights if w > 0] + [(upper / w, -w) for w in weights if w > 0],
        key=lambda event: event[0],
    )
    value, slope, level = n * lower, 0.0, 0.0  # g(level) = value; g rises with slope right of level
    for at, change in events:
        reached = value + slope * (at - level)
        if reached >= total and slope > 0:
            level += (total - value) / slope
            value = total
            break
        value, level, slope = reached, at, slope + change
    else:
        level = math.inf  # every positive-weight head is capped
    zero_heads = sum(1 for w in weights if w <= 0)
    rest = (total - value) / zero_heads if zero_heads and value < total else 0.0
    return [min(upper, max(lower, level * w)) if w > 0 else lower + rest for w in weights]


def largest_remainder(amounts: Sequence[float], total: int, upper: int) -> list[int]:
    """Integers ``>= floor(amount)`` summing to ``total``: the floors, plus one for the largest fractional parts
    (ties to the lower index), never above ``upper``. Their sum-of-squares distance to ``amounts`` is minimal."""
    counts = [int(math.floor(a)) for a in amounts]
    order = sorted(range(len(amounts)), key=lambda i: (-(amounts[i] - counts[i]), i))
    missing = total - sum(counts)
    for i in order:
        if missing <= 0:
            break
        if counts[i] < upper:
            counts[i] += 1
            missing -= 1
    return counts


def global_layers(fingerprint: dict[str, Any]) -> list[int]:
    """Indices of the layers a compacted cache compacts: every layer that is not a sliding-window layer."""
    types = fingerprint["layer_types"]
    return [i for i in range(fingerprint["num_hidden_layers"]) if types is None or "sliding" not in types[i]]


def is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# ---------------------------------------------------------------------------------------------------- HeadBudgets
@dataclass(frozen=True)
class HeadBudgets(SavedArtifact):
    """A ratio-agnostic allocation of kept cache entries to the KV heads of one model.

    Attributes:
        weights: ``{global layer index: [share of each KV head]}``, every share ``>= 0``, normalised at construction
            so that all shares sum to 1. A head's retained fraction at ratio ``ρ`` is proportional to its share
            (before the cap): ``r = share * n_heads / ρ``.
        fingerprint: `hf_structkv.persistence.model_fingerprint` of the model (its global layers and KV heads fix the
            shape of ``weights``).
        provenance: JSON-serialisable description of how the shares were computed (``{"kind": "uniform"}``, or the
            sensitivity measurement: method, fractions, texts, influence curves, seconds).
    """

    weights: dict[int, list[float]]
    fingerprint: dict[str, Any]
    provenance: dict[str, Any] = field(default_factory=dict)

    # head_budgets.json, or the config.json of a repository pushed before the rename, and the card
    SAVED_FILES: ClassVar[tuple[str, ...]] = (BUDGETS_NAME, LEGACY_BUDGETS_NAME, CARD_NAME)

    def __post_init__(self) -> None:
        check_fingerprint(self.fingerprint, "the head budgets' fingerprint")  # sizes bounded before anything is built
        if not isinstance(self.provenance, dict):
            raise TypeError(f"provenance must be a dict, got {type(self.provenance).__name__}")
        if not isinstance(self.weights, dict):
            raise TypeError(f"weights must be a dict {{global layer: [share per KV head]}}, got {type(self.weights)}")
        layers = global_layers(self.fingerprint)
        heads = self.fingerprint["num_key_value_heads"]
        if sorted(self.weights) != layers:
            raise ValueError(
                f"weights must have one entry per global layer of the model, {layers}; got {sorted(self.weights)}"
            )
        for layer in layers:
            shares = self.weights[layer]
            if (
                not isinstance(shares, (list, tuple))
                or len(shares) != heads
                or not all(is_real(s) and math.isfinite(s) and s >= 0 for s in shares)
            ):
                raise ValueError(
                    f"weights[{layer}] must list {heads} finite shares >= 0 (one per KV head of the fingerprint's "
                    f"model), got {shares!r}"
                )
        try:
            total = math.fsum(s for layer in layers for s in self.weights[layer])
        except OverflowError:
            total = math.inf
        if not math.isfinite(total):
            raise ValueError("weights sum beyond the float range: scale the shares down (only their ratios matter)")
        if total <= 0:
            raise ValueError("weights are all zero: at least one KV head needs a positive share")
        scale = 1.0 if abs(total - 1.0) <= 1e-12 else total  # already normalised shares stay bit-identical
        shares = {layer: [float(s) / scale for s in self.weights[layer]] for layer in layers}
        object.__setattr__(self, "weights", shares)

    # ------------------------------------------------------------------ construction
    @classmethod
    def uniform(cls, model: PreTrainedModel) -> HeadBudgets:
        """Every KV head of every global layer gets the same share (the paper's ablation)."""
        fingerprint = model_fingerprint(model)
        heads = fingerprint["num_key_value_heads"]
        return cls({layer: [1.0] * heads for layer in global_layers(fingerprint)}, fingerprint, {"kind": "uniform"})

    @property
    def n_heads(self) -> int:
        """KV heads over all global layers."""
        return sum(len(shares) for shares in self.weights.values())

    # ------------------------------------------------------------------ budgets
    def token_budgets(self, ratio: float, length: int) -> dict[int, list[int]]:
        """Kept entries of each KV head for a context of ``length`` tokens at compaction ``ratio``.

        The counts sum to exactly ``round(n_heads * length / ratio)`` (mean retained fraction ``1/ratio``); each is
        at least 1 and at most ``floor(0.75 * length)``; in between they are proportional to the shares, a capped
        head's excess (and what lifting heads to 1 entry costs) shared among the others in proportion to their
        shares, then rounded by largest remainder.

        Returns:
            ``{global layer index: [kept entries of each KV head]}``.

        Raises:
            ValueError: ``ratio`` is not a finite number > 0, ``length`` is not an integer in ``[1, MAX_LENGTH]``,
                or the pair asks for fewer entries than one per head or more than the cap allows.
        """
        if not is_number(ratio) or ratio <= 0:
            raise ValueError(f"ratio must be a finite number > 0 (original / kept entries), got {ratio!r}")
        check_int("length", length, 1, MAX_LENGTH, counts="context tokens")
        n_heads, cap = self.n_heads, math.floor(CAP_FRACTION * length)
        total = round(n_heads * length / ratio)
        if total < n_heads:
            raise ValueError(
                f"ratio {ratio} leaves {total} entries for {n_heads} KV heads of a {length}-token context (length "
                f"{length}), but each head keeps at least one: use ratio <= {length}"
            )
        if total > n_heads * cap:
            fix = f"use ratio >= {length / cap:.4g}" if cap else "a 1-token context cannot be compacted"
            raise ValueError(
                f"ratio {ratio} asks each KV head of a {length}-token context (length {length}) to keep "
                f"{total / n_heads:.1f} entries on average, above the cap of {cap} ({CAP_FRACTION} of the length): "
                f"{fix}"
            )
        layers = list(self.weights)
        flat = [s for layer in layers for s in self.weights[layer]]
        counts = largest_remainder(water_fill(flat, total, 1.0, float(cap)), total, cap)
        out, start = {}, 0
        for layer in layers:
            out[layer] = counts[start : start + len(self.weights[layer])]
            start += len(self.weights[layer])
        return out

    # ------------------------------------------------------------------ persistence
    def to_config(self) -> dict[str, Any]:
        """The ``head_budgets.json`` content (JSON-normalised)."""
        config = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "hf_structkv_version": __version__,
            "cap_fraction": CAP_FRACTION,
            "weights": {str(layer): shares for layer, shares in self.weights.items()},
            "fingerprint": self.fingerprint,
            "provenance": self.provenance,
        }
        try:
            return json.loads(json.dumps(config, allow_nan=False))
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"provenance and fingerprint must be JSON-serialisable (no tensors, no NaN): {err}"
            ) from None

    @classmethod
    def from_config(cls, config: Any, model: PreTrainedModel | None = None, source: str = BUDGETS_NAME) -> HeadBudgets:
        """Build from a parsed ``head_budgets.json``; with ``model``, check that the budgets were computed for it."""
        if not isinstance(config, dict) or config.get("format") != FORMAT_NAME:
            found = config.get("format") if isinstance(config, dict) else type(config).__name__
            raise ValueError(f"{source} is not a head-budget file (format {found!r}, expected {FORMAT_NAME!r})")
        check_format_version(config.get("format_version"), FORMAT_VERSION, source)
        unknown = sorted(config.keys() - _JSON_FIELDS)
        if unknown:
            raise ValueError(f"{source} has unknown fields {unknown}: a head-budget file holds {sorted(_JSON_FIELDS)}")
        cap = config.get("cap_fraction")
        if not is_real(cap) or cap != CAP_FRACTION:
            raise ValueError(f"cap_fraction in {source} must be {CAP_FRACTION}, got {cap!r}")
        weights = config.get("weights")
        if not isinstance(weights, dict) or not all(isinstance(k, str) and _LAYER_KEY.fullmatch(k) for k in weights):
            keys = sorted(map(str, weights))[:8] if isinstance(weights, dict) else weights
            raise ValueError(
                f"weights in {source} must map global layer indices written as plain decimals ('0', '1', ..., not "
                f"'00') to share lists, got {keys!r}"
            )
        if not isinstance(config.get("provenance", {}), dict):
            raise ValueError(f"provenance in {source} must be a JSON object")
        try:
            budgets = cls(
                {int(layer): shares for layer, shares in weights.items()},
                config.get("fingerprint"),
                config.get("provenance", {}),
            )
        except (TypeError, ValueError) as err:
            raise ValueError(f"{source}: {err}") from None
        if model is not None:
            budgets.check_model(model)
        return budgets

    def check_model(self, model: PreTrainedModel) -> None:
        """Raise ValueError naming the first model-structure field where ``model`` differs from the fingerprint."""
        check_same_model(self.fingerprint, model_fingerprint(model), what="head-budget allocation")

    def _write_folder(self, directory: Path, repo_id: str | None) -> None:
        """``head_budgets.json`` (removed first, written last) and the card."""
        config = self.to_config()
        directory.mkdir(parents=True, exist_ok=True)
        (directory / BUDGETS_NAME).unlink(missing_ok=True)
        write_text_file(directory / CARD_NAME, _model_card(config, repo_id))
        write_text_file(directory / BUDGETS_NAME, json.dumps(config, indent=2, sort_keys=True) + "\n")

    @classmethod
    def _from_folder(
        cls, source: Path, *, model: PreTrainedModel | None, tokenizer: PreTrainedTokenizerBase | None
    ) -> HeadBudgets:
        """Read ``head_budgets.json`` (``source`` itself, or in the folder ``source``; else the ``config.json`` of a
        folder saved before the rename). With ``model``, checks the fingerprint against it; with ``tokenizer``, its
        vocabulary hash (when recorded).

        Raises:
            ValueError: naming the problem (missing file, invalid JSON, not a head-budget file, shares that do not
                fit the fingerprint, another model or tokenizer).
        """
        file = source
        if not source.is_file():
            names = (BUDGETS_NAME, LEGACY_BUDGETS_NAME)  # a link to a device, or a loop, is read and refused
            found = [source / name for name in names if os.path.lexists(source / name)]
            if not found:
                raise ValueError(f"{source} holds no head budgets: {BUDGETS_NAME} is missing")
            file = found[0]
        config = read_json_object(file.parent, file.name, "head-budget allocation")
        budgets = cls.from_config(config, model=model, source=str(file))
        if tokenizer is not None:
            check_same_tokenizer(budgets.fingerprint, tokenizer, what="head-budget allocation")
        return budgets

    def _commit_message(self) -> str:
        return "Upload per-head KV budgets with hf_structkv"


@dataclass(frozen=True)
class UniformBudgets:
    """``compact(budgets="uniform")``: every KV head of every global layer keeps ``max(1, floor(length / ratio))``
    entries, at any ratio (unlike `HeadBudgets.uniform`, whose equal shares obey the cap and the exact total).

    Attributes:
        heads: ``{global layer index: KV heads}``.
    """

    heads: dict[int, int]

    @classmethod
    def of(cls, model: PreTrainedModel) -> UniformBudgets:
        fingerprint = model_fingerprint(model)
        return cls({layer: fingerprint["num_key_value_heads"] for layer in global_layers(fingerprint)})

    def token_budgets(self, ratio: float, length: int) -> dict[int, list[int]]:
        """``{global layer index: [max(1, floor(length / ratio))] * KV heads}``."""
        return {layer: [max(1, math.floor(length / ratio))] * n for layer, n in self.heads.items()}


def _model_card(config: dict[str, Any], repo_id: str | None) -> str:
    """``README.md`` of saved budgets: what they are, how to use them, how they were computed."""
    metadata = {"fingerprint": config["fingerprint"]}
    base = base_model(metadata)
    fingerprint = config["fingerprint"]
    layers = len(config["weights"])
    provenance = json.dumps(config["provenance"], indent=2, sort_keys=True)
    return "\n".join(
        [
            "---",
            card_front_matter(["head-budgets"], base),
            "---",
            f"# Per-head KV budgets for {base or fingerprint.get('architecture', 'an unnamed model')}",
            "",
            f"One share per KV head of the {layers} global layers ({fingerprint['num_key_value_heads']} KV heads "
            "each): how a compaction ratio is split among heads (mean retained fraction 1/ratio, each head capped "
            f"at {config['cap_fraction']} of the context, at least one entry per head). Made with hf_structkv "
            f"{config['hf_structkv_version']}.",
            "",
            "```python",
            "from hf_structkv.compaction.budgets import HeadBudgets",
            "",
            f'budgets = HeadBudgets.from_pretrained("{repo_id or "<this folder or repository id>"}", model=model)',
            "budgets.token_budgets(ratio=20.0, length=4096)  # {layer: [kept entries per KV head]}",
            "```",
            "",
            "## How the shares were computed",
            "",
            "```json",
            provenance,
            "```",
            "",
        ]
    )


def default_head_budgets(model: PreTrainedModel | None = None) -> HeadBudgets:
    """The sensitivity-based allocation shipped for the embedded default model (Qwen2.5-Coder-0.5B-Instruct);
    with ``model``, checks that it is that model."""
    resource = importlib.resources.files("hf_structkv.data") / "head_budgets" / DEFAULT_MODEL_BUDGETS / BUDGETS_NAME
    config = json.loads(resource.read_text(encoding="utf-8"))
    return HeadBudgets.from_config(config, model=model, source=f"hf_structkv.data/{DEFAULT_MODEL_BUDGETS}")
