"""How `HeadBudgets` shares are computed (KV-Surgeon seed, appendix "Compaction ratio and per-head budgets"; restated
in ``design/ALGORITHMS.md`` §1): per-head influence curves (how the log-perplexity of model-generated reference
answers, and optionally of exact-lookup quotes of the text, grows as that head alone is compressed), measured once per
model and solved for shares that are reused for every ratio by rescaling.

* `compute_head_budgets`: measures the influence curves on texts and solves for the shares (`allocate_shares`);
* `quote_references`: the exact-lookup references;
* `influence_curve` / `allocate_shares`: the convex solver.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..attention.modules import attention_scalings
from ..attention.registry import enable
from ..cache.compacted import CompactedCache
from ..eval.reference_answers import ReferenceAnswers
from ..generation import generation_inputs
from ..persistence import model_fingerprint
from ..prompts import document_chat_prompt
from ..validation import check_int
from .budgets import CAP_FRACTION, HeadBudgets, global_layers, is_real
from .context_prefill import prefill_context
from .head_compaction import HEAD_METHODS, compact_head
from .queries import repeat_pass_queries

__all__ = [
    "CALIBRATION_ARTICLES",
    "CALIBRATION_PARAGRAPHS",
    "DEFAULT_FRACTIONS",
    "DEFAULT_QUESTIONS",
    "allocate_shares",
    "compute_head_budgets",
    "influence_curve",
    "quote_references",
]

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
    if not target_ratios or not all(is_real(r) and math.isfinite(r) and r > 0 for r in target_ratios):
        raise ValueError(f"target_ratios must be finite numbers > 0, got {target_ratios!r}")
    if not is_real(floor) or not 0 <= floor <= 1:
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
        or not all(is_real(f) and 0 <= f < 1 for f in values)
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
    layers, n_kv = global_layers(fingerprint), fingerprint["num_key_value_heads"]
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
