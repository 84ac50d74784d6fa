"""Chat prompts split into a reusable context part (compacted once) and a per-question part."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

_MARKER = "\u2063HF_STRUCTKV_QUESTION\u2063"
_DOCUMENT_MARKER = "\u2063HF_STRUCTKV_DOCUMENT\u2063"
QUESTION_TEMPLATE = "Question: {question}\nAnswer in a few words."


def document_chat_parts(tokenizer: PreTrainedTokenizerBase, document: str) -> tuple[str, str, str]:
    """Split one user turn ``document + question`` of the tokenizer's chat template around the document.

    Returns:
        ``(opening, body, question_suffix)``: ``opening`` is the chat scaffold before the document (system turn,
        user-turn header; what `compact`'s ``prefix=`` keeps whole), ``body`` the document with the blank line after
        it, ``question_suffix`` the end of the turn and the assistant header, which follows each question.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("tokenizer has no chat template; pass the context and question texts yourself")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{_DOCUMENT_MARKER}{document}\n\n{_MARKER}"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    opening, rest = text.split(_DOCUMENT_MARKER)
    body, question_suffix = rest.split(_MARKER)
    return opening, body, question_suffix


def document_chat_prompt(tokenizer: PreTrainedTokenizerBase, document: str) -> tuple[str, str]:
    """Split one user turn ``document + question`` of the tokenizer's chat template at the question.

    Returns:
        ``(context_text, question_suffix)``: ``context_text`` is everything up to the question (system turn,
        user-turn header, the document); a question's text is ``QUESTION_TEMPLATE.format(question=q) +
        question_suffix`` (end of turn and the assistant header).
    """
    opening, body, question_suffix = document_chat_parts(tokenizer, document)
    return opening + body, question_suffix


def question_text(question: str, question_suffix: str) -> str:
    """The per-question part that follows the compacted context."""
    return QUESTION_TEMPLATE.format(question=question) + question_suffix
