"""Loss-level comparison of every per-head compaction method on real heads (KV-Surgeon seed, appendix "Compensation at
the loss level"; ALGORITHMS.md §1 "Loss-level evaluation").

A real text (SQuAD v2 dev paragraphs, concatenated until the chat-formatted context has at least ``--min-tokens``
tokens) is prefilled once into the embedded model. Every selected KV head is compacted on its own by every method of
`HEAD_METHODS` at every ratio (``floor(T / ratio)`` kept entries), fitted to calibration queries captured once from
the full cache: the repeat pass (the "-fast" tier) at every ratio, and the self-study tier at ``--self-study-ratios``.
Each compacted head is scored on held-out queries it never saw, those of the SQuAD questions about the text, each
asked after the full context (`capture_queries` on a copy of the context cache): the relative held-out loss
``Σ‖ô−o‖² / Σ‖o‖²`` (eq. 4). Reported per method and ratio: median and mean loss over heads, the fraction of heads
where ``kv_surgeon`` has a strictly lower loss than ``loo`` and than ``am_hak``, the wall time of `compact_head`
per head (methods run interleaved head by head, so machine load hits them alike), and the share of heads whose served
cache is worse than plain eviction of its own support (bias 0, original values). The issue's targets are checked on
the repeat tier and printed as met / not met.

    python benchmarks/compaction_loss.py --query-cap 2048 --heldout-cap 2048 --threads 1 \
        --out benchmarks/results/compaction_loss.json --plot docs/img/compaction_loss.png

(all 48 KV heads of the embedded model, about 35 minutes on one CPU thread; ``--layer-stride`` and ``--kv-heads``
subsample the heads, ``--query-cap`` / ``--heldout-cap`` cap the queries, ``--methods`` / ``--ratios`` /
``--self-study-ratios`` shrink the grid).

``--storage bf16 int4`` measures at ratios of **bytes** instead: keys and values are cast to BF16 (the cache a BF16
model holds; this CPU runs the embedded model in FP32, whose cache would be twice the bytes), the byte budget of a head
is ``floor(T (D_k + D_v) 2 / ratio)``, and each method keeps as many entries as its storage format fits in it
(`StorageLayout`: BF16 keys and values, or INT4 codes with per-channel key scales and offsets per ``--key-groups``
kept entries, FP32 biases and row offsets counted); INT4 variants are named ``<method>+int4/g<n>``; ``auto``
(``<method>+auto/g<n>``) is `compact_head_to_bytes(storage="auto")`: the INT4 head or the dtype head of the same
bytes, whichever serves the calibration queries better (and passes the split guard). Their targets
(median INT4 loss <= 0.75x BF16's at 20x and 50x, <= 1x at 10x, no head above 1.5x) are printed and stored under
``int4_targets``:

    python benchmarks/compaction_loss.py --storage bf16 int4 auto --key-groups none 32 --methods kv_surgeon \
        --ratios 10 20 50 --self-study-ratios --threads 1 --out benchmarks/results/compaction_loss_int4.json

``--storage nf4`` adds bitsandbytes' blockwise NF4 at the same bytes (`nf4_heads.py`: codes and one FP32 absmax per
``--nf4-blocksize`` elements; keys flattened per ``--nf4-keys`` layout, ``tokens`` and/or ``channels``), fitted as
our INT4 is but without its per-head fallback to BF16; variants ``<method>+nf4/<layout>``, beside our INT4 heads
without that fallback, ``<method>+int4/g<n>/unguarded`` (one per ``--key-groups``), the like-for-like comparison:

    python benchmarks/compaction_loss.py --storage bf16 int4 nf4 --nf4-keys tokens channels --key-groups 32 \
        --methods kv_surgeon --ratios 10 20 50 --self-study-ratios --threads 1 \
        --out benchmarks/results/compaction_loss_nf4.json

``--tiny`` runs the same code on a random tiny model with random text (a smoke test, numbers meaningless).
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import string
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import transformers
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_structkv.attention.modules import attention_scalings
from hf_structkv.attention.recording import capture_queries
from hf_structkv.compaction import (
    HEAD_METHODS,
    CompactedHead,
    SelfStudy,
    compact_head,
    compact_head_to_bytes,
    prefill_context,
    relative_loss,
)
from hf_structkv.compaction.head_storage import STORAGES, StorageLayout
from hf_structkv.compaction.quantized_refit import quantize_head
from hf_structkv.compaction.queries import cap_queries, repeat_pass_queries
from hf_structkv.compaction.self_study import self_study_queries
from hf_structkv.eval.squad import squad_document, squad_titles
from hf_structkv.generation import context_copy
from hf_structkv.models import load_default_model, tiny_byte_tokenizer, tiny_model
from hf_structkv.prompts import document_chat_prompt, question_text

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's helpers, also when imported by path
from nf4_heads import BLOCKSIZES, KEY_LAYOUTS, NF4Layout, NF4Storage, compact_quantized  # noqa: E402
from results_json import write_json  # noqa: E402

TIERS = ("repeat", "self_study")
STORAGE_DTYPE = torch.bfloat16  # --storage: keys and values as a BF16 cache holds them; ratios are of its bytes
TARGET_INT4_MEDIAN = {10: 1.0, 20: 0.75, 50: 0.75}  # median int4 loss <= factor x bf16's, kv_surgeon, same bytes
TARGET_INT4_WORST_HEAD = 1.5  # no head's int4 loss above 1.5x its bf16 loss
TARGET_BEATS_LOO = 0.9  # at 10x, kv_surgeon beats loo on >= 90% of heads
TARGET_TIME_FACTOR = 1.5  # at 50x, kv_surgeon's time per head <= 1.5x loo's
SELF_STUDY_PLOTTED = ("kv_surgeon", "loo", "am_hak")


@dataclass(frozen=True)
class Workload:
    """A context and its held-out questions, tokenized for ``model``.

    Attributes:
        context_ids: ``[1, T]`` the chat-formatted context (system turn, user-turn header, the text).
        question_ids: one ``[1, q]`` per question: the question and the end of the user turn / assistant header.
        question_suffix: the end of the user turn and the assistant header (self-study prompts end with it too).
        source: what the text is (titles, paragraphs, questions), for the JSON.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    context_ids: torch.Tensor
    question_ids: list[torch.Tensor]
    question_suffix: str
    source: dict


@dataclass(frozen=True)
class Variant:
    """One compacted cache to measure: a method stored in one format (``key_group`` for INT4 keys, ``guarded``: with
    INT4's per-head fallback to BF16; ``nf4_keys`` and ``nf4_blocksize`` for NF4)."""

    method: str
    storage: str = "bf16"
    key_group: int | None = None
    guarded: bool = True
    nf4_keys: str | None = None
    nf4_blocksize: int = 64

    @property
    def label(self) -> str:
        """The method's name for BF16, ``"<method>+int4"`` (``"+int4/g<n>"`` with key groups of ``n``) for INT4."""
        if self.storage == "bf16":
            return self.method
        if self.storage == "nf4":
            return f"{self.method}+nf4/{self.nf4_keys}" + (
                "" if self.nf4_blocksize == 64 else f"/b{self.nf4_blocksize}"
            )
        group = "" if self.key_group is None else f"/g{self.key_group}"
        return f"{self.method}+{self.storage}{group}" + ("" if self.guarded else "/unguarded")

    def compact(
        self, keys, values, queries, budget: int, nbytes: int | None, scaling: float | None, seed: int
    ) -> CompactedHead:
        """The head of ``budget`` kept entries in this variant's format (`compact_head`, or `nf4_heads`); ``"auto"``
        chooses within ``nbytes`` (`compact_head_to_bytes`)."""
        if self.storage == "auto":
            return compact_head_to_bytes(
                keys, values, queries, nbytes, self.method, scaling, seed, self.storage, self.key_group
            )
        if self.storage == "nf4":
            store = NF4Storage(self.nf4_keys, self.nf4_blocksize)
        elif not self.guarded:
            store = partial(quantize_head, key_group=self.key_group)
        else:
            return compact_head(keys, values, queries, budget, self.method, scaling, seed, self.storage, self.key_group)
        return compact_quantized(keys, values, queries, budget, store, self.method, scaling, seed)

    def budget(self, length: int, ratio: float, dims: tuple[int, int] | None) -> tuple[int, int | None]:
        """``(kept entries, byte budget)``: ``floor(T / ratio)`` entries (``dims`` None: ratios of entries), or the
        most entries whose bytes fit ``floor(full BF16 bytes / ratio)`` (``dims = (D_k, D_v)``)."""
        if dims is None:
            return max(1, math.floor(length / ratio)), None
        element = torch.empty(0, dtype=STORAGE_DTYPE).element_size()
        nbytes = math.floor(length * sum(dims) * element / ratio)
        if self.storage == "nf4":
            layout = NF4Layout(*dims, self.nf4_blocksize)
        else:
            storage = "int4" if self.storage == "auto" else self.storage  # auto: the most INT4 entries
            layout = StorageLayout(storage, *dims, element_bytes=element, key_group=self.key_group)
        return max(1, layout.entries_for(nbytes)), nbytes


def _encode(tokenizer: PreTrainedTokenizerBase, text: str) -> torch.Tensor:
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids


def _workload(model, tokenizer, text: str, questions: list[str], source: dict) -> Workload:
    context_text, suffix = document_chat_prompt(tokenizer, text)
    question_ids = [_encode(tokenizer, question_text(question, suffix)) for question in questions]
    return Workload(model, tokenizer, _encode(tokenizer, context_text), question_ids, suffix, source)


def squad_workload(first_title: str, min_tokens: int, max_questions: int) -> Workload:
    """SQuAD dev paragraphs from ``first_title`` on (then the following articles), added one at a time until the chat
    context has ``>= min_tokens`` tokens; at most ``max_questions`` of their answerable questions, evenly spread."""
    model, tokenizer = load_default_model()
    titles = squad_titles()
    if first_title not in titles:
        raise ValueError(f"--article must be a SQuAD dev title, one of {titles}; got {first_title!r}")
    taken: list[tuple[str, int]] = []
    for title in titles[titles.index(first_title) :]:
        available = len(squad_document(title).text.split("\n\n"))
        for paragraphs in range(1, available + 1):
            documents = [squad_document(t, n) for t, n in [*taken, (title, paragraphs)]]
            text = "\n\n".join(document.text for document in documents)
            if _encode(tokenizer, document_chat_prompt(tokenizer, text)[0]).shape[1] >= min_tokens:
                taken.append((title, paragraphs))
                return _squad_questions(model, tokenizer, text, documents, taken, max_questions)
        taken.append((title, available))
    raise ValueError(f"the SQuAD dev articles from {first_title!r} on have fewer than {min_tokens} tokens")


def _squad_questions(model, tokenizer, text, documents, taken, max_questions: int) -> Workload:
    questions = [question.question for document in documents for question in document.questions]
    step = max(1, len(questions) // max_questions)
    questions = questions[::step][:max_questions]
    source = {"dataset": "SQuAD v2 dev", "articles": [{"title": t, "paragraphs": n} for t, n in taken]}
    return _workload(model, tokenizer, text, questions, source)


def tiny_workload(min_tokens: int, max_questions: int, seed: int) -> Workload:
    """A random tiny Qwen2 model (byte tokenizer) and random words: a smoke test of the whole benchmark."""
    rng = random.Random(seed)

    def words(count: int) -> str:
        return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 7))) for _ in range(count))

    text = words(max(1, min_tokens // 5))
    questions = [words(5) + "?" for _ in range(max_questions)]
    model = tiny_model("qwen2", seed=seed, vocab_size=300)
    return _workload(model, tiny_byte_tokenizer(), text, questions, {"dataset": "random words (--tiny)"})


def heldout_queries(model, context_cache, question_ids: list[torch.Tensor], cap: int, seed: int) -> dict:
    """Queries of every question's tokens, each question run alone after the full context.

    Returns:
        ``{layer: [H_kv, min(g * Σq, cap), D]}`` (seeded subsample per KV head).
    """
    captures = [capture_queries(model, ids, cache=context_copy(context_cache)) for ids in question_ids]
    stacked = {layer: torch.cat([capture[layer] for capture in captures], dim=1) for layer in captures[0]}
    return cap_queries(stacked, cap, seed)


def calibration_queries(tier: str, workload: Workload, context_cache, cap: int, seed: int, tokens: int) -> dict:
    """``{layer: [H_kv, <= cap, D]}`` of the repeat pass or the self-study conversations (``tokens`` per answer),
    captured once from the full cache."""
    model, tokenizer, ids = workload.model, workload.tokenizer, workload.context_ids
    if tier == "repeat":
        return repeat_pass_queries(model, tokenizer, ids, cap=cap, seed=seed, context_cache=context_cache)
    config = SelfStudy(answer_tokens=tokens, question_tokens=2 * tokens, turn_suffix=workload.question_suffix)
    return self_study_queries(model, tokenizer, ids, context_cache, config, cap=cap, seed=seed)


def selected_heads(cache, layer_stride: int, kv_heads: int | None) -> list[tuple[int, int]]:
    """``(layer, kv head)`` pairs: every ``layer_stride``-th global layer, its first ``kv_heads`` KV heads."""
    global_layers = [i for i, layer in enumerate(cache.layers) if not layer.is_sliding]
    return [
        (layer, head)
        for layer in global_layers[::layer_stride]
        for head in range(min(cache.layers[layer].keys.shape[1], kv_heads or math.inf))
    ]


def evaluate_heads(
    cache,
    heads,
    calibration: dict,
    heldout: dict,
    ratios,
    variants,
    scalings: dict,
    seed: int,
    tier: str,
    by_bytes: bool,
) -> list[dict]:
    """Compact every head with every variant at every ratio; one record per (head, ratio, variant) with the held-out
    loss of the served head and of plain eviction of the same support (bias 0, original values). ``by_bytes``: ratios
    of bytes (keys and values cast to BF16 first), else of entries."""
    records = []
    length = cache.get_seq_length()
    for number, (layer, head) in enumerate(heads, start=1):
        keys, values = cache.layers[layer].keys[0, head], cache.layers[layer].values[0, head]
        if by_bytes:
            keys, values = keys.to(STORAGE_DTYPE), values.to(STORAGE_DTYPE)
        dims = (keys.shape[1], values.shape[1]) if by_bytes else None
        fit, held = calibration[layer][head], heldout[layer][head]
        scaling = scalings.get(layer)
        started = time.perf_counter()
        for ratio in ratios:
            for variant in variants:
                budget, nbytes = variant.budget(length, ratio, dims)
                start = time.perf_counter()
                compacted = variant.compact(keys, values, fit, budget, nbytes, scaling, seed)
                seconds = time.perf_counter() - start
                record = {"tier": tier, "ratio": ratio, "method": variant.label, "layer": layer, "kv_head": head}
                record |= {"budget": budget, "seconds": seconds, "train_loss": compacted.train_loss}
                if by_bytes:
                    record |= {"byte_budget": nbytes, "bytes": compacted.nbytes(keys.shape[1])}
                    record |= {"storage": variant.storage, "storage_used": compacted.storage}
                    record |= {"key_group": variant.key_group, "storage_fallback": compacted.storage_fallback}
                    record["kept"] = int(compacted.indices.numel())
                record["heldout_loss"] = relative_loss(compacted, keys, held, values, scaling)
                evicted = CompactedHead(compacted.indices, torch.zeros_like(compacted.bias), values[compacted.indices])
                record["heldout_eviction_loss"] = relative_loss(evicted, keys, held, values, scaling)
                records.append(record)
        elapsed = time.perf_counter() - started
        print(f"  [{tier}] head {number}/{len(heads)} (layer {layer}, kv head {head}): {elapsed:.1f}s", flush=True)
    return records


def storage_verdicts(records: list[dict], method: str = "kv_surgeon") -> list[dict]:
    """The INT4 targets on the repeat tier, per INT4 variant of ``method`` against its BF16 at the same bytes: median
    held-out loss at most `TARGET_INT4_MEDIAN` times BF16's at each ratio, and no head above `TARGET_INT4_WORST_HEAD`
    times its BF16 loss; with the measured medians, worst head ratio and fallback share."""
    repeat = [r for r in records if r["tier"] == "repeat" and r.get("storage") is not None]
    losses = {(r["ratio"], r["method"], r["layer"], r["kv_head"]): r for r in repeat}
    verdicts = []
    for label in sorted({r["method"] for r in repeat if r["method"].startswith(f"{method}+")}):
        for ratio in sorted({r["ratio"] for r in repeat}):
            pairs = [
                (row["heldout_loss"], losses[(ratio, method, layer, head)]["heldout_loss"], row["storage_fallback"])
                for (r, m, layer, head), row in losses.items()
                if r == ratio and m == label and (ratio, method, layer, head) in losses
            ]
            if not pairs:
                continue
            int4 = statistics.median(p[0] for p in pairs)
            bf16 = statistics.median(p[1] for p in pairs)
            worst = max(p[0] / p[1] if p[1] > 0 else (1.0 if p[0] == 0 else math.inf) for p in pairs)
            factor = TARGET_INT4_MEDIAN.get(int(ratio)) if float(ratio).is_integer() else None
            median_met = None if factor is None else int4 <= factor * bf16
            verdicts.append(
                {
                    "target": f"{ratio:g}x bytes: {label} median <= {factor}x {method}'s, no head > "
                    f"{TARGET_INT4_WORST_HEAD}x"
                    if factor is not None
                    else f"{ratio:g}x bytes: {label} vs {method} (no target at this ratio)",
                    "variant": label,
                    "ratio": ratio,
                    "median_int4": int4,
                    "median_bf16": bf16,
                    "median_ratio": int4 / bf16 if bf16 > 0 else math.inf,
                    "worst_head_ratio": worst,
                    "fallback_share": statistics.fmean(p[2] for p in pairs),
                    "heads": len(pairs),
                    "measured": f"median {int4:.4f} vs {bf16:.4f} ({int4 / bf16:.2f}x), worst head {worst:.2f}x",
                    "met": None if median_met is None else median_met and worst <= TARGET_INT4_WORST_HEAD,
                }
            )
    return verdicts


def summarize(records: list[dict]) -> dict:
    """``{tier: {ratio: {method: {median_loss, mean_loss, seconds_per_head, median_seconds, worse_than_eviction,
    heads}}}}`` (ratios as strings); ``worse_than_eviction`` is the share of heads whose served cache has a higher
    held-out loss than plain eviction of its support."""
    groups: dict = {}
    for record in records:
        key = (record["tier"], record["ratio"], record["method"])
        groups.setdefault(key, []).append(record)
    summary: dict = {}
    for (tier, ratio, method), rows in groups.items():
        losses = [row["heldout_loss"] for row in rows]
        summary.setdefault(tier, {}).setdefault(_ratio_key(ratio), {})[method] = {
            "median_loss": statistics.median(losses),
            "mean_loss": statistics.fmean(losses),
            "seconds_per_head": statistics.fmean(row["seconds"] for row in rows),
            "median_seconds": statistics.median(row["seconds"] for row in rows),
            "worse_than_eviction": statistics.fmean(row["heldout_loss"] > row["heldout_eviction_loss"] for row in rows),
            "heads": len(rows),
        }
    return summary


def _ratio_key(ratio: float) -> str:
    return f"{ratio:g}"


def win_fractions(records: list[dict], challenger: str = "kv_surgeon", rivals=("loo", "am_hak")) -> dict:
    """``{tier: {ratio: {rival: fraction of heads where challenger's held-out loss < rival's}}}``."""
    losses = {(r["tier"], r["ratio"], r["method"], r["layer"], r["kv_head"]): r["heldout_loss"] for r in records}
    fractions: dict = {}
    for tier, ratio, method, layer, head in losses:
        if method != challenger:
            continue
        for rival in rivals:
            if (tier, ratio, rival, layer, head) not in losses:
                continue
            wins = losses[(tier, ratio, challenger, layer, head)] < losses[(tier, ratio, rival, layer, head)]
            counts = fractions.setdefault(tier, {}).setdefault(_ratio_key(ratio), {}).setdefault(rival, [0, 0])
            counts[0], counts[1] = counts[0] + wins, counts[1] + 1
    return {
        tier: {ratio: {rival: wins / total for rival, (wins, total) in per.items()} for ratio, per in by_ratio.items()}
        for tier, by_ratio in fractions.items()
    }


def target_verdicts(summary: dict, fractions: dict, ratios) -> list[dict]:
    """The issue's three targets on the repeat tier, each with the measured numbers and met / not met (or not run)."""
    repeat, wins = summary.get("repeat", {}), fractions.get("repeat", {})
    verdicts = []
    beats = wins.get("10", {}).get("loo")
    verdicts.append(
        {
            "target": "at 10x kv_surgeon beats loo on >= 90% of heads",
            "measured": None if beats is None else f"{beats:.1%} of heads",
            "met": None if beats is None else beats >= TARGET_BEATS_LOO,
        }
    )
    checked = [ratio for ratio in ratios if ratio >= 10 and "kv_surgeon" in repeat.get(_ratio_key(ratio), {})]
    lowest = []
    for ratio in checked:
        per_method = repeat[_ratio_key(ratio)]
        best = min(per_method, key=lambda m: per_method[m]["median_loss"])
        kv = per_method["kv_surgeon"]["median_loss"]
        lowest.append((ratio, best, kv, per_method[best]["median_loss"]))
    verdicts.append(
        {
            "target": "at every ratio >= 10x kv_surgeon has the lowest median loss of all methods",
            "measured": "; ".join(
                f"{r:g}x: kv_surgeon {kv:.4f}" + (" lowest" if best == "kv_surgeon" else f", lowest {best} {value:.4f}")
                for r, best, kv, value in lowest
            )
            or None,
            "met": all(best == "kv_surgeon" for _, best, _, _ in lowest) if lowest else None,
        }
    )
    at50 = repeat.get("50", {})
    if "kv_surgeon" in at50 and "loo" in at50:
        factor = at50["kv_surgeon"]["seconds_per_head"] / at50["loo"]["seconds_per_head"]
        measured, met = f"{factor:.2f}x loo's time per head", factor <= TARGET_TIME_FACTOR
    else:
        measured, met = None, None
    verdicts.append({"target": "at 50x kv_surgeon's time per head <= 1.5x loo's", "measured": measured, "met": met})
    return verdicts


def _markdown_table(by_ratio: dict, methods, ratios, columns: dict) -> None:
    """One row per method, one column per (column name, ratio); ``columns`` maps a name to a cell formatter."""
    shown = [r for r in ratios if _ratio_key(r) in by_ratio]
    print("| method | " + " | ".join(f"{r:g}x {name}" for name in columns for r in shown) + " |")
    print("|---|" + "---:|" * (len(columns) * len(shown)))
    for method in methods:
        cells = [by_ratio[_ratio_key(r)].get(method) for r in shown]
        if any(cells):
            row = [format_cell(c) if c else "" for format_cell in columns.values() for c in cells]
            print(f"| {method} | " + " | ".join(row) + " |")


def print_report(summary: dict, fractions: dict, verdicts: list[dict], methods, ratios) -> None:
    """Markdown tables per calibration tier (median / mean held-out loss and ms per head; share of heads where the
    served cache is worse than eviction of its support), kv_surgeon's win fractions, and the targets."""
    for tier, by_ratio in summary.items():
        print(f"\nheld-out relative loss, calibration tier {tier!r}\n")
        _markdown_table(
            by_ratio,
            methods,
            ratios,
            {
                "median / mean": lambda c: f"{c['median_loss']:.4f} / {c['mean_loss']:.4f}",
                "ms/head": lambda c: f"{1000 * c['seconds_per_head']:.0f}",
            },
        )
        print(f"\nshare of heads where the served cache is worse than eviction of its support, tier {tier!r}\n")
        _markdown_table(by_ratio, methods, ratios, {"worse": lambda c: f"{c['worse_than_eviction']:.0%}"})
        if tier in fractions:
            print(f"\nkv_surgeon beats (tier {tier!r}): ", end="")
            print(
                "; ".join(
                    f"{ratio}x: " + ", ".join(f"{rival} on {value:.1%}" for rival, value in per.items())
                    for ratio, per in fractions[tier].items()
                )
            )
    print("\ntargets (repeat tier)")
    for verdict in verdicts:
        state = {True: "MET", False: "NOT MET", None: "NOT RUN"}[verdict["met"]]
        print(f"- {verdict['target']}: {state} ({verdict['measured']})")


def plot_losses(summary: dict, methods, path: Path, title: str) -> None:
    """Median held-out loss vs ratio, log-log, one line per method (repeat tier), dashed for the self-study tier of
    the methods in ``SELF_STUDY_PLOTTED``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(10, 5.5))
    palette = plt.get_cmap("tab20").colors
    colors = palette[::2] + palette[1::2]  # the ten dark shades first, so neighbours in the legend differ
    ratios = set()
    for index, method in enumerate(methods):
        for tier, style in (("repeat", "-o"), ("self_study", "--s")):
            if tier == "self_study" and method not in SELF_STUDY_PLOTTED:
                continue
            by_ratio = summary.get(tier, {})
            points = sorted((float(r), cell[method]["median_loss"]) for r, cell in by_ratio.items() if method in cell)
            if not points:
                continue
            ratios.update(ratio for ratio, _ in points)
            label = method if tier == "repeat" else f"{method} (self-study)"
            width = 2.5 if method == "kv_surgeon" else 1.2
            axes.plot(*zip(*points), style, color=colors[index % len(colors)], label=label, linewidth=width, ms=4)
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xticks(sorted(ratios), [f"{ratio:g}x" for ratio in sorted(ratios)])
    axes.minorticks_off()
    axes.set_xlabel("compression ratio (original / kept entries per KV head)")
    axes.set_ylabel("median held-out relative loss  Σ‖ô−o‖² / Σ‖o‖²")
    axes.set_title(title, fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--article", default="Normans", help="first SQuAD dev article of the text")
    parser.add_argument("--min-tokens", type=int, default=2000, help="context length (chat-formatted), at least")
    parser.add_argument("--questions", type=int, default=48, help="held-out questions, at most (evenly spread)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[5, 10, 20, 50, 100])
    parser.add_argument("--methods", nargs="+", default=sorted(HEAD_METHODS), choices=sorted(HEAD_METHODS))
    parser.add_argument("--self-study-ratios", type=float, nargs="*", default=[50, 100])
    parser.add_argument("--self-study-tokens", type=int, default=48, help="max tokens per self-study answer")
    parser.add_argument("--layer-stride", type=int, default=1, help="every n-th global layer")
    parser.add_argument("--kv-heads", type=int, default=None, help="first n KV heads of each layer (default all)")
    parser.add_argument("--query-cap", type=int, default=4096, help="calibration queries per KV head")
    parser.add_argument("--heldout-cap", type=int, default=4096, help="held-out queries per KV head")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--storage",
        nargs="+",
        default=None,
        choices=(*STORAGES, "auto", "nf4"),
        help="ratios of bytes (keys and values cast to BF16), each method stored in each format; default: ratios of "
        "entries in the model's dtype",
    )
    parser.add_argument(
        "--key-groups",
        nargs="+",
        default=["none"],
        help="with --storage int4: kept entries per row of key scales, one variant each ('none': one row per head, "
        "the library's default)",
    )
    parser.add_argument(
        "--nf4-keys",
        nargs="+",
        default=["tokens"],
        choices=KEY_LAYOUTS,
        help="with --storage nf4: how kept keys [t, D] are flattened into NF4 blocks, one variant each",
    )
    parser.add_argument(
        "--nf4-blocksize", type=int, default=64, choices=BLOCKSIZES, help="with --storage nf4: elements per absmax"
    )
    parser.add_argument("--tiny", action="store_true", help="random tiny model and random text (smoke test)")
    parser.add_argument("--out", default="benchmarks/results/compaction_loss.json")
    parser.add_argument("--plot", default=None, help="write the loss-vs-ratio plot (PNG) here")
    args = parser.parse_args(argv)
    for name in ("layer_stride", "query_cap", "heldout_cap", "threads", "questions", "min_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(not 1 <= ratio < math.inf for ratio in args.ratios + args.self_study_ratios):
        raise ValueError("--ratios and --self-study-ratios must be finite numbers >= 1")
    key_groups = [None if group.lower() == "none" else int(group) for group in args.key_groups]
    if any(group is not None and group < 1 for group in key_groups):
        raise ValueError(f"--key-groups must be positive integers or 'none', got {args.key_groups}")
    variants = [
        Variant(method, storage, group)
        for method in args.methods
        for storage in args.storage or ["bf16"]
        for group in (key_groups if storage in ("int4", "auto") else [None])
        if storage != "nf4"
    ]
    if "nf4" in (args.storage or []):
        variants += [Variant(method, "int4", group, guarded=False) for method in args.methods for group in key_groups]
        variants += [
            Variant(method, "nf4", nf4_keys=layout, nf4_blocksize=args.nf4_blocksize)
            for method in args.methods
            for layout in args.nf4_keys
        ]
    torch.set_num_threads(args.threads)
    started = time.perf_counter()

    if args.tiny:
        workload = tiny_workload(args.min_tokens, args.questions, args.seed)
    else:
        workload = squad_workload(args.article, args.min_tokens, args.questions)
    model = workload.model
    cache = prefill_context(model, workload.context_ids, prefill_chunk_tokens=1024)
    length = cache.get_seq_length()
    heads = selected_heads(cache, args.layer_stride, args.kv_heads)
    print(f"context {length} tokens, {len(workload.question_ids)} held-out questions, {len(heads)} KV heads")
    heldout = heldout_queries(model, cache, workload.question_ids, args.heldout_cap, args.seed)
    scalings = attention_scalings(model)
    tier_ratios = {"repeat": args.ratios, "self_study": args.self_study_ratios}
    records, query_counts, tier_seconds = [], {}, {}
    for tier in TIERS:
        if not tier_ratios[tier]:
            continue
        start = time.perf_counter()
        calibration = calibration_queries(tier, workload, cache, args.query_cap, args.seed, args.self_study_tokens)
        tier_seconds[f"{tier}_capture"] = time.perf_counter() - start
        query_counts[tier] = int(next(iter(calibration.values())).shape[1])
        print(f"calibration tier {tier!r}: {query_counts[tier]} queries per KV head")
        start = time.perf_counter()
        records += evaluate_heads(
            cache,
            heads,
            calibration,
            heldout,
            tier_ratios[tier],
            variants,
            scalings,
            args.seed,
            tier,
            bool(args.storage),
        )
        tier_seconds[f"{tier}_compaction"] = time.perf_counter() - start

    summary = summarize(records)
    fractions = win_fractions(records)
    verdicts = target_verdicts(summary, fractions, args.ratios)
    labels = list(dict.fromkeys(variant.label for variant in variants))
    print_report(summary, fractions, verdicts, labels, sorted(set(args.ratios + args.self_study_ratios)))
    int4_verdicts = storage_verdicts(records)
    for verdict in int4_verdicts:
        state = {True: "MET", False: "NOT MET", None: "-"}[verdict["met"]]
        print(f"- {verdict['target']}: {state} ({verdict['measured']}, fallback on {verdict['fallback_share']:.0%})")
    payload = {
        "settings": {key: value for key, value in vars(args).items() if key not in ("out", "plot")},
        "environment": {
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "model": type(model).__name__ + (" (tiny, random)" if args.tiny else " (embedded Qwen2.5-Coder-0.5B)"),
        },
        "text": {**workload.source, "context_tokens": length, "questions": len(workload.question_ids)},
        "heads": [list(pair) for pair in heads],
        "queries_per_kv_head": {"heldout": int(next(iter(heldout.values())).shape[1]), **query_counts},
        "seconds": {**tier_seconds, "total": time.perf_counter() - started},
        "summary": summary,
        "kv_surgeon_beats": fractions,
        "targets": verdicts,
        "int4_targets": int4_verdicts,
        "records": records,
    }
    payload = write_json(args.out, payload, started=started)
    print(f"wrote {args.out}")
    if args.plot:
        title = f"{payload['environment']['model']}, {length}-token context, {len(heads)} KV heads"
        plot_losses(summary, labels, Path(args.plot), title)
        print(f"wrote {args.plot}")
    return payload


if __name__ == "__main__":
    main()
