"""Chat prompt split (context part + per-question part) and the offline SQuAD data and metric."""

import pytest

from hf_structkv.eval.squad import (
    SquadDocument,
    SquadQuestion,
    contains_answer,
    normalize_answer,
    squad_document,
    squad_titles,
)
from hf_structkv.prompts import QUESTION_TEMPLATE, document_chat_parts, document_chat_prompt, question_text


class FakeChatTokenizer:
    """The one method ``document_chat_parts`` needs, with a bracketed toy template."""

    chat_template = "toy"

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        self.calls.append((messages, tokenize, add_generation_prompt))
        (message,) = messages
        return f"[sys][{message['role']}]{message['content']}[/turn][assistant]"


# ---------------------------------------------------------------------------------------------------- prompts
def test_question_text_is_the_template_and_the_suffix():
    assert QUESTION_TEMPLATE == "Question: {question}\nAnswer in a few words."
    assert question_text("Who?", "<end>") == "Question: Who?\nAnswer in a few words.<end>"


def test_split_at_the_question_with_a_toy_template():
    tokenizer = FakeChatTokenizer()
    context_text, suffix = document_chat_prompt(tokenizer, "The document.")
    assert context_text == "[sys][user]The document.\n\n"
    assert suffix == "[/turn][assistant]"
    [(messages, tokenize, add_generation_prompt)] = tokenizer.calls
    assert tokenize is False and add_generation_prompt is True
    assert messages[0]["role"] == "user"


def test_parts_around_the_document_with_a_toy_template():
    opening, body, suffix = document_chat_parts(FakeChatTokenizer(), "The document.")
    assert (opening, body, suffix) == ("[sys][user]", "The document.\n\n", "[/turn][assistant]")
    assert document_chat_prompt(FakeChatTokenizer(), "The document.") == (opening + body, suffix)


@pytest.mark.parametrize("template", [None, ""])
def test_tokenizer_without_chat_template(template):
    class NoTemplate:
        chat_template = template

    with pytest.raises(ValueError, match="tokenizer has no chat template; pass the context and question texts"):
        document_chat_prompt(NoTemplate(), "doc")
    with pytest.raises(ValueError, match="tokenizer has no chat template"):
        document_chat_prompt(object(), "doc")
    with pytest.raises(ValueError, match="tokenizer has no chat template"):
        document_chat_parts(NoTemplate(), "doc")


@pytest.mark.slow
def test_split_equals_the_chat_template_of_the_whole_turn(default_model):
    _, tokenizer = default_model
    document = squad_document("Normans", 2)
    question = document.questions[0].question
    context_text, suffix = document_chat_prompt(tokenizer, document.text)
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": document.text + "\n\n" + QUESTION_TEMPLATE.format(question=question)}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert context_text + question_text(question, suffix) == expected
    assert context_text.startswith("<|im_start|>system\n")
    opening, body, _ = document_chat_parts(tokenizer, document.text)
    assert opening.startswith("<|im_start|>system\n") and opening.endswith("<|im_start|>user\n")
    assert body == document.text + "\n\n"
    assert context_text.endswith("<|im_start|>user\n" + document.text + "\n\n")
    assert suffix == "<|im_end|>\n<|im_start|>assistant\n"


# ---------------------------------------------------------------------------------------------------- SQuAD data
def test_squad_titles():
    titles = squad_titles()
    assert len(titles) == 35 == len(set(titles))
    assert titles[:3] == ["Normans", "Computational_complexity_theory", "Southern_California"]


def test_squad_document_first_paragraphs():
    document = squad_document("Normans", 2)
    assert isinstance(document, SquadDocument) and document.title == "Normans"
    paragraphs = document.text.split("\n\n")
    assert len(paragraphs) == 2
    assert paragraphs[0].startswith("The Normans (Norman: Nourmands; French: Normands; Latin: Normanni) were")
    assert len(document.questions) == 8
    assert document.questions[0] == SquadQuestion("In what country is Normandy located?", ("France",))
    assert all(q.answers and len(set(q.answers)) == len(q.answers) for q in document.questions)


def test_squad_document_whole_article_and_limits():
    whole = squad_document("Normans")
    assert len(whole.text.split("\n\n")) == 39
    assert len(whole.questions) == 96
    assert squad_document("Normans", 1000) == whole
    first = squad_document("Normans", 1)
    assert whole.text.startswith(first.text + "\n\n")
    assert whole.questions[: len(first.questions)] == first.questions


def test_squad_answers_are_deduplicated():
    """Imperialism: 'interventionism' is given four times (and '.' once) by the annotators."""
    document = squad_document("Imperialism")
    (question,) = [q for q in document.questions if q.question.startswith("What was the name of Theodore Roosevelt")]
    assert question.answers == ("interventionism", ".")


def test_squad_document_unknown_title():
    with pytest.raises(ValueError, match=r"title must be a SQuAD dev article, one of \[.*'Normans'.*\]; got 'Vikings'"):
        squad_document("Vikings")


# ---------------------------------------------------------------------------------------------------- metric
@pytest.mark.parametrize(
    "text, expected",
    [
        ("The Eiffel  Tower!", "eiffel tower"),
        ("A cat, an apple and THE dog.", "cat apple and dog"),
        ("Theory of anthems", "theory of anthems"),  # articles only as whole words
        ("U.S.A.", "usa"),
        ("  \tnew\nline ", "new line"),
        ("...", ""),
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_contains_answer():
    assert contains_answer("It is located in France.", ("France",))
    assert contains_answer("the NORMANS", ("Normans", "Norsemen"))
    assert contains_answer("Norsemen, mostly", ("Normans", "Norsemen"))
    assert not contains_answer("Germany", ("France", "Normandy"))
    assert not contains_answer("anything", ())


def test_an_answer_that_normalises_to_nothing_matches_nothing():
    """SQuAD lists '.' as a gold answer of a few questions; it must not make every prediction correct."""
    assert not contains_answer("I do not know", ("interventionism", "."))
    assert contains_answer("Interventionism.", ("interventionism", "."))
