"""`ReferenceAnswers` (teacher-forced answer NLL after a cached context) and `context_copy`."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_structkv import CompactedCache, enable
from hf_structkv.compaction import prefill_context
from hf_structkv.eval.reference_answers import ReferenceAnswers
from hf_structkv.generation import context_copy
from hf_structkv.models import tiny_model


@pytest.fixture(scope="module")
def model():
    model = tiny_model("qwen2", vocab_size=300)
    enable(model)
    return model


def keep_everything(cache) -> list:
    return [[torch.arange(layer.keys.shape[-2])] * layer.keys.shape[1] for layer in cache.layers]


def case(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    context = torch.randint(3, 259, (1, 50), generator=gen)
    questions = [torch.randint(3, 259, (n,), generator=gen) for n in (5, 9)]
    answers = [torch.randint(3, 259, (n,), generator=gen) for n in (7, 3)]
    return context, questions, answers


def brute_force_nll(model, context, question, answer) -> float:
    """Mean NLL of ``answer`` in one plain forward over context + question + answer (no cache)."""
    ids = torch.cat([context[0], question, answer])[None]
    with torch.no_grad():
        log_probs = torch.log_softmax(model(ids).logits[0, -len(answer) - 1 : -1].double(), dim=-1)
    return -log_probs.gather(1, answer[:, None]).mean().item()


@pytest.mark.parametrize("kind", ["compacted", "dynamic"])
def test_answer_nll_is_the_plain_models_teacher_forced_nll(model, kind):
    """Each row's NLL after a prefilled `DynamicCache` or a keep-everything `CompactedCache` equals a plain forward
    over context + question + answer; the cache is left as it was (nothing appended)."""
    context, questions, answers = case()
    cache = prefill_context(model, context)
    if kind == "compacted":
        cache = CompactedCache.from_selection(cache, keep_everything(cache))
    length = cache.get_seq_length()
    nll = ReferenceAnswers.build(questions, answers, pad_id=0).nll(model, cache)
    expected = [brute_force_nll(model, context, q, a) for q, a in zip(questions, answers)]
    assert nll.dtype == torch.float64 and nll.shape == (2,)
    assert nll.tolist() == pytest.approx(expected, abs=1e-5)
    assert cache.get_seq_length() == length


def test_a_compacted_cache_that_drops_entries_changes_the_nll(model):
    context, questions, answers = case(1)
    cache = prefill_context(model, context)
    kept = [[torch.arange(0, 50, 5)] * layer.keys.shape[1] for layer in cache.layers]
    full = ReferenceAnswers.build(questions, answers, pad_id=0).nll(model, cache)
    dropped = ReferenceAnswers.build(questions, answers, pad_id=0).nll(
        model, CompactedCache.from_selection(cache, kept)
    )
    assert not torch.allclose(full, dropped, atol=1e-4)


def test_build_pads_on_the_right_and_marks_the_answers():
    questions = [torch.tensor([5, 6]), torch.tensor([7])]
    answers = [torch.tensor([8]), torch.tensor([9, 10, 11])]
    reference = ReferenceAnswers.build(questions, answers, pad_id=0)
    assert reference.ids.tolist() == [[5, 6, 8, 0], [7, 9, 10, 11]]
    assert (reference.starts, reference.ends) == ([2, 1], [3, 4])


@pytest.mark.parametrize(
    ("questions", "answers", "match"),
    [
        ([], [], "non-empty lists of the same length"),
        ([torch.tensor([1])], [], "non-empty lists of the same length"),
        ([torch.tensor([1])], [torch.tensor([], dtype=torch.long)], "every item of answers"),
        ([torch.tensor([[1]])], [torch.tensor([2])], "every item of questions"),
    ],
)
def test_build_rejects_bad_input(questions, answers, match):
    with pytest.raises(ValueError, match=match):
        ReferenceAnswers.build(questions, answers, pad_id=0)


def test_context_copy_repeats_a_one_row_dynamic_cache_and_leaves_it_unchanged(model):
    context, _, _ = case()
    cache = prefill_context(model, context)
    assert isinstance(cache, DynamicCache)
    before = [layer.keys.clone() for layer in cache.layers]
    copied = context_copy(cache, 3)
    assert copied is not cache and copied.layers[0].keys.shape[0] == 3
    for layer, keys in zip(copied.layers, before):
        assert torch.equal(layer.keys, keys.expand(3, -1, -1, -1))
    copied.layers[0].keys.zero_()
    assert all(torch.equal(layer.keys, keys) for layer, keys in zip(cache.layers, before))
    assert context_copy(copied, 3).layers[0].keys.shape[0] == 3


def test_context_copy_of_a_compacted_cache_shares_its_context(model):
    context, _, _ = case()
    cache = prefill_context(model, context)
    compacted = CompactedCache.from_selection(cache, keep_everything(cache))
    copied = context_copy(compacted, 4)
    assert isinstance(copied, CompactedCache) and copied is not compacted
    for layer, original in zip(copied.layers, compacted.layers):
        assert layer is not original and layer.prefix_keys is original.prefix_keys
        assert layer.prefix_values is original.prefix_values and layer.prefix_bias is original.prefix_bias


@pytest.mark.parametrize("batch", [0, -1, 1.5, True])
def test_context_copy_rejects_a_bad_batch(model, batch):
    context, _, _ = case()
    with pytest.raises(ValueError, match="batch must be None or an integer >= 1"):
        context_copy(prefill_context(model, context), batch)


def test_context_copy_without_a_batch_keeps_the_rows_of_a_dynamic_cache(model):
    context, _, _ = case()
    cache = context_copy(prefill_context(model, context), 2)
    copied = context_copy(cache)
    assert copied is not cache and copied.layers[0].keys.shape[0] == 2
    for layer, original in zip(copied.layers, cache.layers):
        assert torch.equal(layer.keys, original.keys) and layer.keys.data_ptr() != original.keys.data_ptr()


def test_context_copy_rejects_a_dynamic_cache_of_another_batch(model):
    context, _, _ = case()
    cache = context_copy(prefill_context(model, context), 2)
    with pytest.raises(ValueError, match="holds 2 rows"):
        context_copy(cache, 3)
