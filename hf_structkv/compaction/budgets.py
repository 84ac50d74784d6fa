"""Per-head budgets: how one global compaction ratio is shared among the KV heads of a model.

KV-Surgeon seed, appendix "Compaction ratio and per-head budgets" (restated in ``design/ALGORITHMS.md`` §1): head
``(l, h)`` keeps its own fraction ``r_lh`` of the context, the mean over heads is ``1/ratio``, every head is capped at
``r_lh <= 0.75`` and the budget a capped head cannot use goes to the other heads in proportion to their shares. The
shares are computed once per model from per-head influence curves (how the log-perplexity of model-generated
reference answers, and optionally of exact-lookup quotes of the text, grows as that head alone is compressed) and reused
for every ratio by rescaling.

* `HeadBudgets`: the ratio-agnostic shares of one model (with its fingerprint and how they were computed),
  `HeadBudgets.token_budgets` turns them into kept-entry counts for a ratio and a context length; saved as JSON
  (``config.json`` + a model card ``README.md``), loadable from a folder, a JSON file or the Hub.
* `compute_head_budgets`: measures the influence curves on texts and solves for the shares (`allocate_shares`);
  `quote_references` makes its exact-lookup references.
* `UniformBudgets`: ``compact(budgets="uniform")``'s floor rule, with the same ``token_budgets`` interface.
* `default_head_budgets`: the allocation shipped for the embedded default model.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import math
import numbers
import os
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .. import __version__
from ..attention.modules import attention_scalings
from ..attention.registry import enable
from ..cache.compacted import CompactedCache
from ..eval.reference_answers import ReferenceAnswers
from ..generation import generation_inputs
from ..hub import (
    CARD_NAME,
    CONFIG_NAME,
    STRUCTURE_FIELDS,
    _base_model,
    _check_same_model,
    _replace_file,
    _resolve_folder,
    _upload_folder,
    model_fingerprint,
)
from ..prompts import document_chat_prompt
from ..validation import check_int
from .context_prefill import prefill_context
from .head_compaction import HEAD_METHODS, compact_head
from .queries import repeat_pass_queries

__all__ = [
    "CALIBRATION_ARTICLES",
    "CAP_FRACTION",
    "DEFAULT_QUESTIONS",
    "HeadBudgets",
    "UniformBudgets",
    "allocate_shares",
    "quote_references",
    "compute_head_budgets",
    "default_head_budgets",
]

FORMAT_NAME = "hf_structkv_head_budgets"
FORMAT_VERSION = 1
CAP_FRACTION = 0.75
BUDGET_FILES = (CONFIG_NAME, CARD_NAME)

DEFAULT_QUESTIONS = (
    "What is the main topic of the text above?",
    "Summarize the text above in two sentences.",
    "List three specific facts (names, numbers or dates) that the text above states.",
)
DEFAULT_FRACTIONS = (0.0, 0.02, 0.1)
DEFAULT_TARGET_RATIOS = (5.0, 10.0, 20.0, 50.0, 100.0)
DEFAULT_SOLVER_STEPS = 1000
DEFAULT_FLOOR = 0.125
# SQuAD v2 dev contexts the shipped allocation was computed on (first CALIBRATION_PARAGRAPHS paragraphs each, 937 and
# 778 tokens with the chat prompt): keep them out of evaluations, so the budgets never saw an evaluated context.
CALIBRATION_ARTICLES = ("Force", "Prime_number")
CALIBRATION_PARAGRAPHS = 5
DEFAULT_MODEL_BUDGETS = "qwen2.5-coder-0.5b-instruct"


# ---------------------------------------------------------------------------------------------------- allocation
def _water_fill(weights: Sequence[float], total: float, lower: float, upper: float) -> list[float]:
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


def _largest_remainder(amounts: Sequence[float], total: int, upper: int) -> list[int]:
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


def _global_layers(fingerprint: dict[str, Any]) -> list[int]:
    """Indices of the layers a compacted cache compacts: every layer that is not a sliding-window layer."""
    types = fingerprint["layer_types"]
    return [i for i in range(fingerprint["num_hidden_layers"]) if types is None or "sliding" not in types[i]]


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# ---------------------------------------------------------------------------------------------------- HeadBudgets
@dataclass(frozen=True)
class HeadBudgets:
    """A ratio-agnostic allocation of kept cache entries to the KV heads of one model.

    Attributes:
        weights: ``{global layer index: [share of each KV head]}``, every share ``>= 0``, normalised at construction
            so that all shares sum to 1. A head's retained fraction at ratio ``ρ`` is proportional to its share
            (before the cap): ``r = share * n_heads / ρ``.
        fingerprint: `hf_structkv.hub.model_fingerprint` of the model (its global layers and KV heads fix the
            shape of ``weights``).
        provenance: JSON-serialisable description of how the shares were computed (``{"kind": "uniform"}``, or the
            sensitivity measurement: method, fractions, texts, influence curves, seconds).
    """

    weights: dict[int, list[float]]
    fingerprint: dict[str, Any]
    provenance: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.fingerprint, dict) or any(name not in self.fingerprint for name in STRUCTURE_FIELDS):
            raise ValueError(
                f"fingerprint must be a model fingerprint with the fields {list(STRUCTURE_FIELDS)} "
                "(hf_structkv.hub.model_fingerprint(model))"
            )
        if not isinstance(self.provenance, dict):
            raise TypeError(f"provenance must be a dict, got {type(self.provenance).__name__}")
        if not isinstance(self.weights, dict):
            raise TypeError(f"weights must be a dict {{global layer: [share per KV head]}}, got {type(self.weights)}")
        layers = _global_layers(self.fingerprint)
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
                or not all(_is_real(s) and math.isfinite(s) and s >= 0 for s in shares)
            ):
                raise ValueError(
                    f"weights[{layer}] must list {heads} finite shares >= 0 (one per KV head), got {shares!r}"
                )
        total = math.fsum(s for layer in layers for s in self.weights[layer])
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
        return cls({layer: [1.0] * heads for layer in _global_layers(fingerprint)}, fingerprint, {"kind": "uniform"})

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
            ValueError: ``ratio`` is not a finite number > 0, ``length`` is not a positive integer, or the pair asks
                for fewer entries than one per head or more than the cap allows.
        """
        if not _is_real(ratio) or not math.isfinite(ratio) or ratio <= 0:
            raise ValueError(f"ratio must be a finite number > 0 (original / kept entries), got {ratio!r}")
        check_int("length", length, 1, counts="context tokens")
        n_heads, cap = self.n_heads, math.floor(CAP_FRACTION * length)
        total = round(n_heads * length / ratio)
        if total < n_heads:
            raise ValueError(
                f"ratio {ratio} leaves {total} entries for {n_heads} KV heads of a {length}-token context, but each "
                f"head keeps at least one: use ratio <= {length}"
            )
        if total > n_heads * cap:
            fix = f"use ratio >= {length / cap:.4g}" if cap else "a 1-token context cannot be compacted"
            raise ValueError(
                f"ratio {ratio} asks each KV head of a {length}-token context to keep {total / n_heads:.1f} entries "
                f"on average, above the cap of {cap} ({CAP_FRACTION} of the length): {fix}"
            )
        layers = list(self.weights)
        flat = [s for layer in layers for s in self.weights[layer]]
        counts = _largest_remainder(_water_fill(flat, total, 1.0, float(cap)), total, cap)
        out, start = {}, 0
        for layer in layers:
            out[layer] = counts[start : start + len(self.weights[layer])]
            start += len(self.weights[layer])
        return out

    # ------------------------------------------------------------------ persistence
    def to_config(self) -> dict[str, Any]:
        """The ``config.json`` content (JSON-normalised)."""
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
    def from_config(cls, config: Any, model: PreTrainedModel | None = None, source: str = CONFIG_NAME) -> HeadBudgets:
        """Build from a parsed ``config.json``; with ``model``, check that the budgets were computed for it."""
        if not isinstance(config, dict) or config.get("format") != FORMAT_NAME:
            found = config.get("format") if isinstance(config, dict) else type(config).__name__
            raise ValueError(f"{source} is not a head-budget file (format {found!r}, expected {FORMAT_NAME!r})")
        if config.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"unknown format_version {config.get('format_version')!r} in {source} (this hf_structkv {__version__} "
                f"reads format {FORMAT_VERSION}); a newer hf_structkv may read it"
            )
        if config.get("cap_fraction") != CAP_FRACTION:
            raise ValueError(f"cap_fraction in {source} must be {CAP_FRACTION}, got {config.get('cap_fraction')!r}")
        weights = config.get("weights")
        if not isinstance(weights, dict) or not all(isinstance(k, str) and k.isdigit() for k in weights):
            raise ValueError(f"weights in {source} must map global layer indices ('0', '1', ...) to share lists")
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
        _check_same_model(self.fingerprint, model_fingerprint(model), what="head-budget allocation")

    def save_pretrained(self, save_directory: str | os.PathLike, repo_id: str | None = None) -> None:
        """Write ``config.json`` (the budgets) and ``README.md`` (a model card) into ``save_directory``.

        Args:
            repo_id: the Hub repository the card's usage snippet loads from (a placeholder when ``None``).
        """
        config = self.to_config()
        directory = Path(save_directory)
        directory.mkdir(parents=True, exist_ok=True)
        card = _model_card(config, repo_id)
        _replace_file(directory / CARD_NAME, lambda tmp: tmp.write_text(card, encoding="utf-8"))
        text = json.dumps(config, indent=2, sort_keys=True) + "\n"
        _replace_file(directory / CONFIG_NAME, lambda tmp: tmp.write_text(text, encoding="utf-8"))

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        model: PreTrainedModel | None = None,
        revision: str | None = None,
        token: str | None = None,
    ) -> HeadBudgets:
        """Load budgets saved by `save_pretrained`: a folder, its ``config.json``, or a Hub repository id.

        Reads JSON only. With ``model``, checks the fingerprint against it.

        Raises:
            ValueError: naming the problem (missing file, invalid JSON, not a head-budget file, shares that do not
                fit the fingerprint, another model).
        """
        file = Path(path)
        if not file.is_file():
            file = _resolve_folder(path, revision, token, files=BUDGET_FILES) / CONFIG_NAME
            if not file.is_file():
                raise ValueError(f"{path} holds no head budgets: {CONFIG_NAME} is missing")
        try:
            config = json.loads(file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{file} is not valid JSON: {err}") from None
        return cls.from_config(config, model=model, source=str(file))

    def push_to_hub(
        self, repo_id: str, private: bool | None = None, token: str | None = None, revision: str | None = None
    ) -> str:
        """Upload ``config.json`` and the model card to a Hub model repository (created if needed, ``private``
        then applies; branch ``revision`` created if given). Returns the commit URL."""
        return _upload_folder(
            lambda folder: self.save_pretrained(folder, repo_id=repo_id),
            BUDGET_FILES,
            "Upload per-head KV budgets with hf_structkv",
            repo_id,
            private=private,
            token=token,
            revision=revision,
        )


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
        return cls({layer: fingerprint["num_key_value_heads"] for layer in _global_layers(fingerprint)})

    def token_budgets(self, ratio: float, length: int) -> dict[int, list[int]]:
        """``{global layer index: [max(1, floor(length / ratio))] * KV heads}``."""
        return {layer: [max(1, math.floor(length / ratio))] * n for layer, n in self.heads.items()}


def _model_card(config: dict[str, Any], repo_id: str | None) -> str:
    """``README.md`` of saved budgets: what they are, how to use them, how they were computed."""
    metadata = {"fingerprint": config["fingerprint"]}
    base_model = _base_model(metadata)
    front = ["library_name: hf_structkv", "tags:", "- hf_structkv", "- kv-cache", "- head-budgets"]
    if base_model:
        front.append(f"base_model: {json.dumps(base_model)}")
    fingerprint = config["fingerprint"]
    layers = len(config["weights"])
    provenance = json.dumps(config["provenance"], indent=2, sort_keys=True)
    return "\n".join(
        [
            "---",
            *front,
            "---",
            f"# Per-head KV budgets for {base_model or fingerprint['architecture']}",
            "",
            f"One share per KV head of the {layers} global layers ({fingerprint['num_key_value_heads']} KV heads "
            "each): how a compaction ratio is split among heads (mean retained fraction 1/ratio, each head capped "
            f"at {config['cap_fraction']} of the context, at least one entry per head). Made with hf_structkv "
            f"{config['hf_structkv_version']}.",
            "",
            "```python",
            "from hf_structkv.compaction.budgets import HeadBudgets",
            "",
            f'budgets = HeadBudgets.load("{repo_id or "<this repository id or local folder>"}", model=model)',
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
    resource = importlib.resources.files("hf_structkv.data") / "head_budgets" / DEFAULT_MODEL_BUDGETS / CONFIG_NAME
    config = json.loads(resource.read_text(encoding="utf-8"))
    return HeadBudgets.from_config(config, model=model, source=f"hf_structkv.data/{DEFAULT_MODEL_BUDGETS}")


# ---------------------------------------------------------------------------------------------------- the solver
def _lower_hull(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Lower convex hull of points sorted by x (monotone chain)."""
    hull: list[tuple[float, float]] = []
    for p in points:
        while len(hull) >= 2:
            (ox, oy), (ax, ay) = hull[-2], hull[-1]
            if (ax - ox) * (p[1] - oy) - (ay - oy) * (p[0] - ox) > 0:
                break
            hull.pop()
        hull.append(p)
    return hull


def influence_curve(fractions: Sequence[float], increases: Sequence[float]) -> list[tuple[float, float]]:
    """Knots ``(r, Δ)`` of one head's modelled influence curve on ``[0, 1]`` (piecewise linear between knots).

    From the measured NLL increases ``Δ_k`` at retained ``fractions`` (ascending, in ``[0, 1)``) and ``Δ(1) = 0``
    (the full head): negative increases count as 0; the curve is made non-increasing in ``r`` (each point raised to
    the largest increase measured at a larger fraction: keeping more never hurts); then replaced by its lower convex
    envelope, on which a greedy allocation is optimal; when no fraction 0 was measured, the first segment is
    extended down to ``r = 0``.
    """
    raised, points = 0.0, [(1.0, 0.0)]
    for r, delta in zip(reversed(fractions), reversed(increases)):
        raised = max(raised, float(delta))
        points.append((float(r), raised))
    hull = _lower_hull(points[::-1])
    if hull[0][0] > 0:
        (x0, y0), (x1, y1) = hull[0], hull[1]
        hull.insert(0, (0.0, y0 - (y1 - y0) / (x1 - x0) * x0))
    return hull


def _evaluate(knots: list[tuple[float, float]], r: float) -> float:
    """The piecewise-linear curve through ``knots`` at ``r`` (in ``[0, 1]``)."""
    for (x0, y0), (x1, y1) in zip(knots[:-1], knots[1:]):
        if r <= x1:
            return y0 + (y1 - y0) * (r - x0) / (x1 - x0)
    return knots[-1][1]


def allocate_shares(
    fractions: Sequence[float],
    increases: torch.Tensor,
    target_ratios: Sequence[float] = DEFAULT_TARGET_RATIOS,
    steps: int = DEFAULT_SOLVER_STEPS,
    floor: float = DEFAULT_FLOOR,
    cap: float = CAP_FRACTION,
) -> torch.Tensor:
    """Ratio-agnostic shares ``[H]`` (sum 1) from the influence curves ``increases [H, K]`` measured at ``fractions``.

    Rule (the paper states only "allocate the budget along these influence curves ... one set of per-head
    proportions that works across all target ratios"; this is our solver, after Zweiger et al.'s greedy): model
    each head's curve with `influence_curve` (``C_h``), predict a model's loss increase as the sum over heads
    (the heads were measured one at a time), and minimise over shares ``p`` (on the simplex, ``p_h >= floor / H``)

        J(p) = Σ_{ρ ∈ target_ratios} Σ_h C_h(min(cap, H p_h / ρ)),

    the predicted increase summed over the target ratios (head ``h`` retains ``H p_h / ρ`` at ratio ``ρ``). Greedy:
    every head starts at ``floor / H``; ``steps`` times, ``(1 - floor) / steps`` goes to the head whose ``J`` drops
    most (ties to the lower index). ``J`` is separable and convex in each ``p_h``, so this is the exact minimum over
    that grid. Once no head's ``J`` drops any more, the rest is split evenly (no evidence either way).

    The floor keeps every head at ``floor`` times its uniform share: a head that looked harmless on a few answers
    is never switched off (Zweiger et al.'s published Qwen3-4B allocation likewise gives its least-served heads
    about 14% of the uniform share). ``floor=1`` is the uniform allocation.
    """
    check_int("steps", steps, 1)
    if not target_ratios or not all(_is_real(r) and math.isfinite(r) and r > 0 for r in target_ratios):
        raise ValueError(f"target_ratios must be finite numbers > 0, got {target_ratios!r}")
    if not _is_real(floor) or not 0 <= floor <= 1:
        raise ValueError(
            f"floor must be in [0, 1] (the share every head keeps, times the uniform share), got {floor!r}"
        )
    if not 0 < cap <= 1:
        raise ValueError(f"cap must be in (0, 1], got {cap!r}")
    increases = torch.as_tensor(increases, dtype=torch.float64)
    if increases.dim() != 2 or increases.shape[1] != len(fractions) or not torch.isfinite(increases).all():
        raise ValueError(
            f"increases must be a finite [heads, {len(fractions)}] tensor (one column per fraction), got shape "
            f"{tuple(increases.shape)}"
        )
    n_heads = increases.shape[0]
    curves = [influence_curve(fractions, row.tolist()) for row in increases]
    base, unit = floor / n_heads, (1 - floor) / steps

    def loss(h: int, given: int) -> float:
        share = base + given * unit
        return math.fsum(_evaluate(curves[h], min(cap, n_heads * share / ratio)) for ratio in target_ratios)

    given = [0] * n_heads
    gains = [loss(h, 0) - loss(h, 1) for h in range(n_heads)]
    for _ in range(steps):
        best = max(range(n_heads), key=lambda h: (gains[h], -h))
        if gains[best] <= 0:
            break
        given[best] += 1
        gains[best] = loss(best, given[best]) - loss(best, given[best] + 1)
    rest = (steps - sum(given)) / n_heads
    return torch.tensor([base + (g + rest) * unit for g in given], dtype=torch.float64)


# ---------------------------------------------------------------------------------------------------- measurement
QUOTE_PREFIX_WORDS = 5
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def quote_references(
    text: str, count: int, seed: int = 0, prefix_words: int = QUOTE_PREFIX_WORDS
) -> list[tuple[str, str]]:
    """``count`` exact-lookup references of ``text``: (question, answer) pairs whose answer is text copied verbatim.

    The text is split into sentences at ``.``, ``!`` or ``?`` followed by white space; ``count`` of the sentences
    with more than ``prefix_words + 2`` words are drawn without replacement (seeded, in text order). Each question
    gives a sentence's first ``prefix_words`` words and asks for the rest word for word; the answer is that rest as
    it stands in the text. Unlike a model-generated answer, it can only be reproduced by looking the sentence up, so
    its likelihood measures what a head contributes to exact recall (names, numbers).

    Returns:
        ``min(count, eligible sentences)`` pairs; empty for ``count=0``.

    Raises:
        ValueError: ``count`` or ``prefix_words`` is not an integer (>= 0, resp. >= 1).
    """
    check_int("count", count, 0)
    check_int("prefix_words", prefix_words, 1)
    head = re.compile(rf"((?:\S+\s+){{{prefix_words - 1}}}\S+)\s+(\S.*)", re.DOTALL)  # first words, the rest
    splits = [head.fullmatch(s.strip()) for s in _SENTENCE_END.split(text)]
    eligible = [m for m in splits if m is not None and len(m.group(2).split()) > 2]
    chosen = sorted(random.Random(seed).sample(range(len(eligible)), min(count, len(eligible))))
    question = 'Continue, word for word, the sentence of the text above that begins "{}".'
    return [(question.format(" ".join(eligible[i].group(1).split())), eligible[i].group(2)) for i in chosen]


def _generate_answer(model: PreTrainedModel, cache: CompactedCache, question: torch.Tensor, max_tokens: int):
    """Greedy answer ``[a]`` (1-D ids, the end-of-turn token included when generated) after ``cache`` + question."""
    inputs = generation_inputs(cache, question[None].to(model.device))
    with torch.no_grad():
        out = model.generate(**inputs, cache=cache.copy(), max_new_tokens=max_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].cpu()


def _keep_everything(cache) -> list[list[torch.Tensor] | None]:
    """`CompactedCache.from_selection` indices keeping every position of every global layer (None: sliding)."""
    length = cache.get_seq_length()
    return [None if layer.is_sliding else [torch.arange(length)] * layer.keys.shape[1] for layer in cache.layers]


def _probe_cache(
    cache, everything: list, layer_idx: int, h: int, kept: torch.Tensor, bias: torch.Tensor, values: torch.Tensor
) -> CompactedCache:
    """The full context with only KV head ``h`` of layer ``layer_idx`` compacted to ``kept`` (``[t]``), ``bias``
    (``[t]``) and ``values`` (``[t, D_v]``)."""
    layer_values = cache.layers[layer_idx].values[0]  # [H_kv, T, D_v]
    n_heads = layer_values.shape[0]
    indices, biases, served = list(everything), [None] * len(everything), [None] * len(everything)
    indices[layer_idx] = [kept.cpu() if g == h else everything[layer_idx][g] for g in range(n_heads)]
    biases[layer_idx] = [bias.float() if g == h else torch.zeros(len(everything[layer_idx][g])) for g in range(n_heads)]
    served[layer_idx] = [values.to(layer_values) if g == h else layer_values[g] for g in range(n_heads)]
    return CompactedCache.from_selection(cache, indices, biases, served)


@dataclass(frozen=True)
class _ProbeSetting:
    """What `compute_head_budgets` measures on every text: the reference questions and quotes, the retained fractions
    probed, the compaction method and its hyper-parameters, the answer length cap, the query cap and the seed."""

    questions: tuple[str, ...]
    quotes: int
    fractions: tuple[float, ...]
    method: str
    hparams: dict[str, Any]
    max_answer_tokens: int
    query_cap: int
    seed: int


def _text_increases(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, text: str, setting: _ProbeSetting, bar: tqdm
) -> tuple[torch.Tensor, dict[str, Any]]:
    """NLL increases ``[global layers * H_kv, K]`` of one text (heads layer-major) and a description of the text."""
    context_text, suffix = document_chat_prompt(tokenizer, text)
    context_ids = tokenizer(context_text, return_tensors="pt", add_special_tokens=False).input_ids

    def ids(piece: str) -> torch.Tensor:
        return tokenizer(piece, return_tensors="pt", add_special_tokens=False).input_ids[0]

    lookups = quote_references(text, setting.quotes, setting.seed)
    question_ids = [ids(q + suffix) for q in [*setting.questions, *(q for q, _ in lookups)]]
    cache = prefill_context(model, context_ids)
    length = context_ids.shape[1]
    everything = _keep_everything(cache)
    full = CompactedCache.from_selection(cache, everything)
    answers = [
        _generate_answer(model, full, q, setting.max_answer_tokens) for q in question_ids[: len(setting.questions)]
    ]
    answers += [ids(answer)[: setting.max_answer_tokens] for _, answer in lookups]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    reference = ReferenceAnswers.build(question_ids, answers, pad_id)
    baseline = reference.nll(model, full).mean().item()
    queries = None
    if HEAD_METHODS[setting.method].needs_queries:
        queries = repeat_pass_queries(model, tokenizer, context_ids, cap=setting.query_cap, seed=setting.seed)
    scalings = attention_scalings(model)
    rows = []
    for layer_idx in [i for i, layer_indices in enumerate(everything) if layer_indices is not None]:
        keys, values = cache.layers[layer_idx].keys[0], cache.layers[layer_idx].values[0]
        for h in range(keys.shape[0]):
            row = []
            for fraction in setting.fractions:
                budget = round(fraction * length)
                if budget == 0:  # the head removed
                    kept, bias, kept_values = torch.zeros(0, dtype=torch.long), torch.zeros(0), values[h, :0]
                else:
                    head_queries = None if queries is None else queries[layer_idx][h]
                    head = compact_head(
                        keys[h],
                        values[h],
                        head_queries,
                        budget,
                        setting.method,
                        scalings.get(layer_idx),
                        setting.seed,
                        **setting.hparams,
                    )
                    kept, bias, kept_values = head.indices, head.bias, head.values
                probe = _probe_cache(cache, everything, layer_idx, h, kept, bias, kept_values)
                row.append(reference.nll(model, probe).mean().item() - baseline)
                bar.update(1)
            rows.append(row)
    description = {
        "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "tokens": length,
        "answers": [tokenizer.decode(a, skip_special_tokens=True) for a in answers[: len(setting.questions)]],
        "quotes": [q for q, _ in lookups],
        "answer_tokens": [len(a) for a in answers],
        "baseline_nll": baseline,
    }
    return torch.tensor(rows, dtype=torch.float64), description


def _check_fractions(fractions: Sequence[float]) -> list[float]:
    values = list(fractions) if isinstance(fractions, (list, tuple)) else None
    if (
        not values
        or not all(_is_real(f) and 0 <= f < 1 for f in values)
        or any(a >= b for a, b in zip(values[:-1], values[1:]))
    ):
        raise ValueError(
            f"fractions must be strictly increasing numbers in [0, 1) (0: the head removed), got {fractions!r}"
        )
    return [float(f) for f in values]


def compute_head_budgets(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    texts: Sequence[str],
    questions: Sequence[str] = DEFAULT_QUESTIONS,
    quotes: int = 0,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    method: str = "kv_surgeon",
    target_ratios: Sequence[float] = DEFAULT_TARGET_RATIOS,
    max_answer_tokens: int = 48,
    query_cap: int = 4096,
    solver_steps: int = DEFAULT_SOLVER_STEPS,
    floor: float = DEFAULT_FLOOR,
    seed: int = 0,
    text_names: Sequence[str] | None = None,
    progress: bool = True,
    **hparams: Any,
) -> HeadBudgets:
    """Sensitivity-based per-head budgets of ``model`` (KV-Surgeon seed appendix, after Zweiger et al.).

    For each text: the text is wrapped in the tokenizer's chat template (``document_chat_prompt``) and prefilled;
    the model answers each of ``questions`` greedily from the full cache (at most ``max_answer_tokens`` tokens):
    these are the reference answers, never seen by the compaction. With ``quotes``, `quote_references` adds that
    many exact-lookup references per text (a sentence's first words given, the rest of it, verbatim from the text, as
    the answer), which generic answers rarely depend on. Then, for every KV head of every global layer
    and every retained fraction ``f``, that head alone is compacted to ``round(f * T)`` entries (``0``: the head is
    removed) with `compact_head` (``method``; a calibrated method gets the repeat-pass queries of the full cache,
    at most ``query_cap`` per KV head), every other head kept whole, and the increase of the answers'
    negative log-likelihood (mean per token, mean over answers, nats) over the full cache is measured. The
    increases, averaged over texts, are the influence curves; `allocate_shares` turns them into the shares (the
    exact rule is documented there).

    CPU-sized defaults: one text of ~1000 tokens, fractions ``(0, 0.02, 0.1)``, three short answers, KV-Surgeon on
    4,096 repeat-pass queries per head (the paper finds budget allocation needs no self-study queries). For bigger
    runs pass more texts, questions and fractions. A query-free ``method`` (``"key_norm"``, ``"streaming_llm"``)
    skips the calibration pass.

    Args:
        texts: documents (plain text) disjoint from any evaluation.
        questions: asked about every text; each is followed by the end of the user turn and the assistant header.
        quotes: exact-lookup references per text (0: only the answers to ``questions``); each answer is cut to
            ``max_answer_tokens`` tokens like the generated ones.
        fractions: strictly increasing retained fractions in ``[0, 1)``.
        method: a key of `HEAD_METHODS`; ``**hparams`` its hyper-parameters.
        target_ratios, solver_steps, floor: see `allocate_shares`.
        seed: for the compaction method and the query subsample.
        text_names: recorded in the provenance beside each text's hash (e.g. the SQuAD article titles).
        progress: a tqdm bar over the (text, head, fraction) probes.

    Returns:
        `HeadBudgets` whose provenance holds the curves (``nll_increase``), the setting, and ``seconds``.
    """
    if isinstance(texts, str) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise ValueError("texts must be a non-empty sequence of non-empty strings (documents)")
    if isinstance(questions, str) or not questions or not all(isinstance(q, str) and q for q in questions):
        raise ValueError("questions must be a non-empty sequence of non-empty strings")
    if text_names is not None and len(text_names) != len(texts):
        raise ValueError(f"text_names must name each of the {len(texts)} texts, got {len(text_names)}")
    fractions = _check_fractions(fractions)
    if method not in HEAD_METHODS:
        raise ValueError(f"method must be one of {sorted(HEAD_METHODS)}, got {method!r}")
    HEAD_METHODS[method](**hparams)  # validates the hyper-parameters before the long measurement
    check_int("max_answer_tokens", max_answer_tokens, 1)
    check_int("query_cap", query_cap, 1)
    check_int("quotes", quotes, 0)
    setting = _ProbeSetting(
        tuple(questions), quotes, tuple(fractions), method, dict(hparams), max_answer_tokens, query_cap, seed
    )
    fingerprint = model_fingerprint(model, tokenizer)
    layers, n_kv = _global_layers(fingerprint), fingerprint["num_key_value_heads"]
    start = time.perf_counter()
    enable(model)
    curves, described = [], []
    total = len(texts) * len(layers) * n_kv * len(fractions)
    with tqdm(total=total, desc=f"head sensitivity ({method})", unit="probe", disable=not progress) as bar:
        for text in texts:
            increases, description = _text_increases(model, tokenizer, text, setting, bar)
            curves.append(increases)
            described.append(description)
    increases = torch.stack(curves).mean(dim=0)  # [global layers * H_kv, K]
    shares = allocate_shares(fractions, increases, target_ratios, solver_steps, floor).tolist()
    if text_names is not None:
        for description, name in zip(described, text_names):
            description["name"] = name
    provenance = {
        "kind": "sensitivity",
        "compaction_method": method,
        "hyperparameters": dict(hparams),
        "calibration": "repeat-pass queries" if HEAD_METHODS[method].needs_queries else "none (query-free)",
        "query_cap_per_head": query_cap,
        "fractions": fractions,
        "questions": list(questions),
        "quotes_per_text": quotes,
        "max_answer_tokens": max_answer_tokens,
        "texts": described,
        "target_ratios": [float(r) for r in target_ratios],
        "solver_steps": solver_steps,
        "floor": floor,
        "seed": seed,
        "nll_increase": {str(layer): increases[i * n_kv : (i + 1) * n_kv].tolist() for i, layer in enumerate(layers)},
        "seconds": round(time.perf_counter() - start, 1),
        "torch_threads": torch.get_num_threads(),
        "device": str(model.device),
        "dtype": str(model.dtype).removeprefix("torch."),
    }
    weights = {layer: shares[i * n_kv : (i + 1) * n_kv] for i, layer in enumerate(layers)}
    return HeadBudgets(weights, fingerprint, provenance)
