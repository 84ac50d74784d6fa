"""The embedded real model serves compacted caches (slow: loads Qwen2.5-Coder-0.5B)."""

import copy

import pytest
import torch

import hf_structkv
from hf_structkv import CompactedCache
from hf_structkv.compaction import compact, prefill_context
from hf_structkv.eval.squad import squad_document
from hf_structkv.generation import generation_inputs
from hf_structkv.prompts import document_chat_prompt, question_text

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def document_prompt(default_model):
    _, tokenizer = default_model
    document = squad_document("Normans", 3)
    context_text, suffix = document_chat_prompt(tokenizer, document.text)
    context_ids = tokenizer(context_text, return_tensors="pt", add_special_tokens=False).input_ids
    question = question_text(document.questions[0].question, suffix)
    question_ids = tokenizer(question, return_tensors="pt", add_special_tokens=False).input_ids
    return context_ids, question_ids


def greedy(model, cache, question_ids, n=12):
    inputs = generation_inputs(cache, question_ids)
    with torch.no_grad():
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :]


def test_keep_everything_generates_like_dynamic_cache(default_model, document_prompt):
    model, _ = default_model
    context_ids, question_ids = document_prompt
    full = prefill_context(model, context_ids)
    expected = greedy(model, copy.deepcopy(full), question_ids)
    indices = [[torch.arange(context_ids.shape[1]) for _ in range(layer.keys.shape[1])] for layer in full.layers]
    cache = CompactedCache.from_selection(full, indices)
    hf_structkv.enable(model)
    assert torch.equal(greedy(model, cache, question_ids), expected)


def test_compacted_cache_is_smaller_and_answers(default_model, document_prompt, tmp_path):
    model, tokenizer = default_model
    context_ids, question_ids = document_prompt
    cache = compact(model, tokenizer, context_ids, ratio=4.0, method="streaming_llm")
    assert cache.nbytes() - cache.overhead_nbytes() <= cache.full_nbytes() / 4.0 + 1
    cache.save_pretrained(tmp_path)
    loaded = CompactedCache.load(tmp_path, model=model, tokenizer=tokenizer)
    first = greedy(model, loaded.copy(), question_ids)
    assert torch.equal(greedy(model, cache.copy(), question_ids), first)
    assert first.numel() > 0
