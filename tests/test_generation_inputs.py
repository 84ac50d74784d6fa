"""``generation_inputs``: placeholder context + question ids and masks for ``generate`` on a prefilled cache."""

import copy

import pytest
import torch
from transformers import DynamicCache

import hf_structkv
from hf_structkv import CompactedCache
from hf_structkv.compaction import prefill_context
from hf_structkv.generation import generation_inputs
from hf_structkv.models import tiny_model

CONTEXT_LEN = 30


def context_and_questions(seed: int = 0, lengths=(6,)):
    g = torch.Generator().manual_seed(seed)
    context = torch.randint(3, 256, (1, CONTEXT_LEN), generator=g)
    return context, [torch.randint(3, 256, (1, n), generator=g) for n in lengths]


def left_pad(questions: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenizer-style left padding (pad id 0) of ``[1, n]`` questions and its mask."""
    width = max(q.shape[1] for q in questions)
    ids = torch.zeros(len(questions), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, q in enumerate(questions):
        ids[row, -q.shape[1] :] = q[0]
        mask[row, -q.shape[1] :] = 1
    return ids, mask


def keep_all(cache) -> list:
    return [
        None if layer.is_sliding else [torch.arange(layer.keys.shape[-2]) for _ in range(layer.keys.shape[1])]
        for layer in cache.layers
    ]


def greedy(model, inputs, cache=None, n=8):
    kwargs = {} if cache is None else {"past_key_values": cache}
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False, **kwargs)
    return out[:, inputs["input_ids"].shape[1] :]


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def test_batch_one_on_a_dynamic_cache(llama):
    context, (question,) = context_and_questions()
    inputs = generation_inputs(prefill_context(llama, context), question)
    assert set(inputs) == {"input_ids", "attention_mask"}
    assert inputs["input_ids"].shape == (1, CONTEXT_LEN + 6) == inputs["attention_mask"].shape
    assert inputs["input_ids"].dtype == torch.long == inputs["attention_mask"].dtype
    assert torch.equal(inputs["input_ids"][:, :CONTEXT_LEN], torch.zeros(1, CONTEXT_LEN, dtype=torch.long))
    assert torch.equal(inputs["input_ids"][:, CONTEXT_LEN:], question)
    assert torch.equal(inputs["attention_mask"], torch.ones(1, CONTEXT_LEN + 6, dtype=torch.long))


def test_left_padded_batch_keeps_its_padding(llama):
    context, questions = context_and_questions(lengths=(3, 5))
    ids, mask = left_pad(questions)
    inputs = generation_inputs(prefill_context(llama, context), ids, mask.bool())
    assert inputs["input_ids"].shape == (2, CONTEXT_LEN + 5)
    assert torch.equal(inputs["input_ids"][:, CONTEXT_LEN:], ids)
    assert inputs["attention_mask"].dtype == torch.long
    assert inputs["attention_mask"][:, :CONTEXT_LEN].eq(1).all()
    assert inputs["attention_mask"][:, CONTEXT_LEN:].tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]


def test_compacted_cache_counts_the_original_length(llama):
    context, (question,) = context_and_questions()
    full = prefill_context(llama, context)
    few = [[torch.arange(0, CONTEXT_LEN, 5) for _ in range(layer.keys.shape[1])] for layer in full.layers]
    cache = CompactedCache.from_selection(full, few)
    assert cache.head_lengths() == [[6, 6], [6, 6]]
    inputs = generation_inputs(cache, question)
    assert inputs["input_ids"].shape == (1, CONTEXT_LEN + 6)
    assert torch.equal(inputs["input_ids"][:, CONTEXT_LEN:], question)


def test_generate_on_a_prefilled_dynamic_cache_equals_generate_on_the_real_ids(llama):
    context, (question,) = context_and_questions(seed=1)
    real = torch.cat([context, question], 1)
    expected = greedy(llama, {"input_ids": real, "attention_mask": torch.ones_like(real)})
    cache = prefill_context(llama, context)
    got = greedy(llama, generation_inputs(cache, question), cache=cache)
    assert got.shape == (1, 8)
    assert torch.equal(got, expected), (got, expected)


def test_left_padded_batch_on_a_compacted_cache_equals_each_real_prompt():
    """Gemma3: sliding and global layers; the padding sits between the shared context and the shorter question."""
    model = tiny_model("gemma3")
    context, questions = context_and_questions(seed=2, lengths=(7, 2))
    expected = []
    for q in questions:
        real = torch.cat([context, q], 1)
        expected.append(greedy(model, {"input_ids": real, "attention_mask": torch.ones_like(real)})[0])
    full = prefill_context(model, context)
    cache = CompactedCache.from_selection(full, keep_all(copy.deepcopy(full)))
    hf_structkv.enable(model)
    ids, mask = left_pad(questions)
    got = greedy(model, generation_inputs(cache, ids, mask), cache=cache.copy())
    for row, want in enumerate(expected):
        assert torch.equal(got[row], want), (row, got[row], want)


def test_a_used_compacted_cache_is_refused_until_copied_or_reset(llama):
    """Asking a second question on a cache that answered one would continue after the first answer: refused."""
    context, (first, second) = context_and_questions(seed=3, lengths=(4, 5))
    full = prefill_context(llama, context)
    cache = CompactedCache.from_selection(full, keep_all(copy.deepcopy(full)))
    hf_structkv.enable(llama)
    fresh_answer = greedy(llama, generation_inputs(cache.copy(), second), cache=cache.copy())
    greedy(llama, generation_inputs(cache, first), cache=cache)  # appends the first question and its answer
    appended = cache.get_seq_length() - CONTEXT_LEN
    assert appended == 4 + 8 - 1
    with pytest.raises(
        ValueError, match=rf"cache holds {appended} appended tokens .* cache\.copy\(\).*cache\.reset\(\)"
    ):
        generation_inputs(cache, second)
    copied = cache.copy()
    assert torch.equal(greedy(llama, generation_inputs(copied, second), cache=copied), fresh_answer)
    cache.reset()
    assert torch.equal(greedy(llama, generation_inputs(cache, second), cache=cache), fresh_answer)


class TestRejectsBadInput:
    def test_one_dimensional_ids(self, llama):
        cache = prefill_context(llama, context_and_questions()[0])
        with pytest.raises(ValueError, match=r"question_ids must be a \[batch, length\] LongTensor"):
            generation_inputs(cache, torch.tensor([5, 6, 7]))
        with pytest.raises(ValueError, match=r"question_ids must be a \[batch, length\] LongTensor"):
            generation_inputs(cache, [[5, 6, 7]])

    def test_mask_shape_mismatch(self, llama):
        cache = prefill_context(llama, context_and_questions()[0])
        with pytest.raises(ValueError, match=r"attention_mask has shape \(1, 2\) but question_ids \(1, 3\)"):
            generation_inputs(cache, torch.tensor([[5, 6, 7]]), torch.ones(1, 2, dtype=torch.long))

    def test_empty_cache(self, llama):
        with pytest.raises(ValueError, match="cache is empty: prefill it with the context"):
            generation_inputs(DynamicCache(config=llama.config), torch.tensor([[5, 6, 7]]))
