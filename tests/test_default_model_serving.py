"""The embedded real model serves compacted caches (slow: loads Qwen2.5-Coder-0.5B)."""

import copy

import pytest
import torch

import hf_structkv
from hf_structkv import CompactedCache
from hf_structkv.compaction import compact, prefill_context
from hf_structkv.eval.squad import contains_answer, squad_document
from hf_structkv.generation import generation_inputs
from hf_structkv.prompts import document_chat_prompt, question_text

pytestmark = pytest.mark.slow

# Two questions on SQuAD's "Normans" (3 paragraphs, 577 context tokens) whose answers the model only gives from the
# document: without it (the prompt's document "(no document)") it replies "The Norse leader was Odin." and "... was
# first recorded in 1919.". Measured on CPU in float32, greedy: the full cache replies "Rollo"; StreamingLLM at 4x (the
# sinks and the last quarter of the context, which holds the last paragraph) replies "In 9th century.".
FIRST_PARAGRAPH_QUESTION = "Who was the Norse leader?"  # gold "Rollo"
LAST_PARAGRAPH_QUESTION = "When was the Latin version of the word Norman first recorded?"  # gold "9th century"


@pytest.fixture(scope="module")
def normans(default_model):
    """``(context_ids [1, T], questions)``: the chat-formatted document and ``{question: (question_ids [1, Q],
    gold answers)}``."""
    _, tokenizer = default_model
    document = squad_document("Normans", 3)
    context_text, suffix = document_chat_prompt(tokenizer, document.text)
    context_ids = tokenizer(context_text, return_tensors="pt", add_special_tokens=False).input_ids
    questions = {
        item.question: (
            tokenizer(question_text(item.question, suffix), return_tensors="pt", add_special_tokens=False).input_ids,
            item.answers,
        )
        for item in document.questions
    }
    return context_ids, questions


def greedy(model, cache, question_ids, n=24):
    inputs = generation_inputs(cache, question_ids)
    with torch.no_grad():
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :]


def assert_answers(tokenizer, reply, gold):
    """The decoded greedy ``reply [n]`` contains one of the ``gold`` answers (SQuAD normalisation)."""
    text = tokenizer.decode(reply, skip_special_tokens=True)
    assert contains_answer(text, gold), f"reply {text!r} does not contain any of {gold}"


def test_keep_everything_generates_like_dynamic_cache(default_model, normans):
    model, tokenizer = default_model
    context_ids, questions = normans
    question_ids, gold = questions[FIRST_PARAGRAPH_QUESTION]
    full = prefill_context(model, context_ids)
    expected = greedy(model, copy.deepcopy(full), question_ids)
    assert_answers(tokenizer, expected, gold)
    indices = [[torch.arange(context_ids.shape[1]) for _ in range(layer.keys.shape[1])] for layer in full.layers]
    cache = CompactedCache.from_selection(full, indices)
    hf_structkv.enable(model)
    assert torch.equal(greedy(model, cache, question_ids), expected)


def test_compacted_cache_is_smaller_and_answers(default_model, normans, tmp_path):
    model, tokenizer = default_model
    context_ids, questions = normans
    question_ids, gold = questions[LAST_PARAGRAPH_QUESTION]
    cache = compact(model, tokenizer, context_ids, ratio=4.0, method="streaming_llm")
    assert cache.nbytes() - cache.overhead_nbytes() <= cache.full_nbytes() / 4.0 + 1
    cache.save_pretrained(tmp_path)
    loaded = CompactedCache.load(tmp_path, model=model, tokenizer=tokenizer)
    first = greedy(model, loaded.copy(), question_ids)
    assert torch.equal(greedy(model, cache.copy(), question_ids), first)
    assert_answers(tokenizer, first, gold)
