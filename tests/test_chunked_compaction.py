"""Chunked contexts: documents -> chunks (`chunk_spans`), each chunk compacted on its own queries and keys, the
compacted chunks concatenated, and each chunk's attention mass kept by its multipliers."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_structkv.compaction import (
    compact,
    compact_head,
    context_documents,
    conversation_queries,
    prefill_context,
)
from hf_structkv.compaction.chunks import chunk_spans
from hf_structkv.compaction.layer_compaction import split_queries
from hf_structkv.compaction.queries import repetition_conversation
from hf_structkv.models import tiny_model


def token_ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(seed))


class CharTokenizer:
    """One id per character (enough for the calibration prompts on tiny models), with a vocabulary hash."""

    def __call__(self, text, return_tensors=None, add_special_tokens=False):
        return type("Encoding", (), {"input_ids": torch.tensor([[3 + ord(ch) % 250 for ch in text]])})()

    def get_vocab(self):
        return {chr(i): 3 + i % 250 for i in range(256)}

    all_special_tokens = []


# ---------------------------------------------------------------------------------------------------- spans
@pytest.mark.parametrize(
    "lengths, chunk_tokens, expected",
    [
        ([10], None, [(0, 10)]),
        ([3, 4, 5], None, [(0, 12)]),
        ([3, 4, 5], 7, [(0, 7), (7, 12)]),  # whole documents packed while they fit
        ([3, 4, 5], 6, [(0, 3), (3, 7), (7, 12)]),
        ([3, 4, 5], 12, [(0, 12)]),
        ([25], 10, [(0, 9), (9, 17), (17, 25)]),  # a long document: ceil(25 / 10) near-equal pieces
        ([2, 25, 3, 3], 10, [(0, 2), (2, 11), (11, 19), (19, 27), (27, 33)]),
        ([20], 10, [(0, 10), (10, 20)]),
        ([1, 1, 1], 1, [(0, 1), (1, 2), (2, 3)]),
    ],
)
def test_chunk_spans(lengths, chunk_tokens, expected):
    assert chunk_spans(lengths, chunk_tokens) == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.integers(1, 30))
def test_chunk_spans_pack_whole_documents_greedily(lengths, chunk_tokens):
    spans = chunk_spans(lengths, chunk_tokens)
    boundaries = {sum(lengths[:i]) for i in range(len(lengths) + 1)}
    assert spans[0][0] == 0 and spans[-1][1] == sum(lengths)
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, in order
    assert all(0 < end - start <= chunk_tokens for start, end in spans)
    for start, end in spans:
        inside = [b for b in boundaries if start < b < end]
        for doc_start, length in zip(sorted(boundaries), lengths):
            cut = doc_start < start < doc_start + length or doc_start < end < doc_start + length
            assert not cut or length > chunk_tokens  # only a document longer than a chunk is cut
        if inside:  # several documents: all whole, and the next document would not have fit
            assert start in boundaries and end in boundaries
    document_at = {sum(lengths[:i]): length for i, length in enumerate(lengths)}
    for (start, end), (next_start, _) in zip(spans, spans[1:]):
        whole = start in boundaries and end in boundaries
        if whole and document_at[next_start] <= chunk_tokens:  # greedy: the next document did not fit
            assert next_start + document_at[next_start] - start > chunk_tokens


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError)])
def test_chunk_spans_reject_bad_chunk_tokens(bad, error):
    with pytest.raises(error, match=r"chunk_tokens must be an integer >= 1 \(tokens per chunk\) or None"):
        chunk_spans([5], bad)
    with pytest.raises(ValueError, match="document_lengths must be positive ints"):
        chunk_spans([], 4)


def test_context_documents():
    tokenizer = CharTokenizer()
    ids, lengths = context_documents(tokenizer, ["ab", "cde"])
    assert lengths == [2, 3] and torch.equal(ids, torch.tensor([[3 + ord(c) % 250 for c in "abcde"]]))
    ids, lengths = context_documents(None, [token_ids(4), token_ids(6, 1)])
    assert lengths == [4, 6] and torch.equal(ids, torch.cat([token_ids(4), token_ids(6, 1)], 1))
    assert context_documents(tokenizer, "abc")[1] == [3]
    with pytest.raises(ValueError, match=r"context\[1\] must be a non-empty text"):
        context_documents(tokenizer, ["ab", ""])
    with pytest.raises(ValueError, match="non-empty list of documents"):
        context_documents(tokenizer, [])
    with pytest.raises(ValueError, match="a text context needs its tokenizer"):
        context_documents(None, ["ab"])
    with pytest.raises(ValueError, match=r"prefix must be a non-empty text"):
        context_documents(tokenizer, "", name="prefix")
    with pytest.raises(ValueError, match=r"prefix\[0\] must be a non-empty text"):
        context_documents(tokenizer, [""], name="prefix")


# ---------------------------------------------------------------------------------------------------- compaction
def kept_positions(cache, full, layer: int, head: int) -> torch.Tensor:
    """The context positions of a compacted head's kept keys (matched against the full cache's keys)."""
    compacted = cache.layers[layer]
    a, b = compacted.prefix_offsets[head], compacted.prefix_offsets[head + 1]
    keys = compacted.prefix_keys[a:b]
    return (keys[:, None] == full.layers[layer].keys[0, head][None]).all(-1).int().argmax(-1)


def test_streaming_llm_keeps_sinks_and_recent_of_every_chunk():
    model = tiny_model("llama")
    documents = [token_ids(30), token_ids(25, 1), token_ids(50, 2)]  # chunks [0,30) [30,55) [55,80) [80,105)
    cache = compact(model, None, documents, ratio=5, method="streaming_llm", chunk_tokens=40, sink_tokens=2)
    full = prefill_context(model, torch.cat(documents, 1))
    expected = []
    for start, end in [(0, 30), (30, 55), (55, 80), (80, 105)]:
        kept = math.floor((end - start) / 5)
        expected += [start, start + 1, *range(end - (kept - 2), end)]
    assert cache.head_lengths() == [[21, 21], [21, 21]]
    for layer in (0, 1):
        for head in (0, 1):
            assert kept_positions(cache, full, layer, head).tolist() == expected
    assert cache.metadata["chunking"] == {
        "chunk_tokens": 40,
        "prefix_tokens": 0,
        "document_lengths": [30, 25, 50],
        "chunk_spans": [[0, 30], [30, 55], [55, 80], [80, 105]],
    }


@pytest.fixture(scope="module")
def chunked():
    """qwen3 (q/k norms keep its attention well spread), three 60-token documents compacted 6x with KV-Surgeon, one
    chunk each, off-policy: ``(model, tokenizer, ids, cache, full cache, per-chunk repeat queries)``."""
    model, tokenizer = tiny_model("qwen3"), CharTokenizer()
    documents = [token_ids(60, seed) for seed in range(3)]
    ids = torch.cat(documents, 1)
    cache = compact(model, tokenizer, documents, ratio=6, chunk_tokens=60, on_policy=False)
    full = prefill_context(model, ids)
    queries = [  # off-policy queries continue the plain full cache
        conversation_queries(model, ids, [repetition_conversation(tokenizer, ids[:, s : s + 60])], full)
        for s in (0, 60, 120)
    ]
    return model, tokenizer, ids, cache, full, queries


def test_each_chunk_is_compact_head_on_its_keys_and_its_queries(chunked):
    _, _, _, cache, full, queries = chunked
    assert cache.head_lengths() == [[30, 30], [30, 30]]
    for layer in (0, 1):
        compacted = cache.layers[layer]
        for head in (0, 1):
            a, b = compacted.prefix_offsets[head], compacted.prefix_offsets[head + 1]
            expected = []
            for index, start in enumerate((0, 60, 120)):
                fit, _ = split_queries(queries[index][layer], 0.1, 50_000, 0)
                keys, values = full.layers[layer].keys[0, head], full.layers[layer].values[0, head]
                chunk = slice(start, start + 60)
                expected.append(compact_head(keys[chunk], values[chunk], fit[head], 10, "kv_surgeon"))
            assert torch.equal(
                kept_positions(cache, full, layer, head),
                torch.cat([h.indices + s for h, s in zip(expected, (0, 60, 120))]),
            )
            torch.testing.assert_close(compacted.prefix_bias[a:b], torch.cat([h.bias for h in expected]))
            torch.testing.assert_close(compacted.prefix_values[a:b], torch.cat([h.values for h in expected]))


def test_each_compacted_chunk_keeps_its_attention_mass(chunked):
    """For a query of chunk c, ``log(sum_{j in S_c} w_j exp(z_j) / sum_{j in c} exp(z_j))``: near 0 with the served
    multipliers, far from 0 with unit multipliers on the same kept entries (5x fewer entries lose most of the mass)."""
    _, _, _, cache, full, queries = chunked
    for layer in (0, 1):
        compacted = cache.layers[layer]
        for head in (0, 1):
            a, b = compacted.prefix_offsets[head], compacted.prefix_offsets[head + 1]
            positions = kept_positions(cache, full, layer, head)
            keys, bias = compacted.prefix_keys[a:b], compacted.prefix_bias[a:b]
            for index, start in enumerate((0, 60, 120)):
                q = queries[index][layer][head]
                in_chunk = (positions >= start) & (positions < start + 60)
                full_logits = q @ full.layers[layer].keys[0, head, start : start + 60].T / 4  # scale 1/sqrt(16)
                kept_logits = q @ keys[in_chunk].T / 4
                fitted = torch.logsumexp(kept_logits + bias[in_chunk], 1) - torch.logsumexp(full_logits, 1)
                unit = torch.logsumexp(kept_logits, 1) - torch.logsumexp(full_logits, 1)
                assert fitted.abs().median() < 0.3, (layer, head, index)
                assert fitted.abs().median() < 0.25 * unit.abs().median(), (layer, head, index)


def test_a_compacted_chunk_served_next_to_full_neighbours_keeps_its_attention_share(chunked):
    """Lemma 1 in the served cache: chunk 1 compacted (its kept keys with their biases), chunks 0 and 2 whole; for the
    queries of chunk 1 the softmax share chunk 1 receives matches the full cache's, far better than unit multipliers."""
    _, _, _, cache, full, queries = chunked
    compacted = cache.layers[1]
    a, b = compacted.prefix_offsets[0], compacted.prefix_offsets[1]
    positions = kept_positions(cache, full, 1, 0)
    in_chunk = (positions >= 60) & (positions < 120)
    keys = full.layers[1].keys[0, 0]
    q = queries[1][1][0]
    neighbours = torch.logsumexp(q @ torch.cat([keys[:60], keys[120:]]).T / 4, 1)
    own_full = torch.logsumexp(q @ keys[60:120].T / 4, 1)
    kept_logits = q @ compacted.prefix_keys[a:b][in_chunk].T / 4
    own_fitted = torch.logsumexp(kept_logits + compacted.prefix_bias[a:b][in_chunk], 1)
    own_unit = torch.logsumexp(kept_logits, 1)

    def share(own):
        return torch.sigmoid(own - neighbours)

    fitted_error = (share(own_fitted) - share(own_full)).abs().mean()
    unit_error = (share(own_unit) - share(own_full)).abs().mean()
    assert fitted_error < 0.05 and fitted_error < 0.3 * unit_error


def test_chunked_self_study_quotes_each_chunk_and_budgets_are_asked_per_chunk():
    from hf_structkv.compaction import SelfStudy

    class Budgets:
        calls = []

        def token_budgets(self, ratio, length):
            self.calls.append(length)
            return {0: [length // 10, 3 * length // 10], 1: [2 * length // 10] * 2}

    model = tiny_model("llama")
    documents = [token_ids(30), token_ids(50, 1)]
    config = SelfStudy(answer_tokens=3, question_tokens=4)
    cache = compact(
        model,
        CharTokenizer(),
        documents,
        ratio=5,
        queries="self_study",
        self_study=config,
        chunk_tokens=30,
        budgets=Budgets(),
    )
    assert Budgets.calls == [30, 25, 25]
    assert cache.head_lengths() == [[3 + 2 + 2, 9 + 7 + 7], [6 + 5 + 5] * 2]
    tokens = cache.metadata["calibration"]["answer_tokens_per_chunk"]
    assert [chunk["repetition"] for chunk in tokens] == [30, 25, 25]
    assert all(chunk["summary"] <= 3 and chunk["questions"] <= 4 for chunk in tokens)
    assert cache.metadata["budgets"]["kept_per_chunk"][1] == {"0": [2, 7], "1": [5, 5]}


# ------------------------------------------------------------------------------------------------ a prefix kept whole
def test_a_prefix_is_kept_whole_and_each_chunk_compacted_after_it():
    """StreamingLLM with a 7-token prefix: the prefix's entries as they are (bias 0, original values), then each
    chunk's sinks and recent entries at cache positions shifted by the prefix; the budgets count the context only."""
    model = tiny_model("llama")
    prefix, documents = token_ids(7, 9), [token_ids(30), token_ids(25, 1)]
    cache = compact(
        model, None, documents, ratio=5, method="streaming_llm", chunk_tokens=30, sink_tokens=2, prefix=prefix
    )
    full = prefill_context(model, torch.cat([prefix, *documents], 1))
    expected = list(range(7))
    for start, end in [(7, 37), (37, 62)]:
        kept = math.floor((end - start) / 5)
        expected += [start, start + 1, *range(end - (kept - 2), end)]
    assert cache.head_lengths() == [[7 + 6 + 5] * 2] * 2 and cache.original_length == 62
    for layer in (0, 1):
        compacted = cache.layers[layer]
        for head in (0, 1):
            assert kept_positions(cache, full, layer, head).tolist() == expected
            a = compacted.prefix_offsets[head]
            assert torch.equal(compacted.prefix_bias[a : a + 7], torch.zeros(7))
            assert torch.equal(compacted.prefix_values[a : a + 7], full.layers[layer].values[0, head, :7])
    assert cache.metadata["chunking"] == {
        "chunk_tokens": 30,
        "prefix_tokens": 7,
        "document_lengths": [30, 25],
        "chunk_spans": [[7, 37], [37, 62]],
    }


def test_a_calibrated_chunk_after_a_prefix_is_compact_head_on_its_keys_and_queries_after_the_prefix():
    """KV-Surgeon, off-policy, a 9-token prefix before two 60-token documents: each chunk is `compact_head` on its own
    keys (cache positions after the prefix) and the queries of its repetition, run after prefix + context."""
    model, tokenizer = tiny_model("qwen3"), CharTokenizer()
    prefix, documents = token_ids(9, 7), [token_ids(60, seed) for seed in range(2)]
    cache = compact(model, tokenizer, documents, ratio=6, chunk_tokens=60, on_policy=False, prefix=prefix)
    ids = torch.cat([prefix, *documents], 1)
    full = prefill_context(model, ids)
    starts = (9, 69)
    queries = [
        conversation_queries(model, ids, [repetition_conversation(tokenizer, ids[:, s : s + 60])], full) for s in starts
    ]
    assert cache.head_lengths() == [[9 + 10 + 10] * 2] * 2
    for layer in (0, 1):
        compacted = cache.layers[layer]
        for head in (0, 1):
            a, b = compacted.prefix_offsets[head], compacted.prefix_offsets[head + 1]
            keys, values = full.layers[layer].keys[0, head], full.layers[layer].values[0, head]
            expected = [
                compact_head(keys[s : s + 60], values[s : s + 60], split_queries(q[layer], 0.1, 50_000, 0)[0][head], 10)
                for q, s in zip(queries, starts)
            ]
            assert torch.equal(
                kept_positions(cache, full, layer, head),
                torch.cat([torch.arange(9), *(h.indices + s for h, s in zip(expected, starts))]),
            )
            torch.testing.assert_close(compacted.prefix_bias[a + 9 : b], torch.cat([h.bias for h in expected]))
            torch.testing.assert_close(compacted.prefix_values[a + 9 : b], torch.cat([h.values for h in expected]))


def test_a_prefix_served_whole_with_nothing_compacted_matches_the_full_cache():
    """ratio 1 keeps every context entry: prefix + context then serve a question as the prefilled full cache does."""
    from hf_structkv.attention.registry import enable
    from hf_structkv.generation import context_copy

    model = tiny_model("llama")
    prefix, context, question = token_ids(6, 3), token_ids(40, 4), token_ids(5, 5)
    cache = compact(model, None, context, ratio=1, method="streaming_llm", prefix=prefix)
    full = prefill_context(model, torch.cat([prefix, context], 1))
    enable(model)
    positions = torch.arange(46, 51)[None]
    with torch.no_grad():
        served = model(question, past_key_values=context_copy(cache), position_ids=positions).logits
        expected = model(question, past_key_values=context_copy(full), position_ids=positions).logits
    torch.testing.assert_close(served, expected, rtol=1e-4, atol=1e-5)


def test_an_empty_prefix_is_refused_by_name():
    with pytest.raises(ValueError, match="prefix must be a non-empty text"):
        compact(tiny_model("llama"), CharTokenizer(), "abcdef", ratio=2, method="streaming_llm", prefix="")
