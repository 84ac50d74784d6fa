"""A prompt prefilled in several forwards (`StructuredMixedPrecisionCache(..., prompt_length=P)`): nothing is committed
until the whole prompt is cached, so chunked prefill equals one forward — the logits of the prompt's rows and the
tokens ``generate(..., prefill_chunk_size=k)`` generates, with a mixed prefill plan and a mixed decode policy, batch 2
left-padded, with and without a compacted context; an undeclared chunked prefill is refused with what to do."""

import pytest
import torch
from test_compacted_serving import prefill, random_selection
from test_composed_cache import context_ids, left_padded_questions
from test_mixed_precision_cache import ParityTagger, mixed_policy

import hf_structkv
from hf_structkv import CompactedCache
from hf_structkv.cache.mixed_precision import StructuredMixedPrecisionCache
from hf_structkv.generation import generation_inputs
from hf_structkv.models import tiny_model
from hf_structkv.policy import H2O

LENGTHS = (13, 9)  # row 1 left-padded by 4


def plan(batch: int, length: int, groups: int, seed: int) -> torch.Tensor:
    """Random prompt actions ``[B, P, groups]`` (R, L and H)."""
    return torch.randint(0, 3, (batch, length, groups), generator=torch.Generator().manual_seed(seed))


def build(model, policy, inputs, context=None, prompt_length=None, seed=7):
    tagger = ParityTagger()
    cache = StructuredMixedPrecisionCache(
        model,
        policy,
        processor=tagger,
        prefill_plan=plan(2, max(LENGTHS), len(policy.costs.groups), seed),
        context=context,
        prompt_length=prompt_length,
    )
    return cache, tagger


def catalogue_of(model):
    context = context_ids(seed=5)
    indices, biases = random_selection(prefill(model, context), 0.5, seed=6)
    return CompactedCache.from_selection(prefill(model, context), indices, biases)


def inputs_for(model, with_context: bool):
    """``(inputs, context)``: left-padded questions (after placeholders of a compacted context when asked)."""
    questions, mask = left_padded_questions(seed=8, lengths=LENGTHS)
    if not with_context:
        return {"input_ids": questions, "attention_mask": mask}, None
    context = catalogue_of(model)
    return generation_inputs(context, questions, mask), context


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("with_context", [False, True], ids=["plain", "context"])
@pytest.mark.parametrize("chunk", [1, 4, 6])
def test_chunked_prompt_forwards_give_the_logits_of_one_forward(arch, with_context, chunk):
    model = hf_structkv.enable(tiny_model(arch))
    policy = mixed_policy(model, window=2, sink=1)
    inputs, context = inputs_for(model, with_context)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    positions = (mask.cumsum(-1) - 1).clamp_min(0)  # as generate derives them from the mask
    one_cache, _ = build(model, policy, inputs, context)
    first = one_cache.get_seq_length()  # the context's placeholders are cached already
    with torch.no_grad():
        want = model(
            input_ids=ids[:, first:], attention_mask=mask, position_ids=positions[:, first:], cache=one_cache
        ).logits  # [B, P - T, V]
        cache, _ = build(model, policy, inputs, context, prompt_length=ids.shape[1])
        got = []
        for start in range(first, ids.shape[1], chunk):
            stop = min(start + chunk, ids.shape[1])
            chunk_inputs = {"input_ids": ids[:, start:stop], "position_ids": positions[:, start:stop]}
            got.append(model(**chunk_inputs, attention_mask=mask[:, :stop], cache=cache).logits)
    torch.testing.assert_close(torch.cat(got, 1), want, atol=1e-5, rtol=1e-5)
    for layer, one_layer in zip(cache.mixed_layers(), one_cache.mixed_layers(), strict=True):
        assert layer.high.num_entries() == layer.low.num_entries() == 0  # nothing committed inside the prompt
        torch.testing.assert_close(layer.keys, one_layer.keys, atol=1e-5, rtol=1e-5)  # the whole prompt, recent


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("with_context", [False, True], ids=["plain", "context"])
def test_generate_with_prefill_chunks_generates_what_one_prefill_generates(arch, with_context):
    model = hf_structkv.enable(tiny_model(arch))
    policy = mixed_policy(model, window=2, sink=1)
    inputs, context = inputs_for(model, with_context)

    def run(prefill_chunk_size):
        prompt_length = None if prefill_chunk_size is None else inputs["input_ids"].shape[1]
        cache, tagger = build(model, policy, inputs, context, prompt_length=prompt_length)
        with torch.no_grad():
            out = model.generate(
                **inputs,
                cache=cache,
                logits_processor=[tagger],
                max_new_tokens=10,
                min_new_tokens=10,
                do_sample=False,
                prefill_chunk_size=prefill_chunk_size,
                output_logits=True,
                return_dict_in_generate=True,
            )
        return out.sequences, torch.stack(out.logits), cache

    want, want_logits, one_cache = run(None)
    got, got_logits, cache = run(3)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
    layers = list(zip(cache.mixed_layers(), one_cache.mixed_layers(), strict=True))
    assert all(layer.low.num_entries() > 0 for layer, _ in layers)  # the plan and the policy did quantise
    for layer, one_layer in layers:
        assert torch.equal(layer.high.view()[1], one_layer.high.view()[1])  # the same slots kept ...
        assert torch.equal(layer.low.view()[1], one_layer.low.view()[1])  # ... and quantised
    assert cache.scheduled_payload() == one_cache.scheduled_payload() < cache.full_payload()


def test_undeclared_chunked_prefill_is_refused_with_what_to_do():
    model = hf_structkv.enable(tiny_model("llama"))
    policy = mixed_policy(model, window=2, sink=1)
    inputs, _ = inputs_for(model, with_context=False)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    cache, _ = build(model, policy, inputs)
    with torch.no_grad():
        model(input_ids=ids[:, :5], attention_mask=mask[:, :5], cache=cache)
        with pytest.raises(RuntimeError, match=r"prompt_length=input_ids.shape\[1\]"):
            model(input_ids=ids[:, 5:], attention_mask=mask, cache=cache)


def test_declared_prompt_length_that_disagrees_with_the_processor_is_refused():
    model = hf_structkv.enable(tiny_model("llama"))
    inputs, _ = inputs_for(model, with_context=False)
    length = inputs["input_ids"].shape[1]
    cache, tagger = build(model, mixed_policy(model, window=2, sink=1), inputs, prompt_length=length + 1)
    with pytest.raises(ValueError, match=f"declared a prompt of {length + 1} tokens.*the processor saw {length}"):
        with torch.no_grad():
            model.generate(**inputs, cache=cache, logits_processor=[tagger], max_new_tokens=4, do_sample=False)


def test_bad_prompt_lengths_are_refused_before_any_forward():
    model = hf_structkv.enable(tiny_model("llama"))
    policy = mixed_policy(model)
    for bad in (0, -2, 3.0, True, "12"):
        with pytest.raises(ValueError, match="prompt_length must be an int greater than the context's 0 tokens"):
            StructuredMixedPrecisionCache(model, policy, prompt_length=bad)
    context = catalogue_of(model)
    with pytest.raises(ValueError, match="greater than the context's 24 tokens"):
        StructuredMixedPrecisionCache(model, policy, context=context, prompt_length=24)
    with pytest.raises(ValueError, match="prefill_plan covers 12 tokens"):
        StructuredMixedPrecisionCache(
            model, policy, prefill_plan=plan(1, 12, len(policy.costs.groups), seed=0), prompt_length=11
        )
    with pytest.raises(ValueError, match="attention statistics"):
        StructuredMixedPrecisionCache(model, H2O(model, sink_tokens=2, window=4, heavy_ratio=0.5), prompt_length=9)
