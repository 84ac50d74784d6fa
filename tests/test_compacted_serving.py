"""CompactedCache served through the registered attention on unmodified transformers models."""

import pytest
import torch
from transformers import DynamicCache

import hf_structkv
from hf_structkv import CompactedCache
from hf_structkv.models import tiny_model

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3"]
CONTEXT_LEN = 40


def prefill(model, ids: torch.Tensor) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache)
    return cache


def keep_all(cache) -> list:
    """Every position of every KV head of each global layer (None for sliding layers)."""
    return [
        None if layer.is_sliding else [torch.arange(layer.keys.shape[-2]) for _ in range(layer.keys.shape[1])]
        for layer in cache.layers
    ]


def random_selection(cache, fraction: float, seed: int = 0):
    """Ragged random kept positions per KV head (different lengths) and random biases."""
    g = torch.Generator().manual_seed(seed)
    indices, biases = [], []
    for layer in cache.layers:
        if layer.is_sliding:
            indices.append(None)
            biases.append(None)
            continue
        n_heads, length = layer.keys.shape[1], layer.keys.shape[-2]
        layer_idx, layer_bias = [], []
        for h in range(n_heads):
            t = max(1, int(length * fraction) + h)  # ragged on purpose
            layer_idx.append(torch.randperm(length, generator=g)[:t].sort().values)
            layer_bias.append(torch.randn(t, generator=g))
        indices.append(layer_idx)
        biases.append(layer_bias)
    return indices, biases


def context_and_question(seed: int = 0, q_len: int = 6):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (1, CONTEXT_LEN), generator=g), torch.randint(3, 256, (1, q_len), generator=g)


def generate(model, ids, cache=None, mask=None, n=8):
    mask = torch.ones_like(ids) if mask is None else mask
    kwargs = {} if cache is None else {"past_key_values": cache}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, **kwargs)
    return out[:, ids.shape[1] :]


@pytest.mark.parametrize("arch", ARCHS)
def test_keep_everything_generates_like_dynamic_cache(arch):
    model = tiny_model(arch)
    context, question = context_and_question()
    full = torch.cat([context, question], 1)
    expected = generate(model, full)
    cache = CompactedCache.from_selection(prefill(model, context), keep_all(prefill(model, context)))
    hf_structkv.enable(model)
    got = generate(model, full, cache=cache)
    assert torch.equal(got, expected), (got, expected)


def per_head_reference_mask(cache, indices, biases, n_q_heads: int, q_len: int) -> torch.Tensor:
    """Explicit additive mask ``[1, H_q, q, T + q]``: bias on kept entries, -inf on removed ones, causal question."""
    layer = next(i for i, sel in enumerate(indices) if sel is not None)
    n_kv = len(indices[layer])
    group = n_q_heads // n_kv
    mask = torch.full((1, n_q_heads, q_len, CONTEXT_LEN + q_len), float("-inf"))
    for h in range(n_kv):
        row = torch.full((CONTEXT_LEN,), float("-inf"))
        row[indices[layer][h]] = biases[layer][h]
        mask[0, h * group : (h + 1) * group, :, :CONTEXT_LEN] = row
    mask[..., CONTEXT_LEN:] = torch.triu(torch.full((q_len, q_len), float("-inf")), diagonal=1)
    return mask


def same_selection_for_all_layers(cache, fraction: float, seed: int = 0):
    """A 4D mask is shared by all layers, so the reference test uses one selection for every layer."""
    indices, biases = random_selection(cache, fraction, seed)
    first = next(i for i, sel in enumerate(indices) if sel is not None)
    return [indices[first] if sel is not None else None for sel in indices], [
        biases[first] if b is not None else None for b in biases
    ]


def masked_reference_and_compacted_logits(model, indices, biases, context, question):
    """Logits of the full cache with the explicit per-head mask (stock SDPA) and of the compacted cache."""
    mask = per_head_reference_mask(
        prefill(model, context), indices, biases, model.config.num_attention_heads, question.shape[1]
    ).to(model.dtype)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        expected = model(question, cache=prefill(model, context), attention_mask=mask).logits
        cache = CompactedCache.from_selection(prefill(model, context), indices, biases)
        hf_structkv.enable(model)
        ones = torch.ones(1, CONTEXT_LEN + question.shape[1], dtype=torch.long)
        got = model(question, cache=cache, attention_mask=ones).logits
    return expected.float(), got.float()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_removed_entries_and_biases_match_explicit_mask(arch):
    model = tiny_model(arch)
    context, question = context_and_question(seed=3)
    indices, biases = same_selection_for_all_layers(prefill(model, context), fraction=0.3)
    expected, got = masked_reference_and_compacted_logits(model, indices, biases, context, question)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_is_as_accurate_as_stock_bf16(arch):
    """In bf16 the compacted path (FP32 softmax statistics) is no further from the FP32 truth than stock bf16 SDPA."""
    model = tiny_model(arch, dtype=torch.bfloat16)
    context, question = context_and_question(seed=3)
    indices, biases = same_selection_for_all_layers(prefill(model, context), fraction=0.3)
    stock_bf16, ours_bf16 = masked_reference_and_compacted_logits(model, indices, biases, context, question)
    truth, _ = masked_reference_and_compacted_logits(model.float(), indices, biases, context, question)
    err_ours, err_stock = (ours_bf16 - truth).abs().max(), (stock_bf16 - truth).abs().max()
    assert err_ours <= 1.5 * err_stock + 1e-3, (err_ours, err_stock)
    assert err_ours < 0.03 * truth.abs().max()


def test_compacted_cache_continues_over_several_forwards():
    """Chunked question + decode steps: positions continue from the original length, appended tokens are causal."""
    model = tiny_model("qwen2")
    context, question = context_and_question(seed=5, q_len=7)
    indices, biases = random_selection(prefill(model, context), 0.4)
    hf_structkv.enable(model)
    one_pass = CompactedCache.from_selection(prefill(model, context), indices, biases)
    two_pass = one_pass.copy()
    with torch.no_grad():
        expected = model(question, cache=one_pass).logits
        first = model(question[:, :3], cache=two_pass).logits
        second = model(question[:, 3:], cache=two_pass).logits
    assert one_pass.get_seq_length() == CONTEXT_LEN + 7 == two_pass.get_seq_length()
    torch.testing.assert_close(torch.cat([first, second], 1), expected, atol=1e-5, rtol=0)


def left_padded(questions: list[torch.Tensor]):
    """Context placeholders + left-padded questions, and the tokenizer-style mask (1 on context and real tokens)."""
    width = max(q.shape[1] for q in questions)
    ids = torch.zeros(len(questions), CONTEXT_LEN + width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    mask[:, :CONTEXT_LEN] = 1
    for row, q in enumerate(questions):
        ids[row, -q.shape[1] :] = q[0]
        mask[row, -q.shape[1] :] = 1
    return ids, mask


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_batched_questions_equal_single_questions(arch):
    model = tiny_model(arch)
    context, _ = context_and_question()
    g = torch.Generator().manual_seed(7)
    questions = [torch.randint(3, 256, (1, n), generator=g) for n in (5, 2, 8)]
    indices, biases = random_selection(prefill(model, context), 0.5)
    shared = CompactedCache.from_selection(prefill(model, context), indices, biases)
    hf_structkv.enable(model)
    singles = []
    for q in questions:
        ids = torch.cat([torch.zeros(1, CONTEXT_LEN, dtype=torch.long), q], 1)
        singles.append(generate(model, ids, cache=shared.copy()))
    ids, mask = left_padded(questions)
    batched_cache = shared.copy()
    batched = generate(model, ids, cache=batched_cache, mask=mask)
    for row, single in enumerate(singles):
        assert torch.equal(batched[row], single[0]), (row, batched[row], single[0])
    # The context is stored once for the whole batch: its tensors are the shared ones.
    for layer, source in zip(batched_cache.layers, shared.layers):
        for mine, theirs in zip(layer.context_tensors(), source.context_tensors()):
            assert mine.data_ptr() == theirs.data_ptr()


def test_generate_accepts_the_cache_spelling():
    """transformers 5.x renames generate's past_key_values to cache: both reach the same cache."""
    model = tiny_model("qwen3")
    context, question = context_and_question()
    compacted = CompactedCache.from_selection(
        prefill(model, context), random_selection(prefill(model, context), 0.3)[0]
    )
    hf_structkv.enable(model)
    ids = torch.cat([torch.zeros(1, CONTEXT_LEN, dtype=torch.long), question], 1)
    with torch.no_grad():
        new = model.generate(
            ids, attention_mask=torch.ones_like(ids), cache=compacted.copy(), max_new_tokens=6, do_sample=False
        )
    assert torch.equal(new[:, ids.shape[1] :], generate(model, ids, cache=compacted.copy(), n=6))


def test_generation_does_not_touch_the_compacted_context():
    model = tiny_model("llama")
    context, question = context_and_question()
    indices, biases = random_selection(prefill(model, context), 0.3)
    cache = CompactedCache.from_selection(prefill(model, context), indices, biases)
    before = [t.clone() for layer in cache.layers for t in layer.context_tensors()]
    hf_structkv.enable(model)
    ids = torch.cat([torch.zeros(1, CONTEXT_LEN, dtype=torch.long), question], 1)
    first = generate(model, ids, cache=cache.copy())
    second = generate(model, ids, cache=cache.copy())
    cache_used = cache.copy()
    generate(model, ids, cache=cache_used)
    cache_used.reset()
    third = generate(model, ids, cache=cache_used)
    assert torch.equal(first, second) and torch.equal(first, third)
    after = [t for layer in cache.layers for t in layer.context_tensors()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert cache.get_seq_length() == CONTEXT_LEN


def test_model_not_enabled_raises_at_first_forward():
    model = tiny_model("llama")
    context, question = context_and_question()
    cache = CompactedCache.from_selection(prefill(model, context), keep_all(prefill(model, context)))
    with pytest.raises(RuntimeError, match=r"hf_structkv.enable\(model\)"), torch.no_grad():
        model(question, cache=cache)


def test_enabled_model_matches_stock_sdpa_on_ordinary_caches():
    model = tiny_model("qwen3")
    context, question = context_and_question()
    full = torch.cat([context, question], 1)
    with torch.no_grad():
        expected = model(full).logits
        expected_gen = generate(model, full)
        hf_structkv.enable(model)
        got = model(full).logits
    assert hf_structkv.is_enabled(model)
    assert torch.equal(got, expected)
    assert torch.equal(generate(model, full), expected_gen)


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_enabled_model_matches_stock_sdpa_with_left_padding(arch):
    """Sliding windows measured in positions equal stock slot-based windows when padding sits at the start."""
    overrides = {"sliding_window": 4} if arch == "mistral" else {}
    model = tiny_model(arch, **overrides)
    ids = torch.randint(3, 256, (2, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    expected = generate(model, ids, mask=mask)
    hf_structkv.enable(model)
    assert torch.equal(generate(model, ids, mask=mask), expected)


def test_bytes_shrink_with_the_ratio():
    model = tiny_model("llama")
    context, _ = context_and_question()
    cache = prefill(model, context)
    ratio = 5.0
    t = int(CONTEXT_LEN / ratio)
    indices = [[torch.arange(t) * ratio for _ in range(layer.keys.shape[1])] for layer in cache.layers]
    indices = [[i.long() for i in layer] for layer in indices]
    compacted = CompactedCache.from_selection(cache, indices)
    full = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    assert compacted.full_nbytes() == full
    kv_bytes = compacted.nbytes() - compacted.overhead_nbytes()
    assert kv_bytes <= full / ratio
    n_kept = sum(sum(h) for h in compacted.head_lengths())
    n_layers, n_heads = len(cache.layers), cache.layers[0].keys.shape[1]
    assert compacted.overhead_nbytes() == n_kept * 4 + n_layers * (n_heads + 1) * 8
    # Appended tokens count in both totals alike.
    hf_structkv.enable(model)
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7]]), cache=compacted)
    appended = sum(layer.keys.nbytes + layer.values.nbytes for layer in compacted.layers)
    assert compacted.full_nbytes() == full + appended
    assert compacted.nbytes() == kv_bytes + compacted.overhead_nbytes() + appended


def test_ragged_heads_are_stored_without_padding():
    model = tiny_model("llama")
    context, _ = context_and_question()
    indices, _ = random_selection(prefill(model, context), 0.25)
    cache = CompactedCache.from_selection(prefill(model, context), indices)
    for layer, layer_idx in zip(cache.layers, indices):
        lengths = [len(i) for i in layer_idx]
        assert layer.head_lengths() == lengths and len(set(lengths)) > 1
        assert layer.prefix_keys.shape[0] == sum(lengths)
        assert layer.prefix_offsets.tolist() == [0, *torch.tensor(lengths).cumsum(0).tolist()]


def test_crop_and_batch_operations_touch_appended_tokens_only():
    model = tiny_model("llama")
    context, question = context_and_question()
    cache = CompactedCache.from_selection(prefill(model, context), keep_all(prefill(model, context)))
    hf_structkv.enable(model)
    with torch.no_grad():
        model(question, cache=cache)
    cache.crop(-2)
    assert cache.get_seq_length() == CONTEXT_LEN + 4
    cache.batch_repeat_interleave(3)
    assert cache.layers[0].keys.shape[0] == 3
    cache.batch_select_indices(torch.tensor([0, 2]))
    assert cache.layers[0].keys.shape[0] == 2
    cache.crop(CONTEXT_LEN)
    assert cache.get_seq_length() == CONTEXT_LEN
    with pytest.raises(ValueError, match="compacted context"):
        cache.crop(CONTEXT_LEN - 1)


class TestFromSelectionRejectsBadInput:
    @pytest.fixture()
    def cache(self):
        model = tiny_model("llama")
        return prefill(model, context_and_question()[0])

    def good(self, cache):
        return keep_all(cache)

    def test_not_a_cache(self):
        with pytest.raises(TypeError, match="cache must be a transformers Cache"):
            CompactedCache.from_selection({"keys": 1}, [])

    def test_wrong_layer_count(self, cache):
        with pytest.raises(ValueError, match="indices has 1 layers, the cache has 2"):
            CompactedCache.from_selection(cache, self.good(cache)[:1])

    def test_wrong_head_count(self, cache):
        indices = self.good(cache)
        indices[1] = indices[1][:1]
        with pytest.raises(ValueError, match=r"indices\[1\] must list one LongTensor per KV head \(2\)"):
            CompactedCache.from_selection(cache, indices)

    def test_out_of_range(self, cache):
        indices = self.good(cache)
        indices[0][1] = torch.tensor([0, CONTEXT_LEN])
        with pytest.raises(ValueError, match=r"indices\[0\]\[1\] holds positions outside \[0, 40\)"):
            CompactedCache.from_selection(cache, indices)

    def test_duplicates(self, cache):
        indices = self.good(cache)
        indices[0][0] = torch.tensor([3, 3])
        with pytest.raises(ValueError, match="holds a position twice"):
            CompactedCache.from_selection(cache, indices)

    def test_dtype(self, cache):
        indices = self.good(cache)
        indices[0][0] = indices[0][0].float()
        with pytest.raises(TypeError, match=r"indices\[0\]\[0\] must be a 1-D torch.long tensor"):
            CompactedCache.from_selection(cache, indices)

    def test_bias_shape_and_nan(self, cache):
        indices = self.good(cache)
        biases = [[torch.zeros(CONTEXT_LEN) for _ in layer] for layer in indices]
        biases[1][0] = torch.zeros(3)
        with pytest.raises(ValueError, match=r"biases\[1\]\[0\] must be a tensor of shape \(40,\)"):
            CompactedCache.from_selection(cache, indices, biases)
        biases[1][0] = torch.full((CONTEXT_LEN,), float("nan"))
        with pytest.raises(ValueError, match=r"biases\[1\]\[0\] holds NaN"):
            CompactedCache.from_selection(cache, indices, biases)

    def test_values_shape(self, cache):
        indices = self.good(cache)
        values = [[torch.zeros(CONTEXT_LEN, 16) for _ in layer] for layer in indices]
        values[0][1] = torch.zeros(CONTEXT_LEN, 15)
        with pytest.raises(ValueError, match=r"values\[0\]\[1\] must be a tensor of shape \(40, 16\)"):
            CompactedCache.from_selection(cache, indices, values=values)

    def test_empty_and_batched_caches(self):
        model = tiny_model("llama")
        with pytest.raises(ValueError, match="cache is empty"):
            CompactedCache.from_selection(DynamicCache(config=model.config), [None, None])
        batched = prefill(model, torch.randint(3, 256, (2, 10)))
        with pytest.raises(ValueError, match=r"must hold one context \(batch 1\)"):
            CompactedCache.from_selection(batched, keep_all(batched))

    def test_sliding_layer_must_not_be_selected(self):
        model = tiny_model("gemma3")
        cache = prefill(model, context_and_question()[0])
        indices = keep_all(cache)
        indices[0] = [torch.arange(3), torch.arange(3)]
        with pytest.raises(ValueError, match="layer 0 is a sliding-window layer and is not compacted"):
            CompactedCache.from_selection(cache, indices)


def test_enable_rejects_non_models():
    with pytest.raises(TypeError, match="model must be a transformers PreTrainedModel"):
        hf_structkv.enable(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_beam_search_over_a_shared_context(arch):
    """Beam expansion and reordering act on the appended tokens; the shared context needs neither."""
    model = tiny_model(arch)
    context, question = context_and_question(seed=11)
    full = torch.cat([context, question], 1)
    kwargs = dict(max_new_tokens=6, do_sample=False, num_beams=3, num_return_sequences=2)
    with torch.no_grad():
        expected = model.generate(full, attention_mask=torch.ones_like(full), **kwargs)
        cache = CompactedCache.from_selection(prefill(model, context), keep_all(prefill(model, context)))
        hf_structkv.enable(model)
        got = model.generate(full, attention_mask=torch.ones_like(full), past_key_values=cache, **kwargs)
    assert torch.equal(got[:, full.shape[1] :], expected[:, full.shape[1] :])
