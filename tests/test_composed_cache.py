"""One cache = a compacted context (e.g. a tool catalogue) + a PASK-managed suffix (issue 33, part 1):
`StructuredMixedPrecisionCache(model, policy, context=compacted_cache)`.

keep-all prefix + all-high policy == DynamicCache on the full prompt (every tiny architecture, batch 2 left-padded);
a real (ragged, biased) prefix with mixed actions == a dense softmax over the same served entries; a saved and loaded
context serves two conversations without copying its tensors; crop; clear errors."""

import pytest
import torch
from test_compacted_int4_cache import int4_cache
from test_compacted_serving import keep_all, prefill, random_selection
from test_mixed_precision_cache import ParityTagger, mixed_policy
from transformers import DynamicCache

import hf_structkv
from hf_structkv import CompactedCache
from hf_structkv.attention.mixed_reference import PrefixPartition, mixed_precision_attention
from hf_structkv.attention.mixed_sdpa import fused_mixed_precision_attention
from hf_structkv.cache.compacted_layers import CompactedLayer
from hf_structkv.cache.mixed_precision import StructuredMixedPrecisionCache
from hf_structkv.generation import generation_inputs
from hf_structkv.models import tiny_model
from hf_structkv.persistence import model_fingerprint
from hf_structkv.policy import H2O, Action
from hf_structkv.policy.table import PolicyTable
from hf_structkv.quant import dequantize_int4

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3"]
CONTEXT_LEN = 24


def context_ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (1, CONTEXT_LEN), generator=torch.Generator().manual_seed(seed))


def left_padded_questions(seed: int = 1, lengths=(7, 4)) -> tuple[torch.Tensor, torch.Tensor]:
    """``[2, q]`` question ids, row 1 left-padded, and their tokenizer mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids, mask = torch.zeros(len(lengths), width, dtype=torch.long), torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, 256, (n,), generator=g)
        mask[row, width - n :] = 1
    return ids, mask


def composed_generate(model, cache, questions, mask, new_tokens=12, tagger=None):
    inputs = generation_inputs(cache, questions, mask)
    extra = {} if tagger is None else {"logits_processor": [tagger]}
    with torch.no_grad():
        out = model.generate(
            **inputs,
            past_key_values=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            **extra,
        )
    return out[:, inputs["input_ids"].shape[1] :]


@pytest.mark.parametrize("arch", ARCHS)
def test_keep_all_prefix_all_high_generates_what_dynamic_cache_generates(arch):
    model = hf_structkv.enable(tiny_model(arch))
    context = context_ids()
    questions, mask = left_padded_questions()
    want = []
    for row in range(2):  # each row alone, unpadded, on a DynamicCache over the full prompt
        full_ids = torch.cat([context, questions[row : row + 1, mask[row].bool()]], 1)
        with torch.no_grad():
            out = model.generate(
                input_ids=full_ids,
                attention_mask=torch.ones_like(full_ids),
                max_new_tokens=12,
                min_new_tokens=12,
                do_sample=False,
                past_key_values=DynamicCache(config=model.config),
            )
        want.append(out[0, full_ids.shape[1] :])
    want = torch.stack(want)
    catalogue = CompactedCache.from_selection(prefill(model, context), keep_all(prefill(model, context)))
    tagger = ParityTagger()
    cache = StructuredMixedPrecisionCache(
        model, PolicyTable.all_high(model.config, window=2), processor=tagger, context=catalogue
    )
    got = composed_generate(model, cache, questions, mask, tagger=tagger)
    assert torch.equal(got, want), (got, want)
    layer = cache.mixed_layers()[0]
    assert layer.high.num_entries() > 0  # suffix tokens left the window into the store
    slots = layer.high.view()[1]
    assert int(slots[slots >= 0].min()) == CONTEXT_LEN  # the suffix's slots continue after the context
    assert cache.get_seq_length() == CONTEXT_LEN + questions.shape[1] + 11
    assert cache.scheduled_payload() == cache.full_payload() > 0


def _stored_prefix(layer, kv_head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys, values and biases the context's `CompactedLayer` stores for ``kv_head`` (a layer in the model's
    dtype)."""
    keys, values, bias, offsets = layer.context.read_prefix(None)
    rows = slice(offsets[kv_head], offsets[kv_head + 1])
    return keys[rows], values[rows], bias[rows]


def _served_entries(layer, kv_head: int, row: int, dim: int, prefix=None):
    """Keys, values and additive biases of every entry ``row`` of ``layer`` serves for ``kv_head``, rebuilt one by one:
    the prefix (``prefix`` = its ``(keys, values, biases)``, default `_stored_prefix`), the high store, the
    dequantised low store, the recent region; and their slots (``-1`` for prefix entries)."""
    keys, values, bias = _stored_prefix(layer, kv_head) if prefix is None else prefix
    out_k, out_v, out_b = [keys.double()], [values.double()], [bias.double()]
    slots = [torch.full((keys.shape[0],), -1)]
    if layer.high.num_entries():
        fields, positions = layer.high.view()
        live = positions[row] >= 0
        out_k.append(fields["keys"][row, kv_head][live].double())
        out_v.append(fields["values"][row, kv_head][live].double())
        slots.append(positions[row][live].long())
    if layer.low.num_entries():
        fields, positions = layer.low.view()
        live = positions[row] >= 0
        k = dequantize_int4(fields["key_codes"], fields["key_scales"], dim)[row, kv_head][live]
        v = dequantize_int4(fields["value_codes"], fields["value_scales"], dim)[row, kv_head][live]
        out_k.append(k.double())
        out_v.append(v.double())
        slots.append(positions[row][live].long())
    out_k.append(layer.keys[row, kv_head].double())
    out_v.append(layer.values[row, kv_head].double())
    slots.append(torch.arange(layer.first_recent, layer.get_seq_length()))
    n_suffix = sum(s.numel() for s in slots[1:])
    out_b.append(torch.zeros(n_suffix, dtype=torch.float64))
    return torch.cat(out_k), torch.cat(out_v), torch.cat(out_b), torch.cat(slots)


def assert_dense_attention_over_the_served_entries(model, cache, mask, prefix_of=None) -> None:
    """Every global layer of ``cache`` (after a generation over the left-padded question ``mask`` ``[2, q]``) attends
    a random query as a float64 softmax over its served entries (`_served_entries`), one query head and row at a time;
    ``prefix_of(layer_index, kv_head)`` gives the prefix's ``(keys, values, biases)`` (default: what is stored)."""
    for index, layer in enumerate(cache.mixed_layers()):
        assert layer.low.num_entries() > 0 and layer.first_recent > CONTEXT_LEN
        seen = layer.get_seq_length()
        padding = torch.cat([torch.ones(2, CONTEXT_LEN), mask, torch.ones(2, seen - CONTEXT_LEN - mask.shape[1])], 1)
        query = torch.randn(2, model.config.num_attention_heads, 1, layer.keys.shape[-1])
        parts = layer.partitions(padding.bool()[:, None, None, :], 1)
        assert isinstance(parts[0], PrefixPartition) and parts[0].prefix.keys is layer.context.prefix_keys
        reference = mixed_precision_attention(query, parts, scaling=0.25).double()  # [B, 1, H_q, D]
        fused = fused_mixed_precision_attention(query, parts, scaling=0.25).double()
        group = query.shape[1] // layer.keys.shape[1]
        for row in range(2):
            for q_head in range(query.shape[1]):
                prefix = None if prefix_of is None else prefix_of(index, q_head // group)
                keys, values, bias, slots = _served_entries(layer, q_head // group, row, layer.keys.shape[-1], prefix)
                visible = (slots < 0) | padding[row, slots.clamp_min(0)].bool()
                scores = keys @ query[row, q_head, 0].double() * 0.25 + bias
                weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), 0)
                for got in (reference, fused):
                    torch.testing.assert_close(got[row, 0, q_head], weights @ values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_real_prefix_with_mixed_actions_equals_dense_attention_over_the_served_entries(arch):
    model = hf_structkv.enable(tiny_model(arch))
    context = context_ids(seed=3)
    indices, biases = random_selection(prefill(model, context), 0.4, seed=2)
    catalogue = CompactedCache.from_selection(prefill(model, context), indices, biases)
    questions, mask = left_padded_questions(seed=4, lengths=(9, 6))
    policy = mixed_policy(model, window=3)
    plan = torch.randint(
        0, 3, (2, questions.shape[1], len(policy.costs.groups)), generator=torch.Generator().manual_seed(5)
    )
    tagger = ParityTagger()
    cache = StructuredMixedPrecisionCache(model, policy, processor=tagger, prefill_plan=plan, context=catalogue)
    composed_generate(model, cache, questions, mask, new_tokens=10, tagger=tagger)
    assert_dense_attention_over_the_served_entries(model, cache, mask)
    # the plan's released / quantised prompt tokens really left the stores
    layer = cache.mixed_layers()[0]
    group = layer.group
    high_slots = set(layer.high.view()[1][0].tolist())
    for i, action in enumerate(plan[0, :, group].tolist()):
        assert ((CONTEXT_LEN + i) in high_slots) == (action == Action.H)


def int4_context(model, seed: int) -> tuple[CompactedCache, list]:
    """A compacted context of ``CONTEXT_LEN`` random tokens, ragged kept entries with biases: KV head 0 in the model's
    dtype, the others INT4 (keys per channel in groups of 8); and ``expected[layer][kv_head]`` = the served
    ``(keys, values)``, dequantised independently of the cache (`int4_cache`)."""
    catalogue, expected = int4_cache(model, context_ids(seed), key_group=8, plain_heads=(0,), seed=seed)
    assert all("int4" in layer.head_storage() for layer in catalogue.layers)
    return catalogue, expected


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int4_context_with_mixed_actions_equals_dense_attention_over_the_dequantised_entries(arch):
    model = hf_structkv.enable(tiny_model(arch))
    catalogue, expected = int4_context(model, seed=13)
    questions, mask = left_padded_questions(seed=14, lengths=(9, 6))
    policy = mixed_policy(model, window=3)
    plan = torch.randint(0, 3, (2, questions.shape[1], 3), generator=torch.Generator().manual_seed(15))
    tagger = ParityTagger()
    cache = StructuredMixedPrecisionCache(model, policy, processor=tagger, prefill_plan=plan, context=catalogue)
    composed_generate(model, cache, questions, mask, new_tokens=10, tagger=tagger)

    def prefix_of(index: int, kv_head: int):
        _, _, bias, offsets = catalogue.layers[index].read_prefix(None)  # biases are stored in FP32, never quantised
        return (*expected[index][kv_head], bias[offsets[kv_head] : offsets[kv_head + 1]])

    assert_dense_attention_over_the_served_entries(model, cache, mask, prefix_of)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int4_context_generates_batch_2_left_padded(arch):
    """All-high: the composed cache generates what the INT4 `CompactedCache` itself generates (its own attention
    path); mixed actions: the left-padded batch generates what each row generates alone."""
    model = hf_structkv.enable(tiny_model(arch))
    catalogue, _ = int4_context(model, seed=16)
    questions, mask = left_padded_questions(seed=17)
    inputs = generation_inputs(catalogue.copy(), questions, mask)
    with torch.no_grad():
        compacted = model.generate(
            **inputs, past_key_values=catalogue.copy(), max_new_tokens=12, min_new_tokens=12, do_sample=False
        )
    tagger = ParityTagger()
    all_high = StructuredMixedPrecisionCache(
        model, PolicyTable.all_high(model.config, window=2), processor=tagger, context=catalogue
    )
    got = composed_generate(model, all_high, questions, mask, tagger=tagger)
    assert torch.equal(got, compacted[:, inputs["input_ids"].shape[1] :])

    def mixed(rows, row_mask):
        tagger = ParityTagger()
        cache = StructuredMixedPrecisionCache(model, mixed_policy(model, window=3), processor=tagger, context=catalogue)
        return composed_generate(model, cache, rows, row_mask, tagger=tagger), cache

    batch, cache = mixed(questions, mask)
    assert all(layer.low.num_entries() > 0 for layer in cache.mixed_layers())  # mixed actions really ran
    for row in range(2):
        alone = questions[row : row + 1, mask[row].bool()]
        assert torch.equal(mixed(alone, torch.ones_like(alone))[0][0], batch[row]), row
    assert catalogue.get_seq_length() == CONTEXT_LEN  # never appended to


def test_saved_context_serves_two_conversations_without_copying_it(tmp_path):
    model = hf_structkv.enable(tiny_model("qwen2"))
    context = context_ids(seed=6)
    indices, biases = random_selection(prefill(model, context), 0.5, seed=7)
    metadata = {"fingerprint": model_fingerprint(model)}
    made = CompactedCache.from_selection(prefill(model, context), indices, biases, metadata=metadata)
    made.save_pretrained(tmp_path / "catalogue")
    loaded = CompactedCache.from_pretrained(tmp_path / "catalogue", model=model)
    policy = PolicyTable.all_high(model.config, window=2)
    conversations = [left_padded_questions(seed=s, lengths=(5,)) for s in (8, 9)]
    caches, answers = [], []
    for questions, mask in conversations:
        cache = StructuredMixedPrecisionCache(model, policy, context=loaded)
        answers.append(composed_generate(model, cache, questions, mask, new_tokens=6))
        caches.append(cache)
    for first, second, source in zip(caches[0].layers, caches[1].layers, loaded.layers, strict=True):
        if isinstance(source, CompactedLayer):
            assert first.context is source and second.context is source
            for tensor in source.context_tensors():
                assert tensor.data_ptr() in {t.data_ptr() for t in first.context.context_tensors()}
    for cache in caches:
        context_bytes = sum(layer.context_nbytes() for layer in cache.mixed_layers())
        assert context_bytes == sum(layer.nbytes() for layer in loaded.layers) > 0
        assert cache.nbytes() > context_bytes
    # nothing lost on the round trip: the unsaved context answers the same
    for (questions, mask), answer in zip(conversations, answers, strict=True):
        again = composed_generate(model, StructuredMixedPrecisionCache(model, policy, context=made), questions, mask, 6)
        assert torch.equal(again, answer)
    assert loaded.get_seq_length() == CONTEXT_LEN  # the context itself was never appended to


def test_crop_restores_the_suffix_and_never_cuts_the_context():
    model = hf_structkv.enable(tiny_model("gemma3"))
    context = context_ids(seed=10)
    catalogue = CompactedCache.from_selection(prefill(model, context), keep_all(prefill(model, context)))
    policy = PolicyTable.all_high(model.config, window=4)
    questions, mask = left_padded_questions(seed=11, lengths=(6, 3))
    inputs = generation_inputs(catalogue, questions, mask)
    step = torch.randint(3, 256, (2, 3), generator=torch.Generator().manual_seed(12))

    def run(cache, new_ids, full_mask):
        """Forward ``new_ids`` after what ``cache`` holds; ``full_mask`` covers every slot, positions from it."""
        positions = (full_mask.cumsum(-1) - 1).clamp_min(0)[:, -new_ids.shape[1] :]
        with torch.no_grad():
            out = model(new_ids, attention_mask=full_mask, position_ids=positions, past_key_values=cache)
        return out.logits

    question_ids, prompt_mask = inputs["input_ids"][:, CONTEXT_LEN:], inputs["attention_mask"]
    step_mask = torch.cat([prompt_mask, torch.ones(2, 3, dtype=torch.long)], 1)
    cropped = StructuredMixedPrecisionCache(model, policy, context=catalogue)
    run(cropped, question_ids, prompt_mask)
    run(cropped, step, step_mask)  # a speculative step ...
    cropped.crop(-3)  # ... rejected
    assert cropped.get_seq_length() == prompt_mask.shape[1]
    again = run(cropped, step.flip(1), step_mask)
    straight = StructuredMixedPrecisionCache(model, policy, context=catalogue)
    run(straight, question_ids, prompt_mask)
    want = run(straight, step.flip(1), step_mask)
    torch.testing.assert_close(again, want)
    with pytest.raises(ValueError, match="compacted context of 24 tokens cannot be cut"):
        cropped.crop(CONTEXT_LEN - 1)
    assert cropped.get_seq_length() == prompt_mask.shape[1] + 3


def test_bad_contexts_are_refused_before_any_forward():
    model = tiny_model("llama")
    policy = PolicyTable.all_high(model.config)
    with pytest.raises(TypeError, match="context must be a CompactedCache"):
        StructuredMixedPrecisionCache(model, policy, context=DynamicCache())
    other = hf_structkv.enable(tiny_model("llama", num_key_value_heads=4))
    wrong = CompactedCache.from_selection(prefill(other, context_ids()), keep_all(prefill(other, context_ids())))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        StructuredMixedPrecisionCache(model, policy, context=wrong)
    gemma = hf_structkv.enable(tiny_model("gemma3"))
    sliding = CompactedCache.from_selection(prefill(gemma, context_ids()), keep_all(prefill(gemma, context_ids())))
    with pytest.raises(ValueError, match="layers"):
        StructuredMixedPrecisionCache(model, policy, context=sliding)
    mine = CompactedCache.from_selection(prefill(model, context_ids()), keep_all(prefill(model, context_ids())))
    with pytest.raises(ValueError, match="attention statistics"):
        StructuredMixedPrecisionCache(model, H2O(model, sink_tokens=2, window=4, heavy_ratio=0.5), context=mine)


def test_a_context_prefix_is_served_by_the_fused_torch_path_when_triton_is_selected(monkeypatch, kernel_calls):
    """The Triton mixed kernel reads slot stores only (no ragged biased prefix): with ``HF_STRUCTKV_ATTENTION_BACKEND``
    selecting Triton, a layer with a compacted context is served by the torch backend's fused SDPA path (same tokens
    as the torch backend, no kernel call), while the same policy without a context does call the kernel."""
    pytest.importorskip("triton", reason="triton is not importable: pip install hf-structkv[triton]")
    from hf_structkv.attention.backend import BACKEND_ENV
    from hf_structkv.attention.kernels import mixed_attention, runtime

    if not runtime.interpreter_ready():
        pytest.skip("CPU runs of the Triton kernels need TRITON_INTERPRET=1 before triton is imported (conftest)")
    calls = kernel_calls(mixed_attention, "triton_mixed_precision_attention")  # each call's query shape
    model = hf_structkv.enable(tiny_model("llama"))
    context = context_ids(seed=18)
    indices, biases = random_selection(prefill(model, context), 0.5, seed=19)
    catalogue = CompactedCache.from_selection(prefill(model, context), indices, biases)
    questions, mask = left_padded_questions(seed=20)

    def run(backend: str, with_context: bool) -> torch.Tensor:
        monkeypatch.setenv(BACKEND_ENV, backend)
        tagger = ParityTagger()
        cache = StructuredMixedPrecisionCache(
            model, mixed_policy(model, window=2), processor=tagger, context=catalogue if with_context else None
        )
        if with_context:
            return composed_generate(model, cache, questions, mask, new_tokens=6, tagger=tagger)
        with torch.no_grad():
            return model.generate(
                input_ids=questions,
                attention_mask=mask,
                past_key_values=cache,
                max_new_tokens=2,
                do_sample=False,
                logits_processor=[tagger],
            )

    composed_torch = run("torch", with_context=True)
    assert torch.equal(run("triton", with_context=True), composed_torch) and not calls
    run("triton", with_context=False)
    assert len(calls) == 2 * model.config.num_hidden_layers  # the prompt forward + 1 decode step
