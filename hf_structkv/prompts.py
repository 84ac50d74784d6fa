"""Chat prompts split into a reusable context part (compacted once) and a per-question part."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

_MARKER = "\u2063HF_STRUCTKV_QUESTION\u2063"
QUESTION_TEMPLATE = "Question: {question}\nAnswer in a few words."


def document_chat_prompt(tokenizer: PreTrainedTokenizerBase, document: str) -> tuple[str, str]:
    """Split one user turn ``document + question`` of the tokenizer's chat template at the question.

    Returns:
        ``(context_text, question_suffix)``: ``context_text`` is everything up to the question (system turn,
        user-turn header, the document); a question's text is ``QUESTION_TEMPLATE.format(question=q) +
        question_suffix`` (end of turn and the assistant header).
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("tokenizer has no chat template; pass the context and question texts yourself")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{document}\n\n{_MARKER}"}], tokenize=False, add_generation_prompt=True
    )
    context_text, question_suffix = text.split(_MARKER)
    return context_text, question_suffix


def question_text(question: str, question_suffix: str) -> str:
    """The per-question part that follows the compacted context."""
    return QUESTION_TEMPLATE.format(question=question) + question_suffix
