"""`generate_calls`: processor + mixed-precision cache + policy in one generate call."""

import pytest
import torch
from test_mixed_precision_cache import mixed_policy
from transformers import DynamicCache, LogitsProcessorList

from hf_structkv.cache.mixed_precision import StructuredMixedPrecisionCache
from hf_structkv.models import tiny_model
from hf_structkv.policy import PolicyTable, illustrative_policy
from hf_structkv.structure import StructuralLogitsProcessor, TagSource, view_tags
from hf_structkv.structured_generation import generate_calls, generate_structured, left_padded_batch, parse_calls

TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "dict",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
    }
]
QUESTIONS = ["Weather in Oslo?", "How warm is it in Lima today, in fahrenheit please?"]


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model("qwen2", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id)


def test_all_high_policy_equals_plain_generate_with_the_same_processor(model, tokenizer):
    result = generate_calls(
        model, tokenizer, QUESTIONS, TOOLS, PolicyTable.all_high(model.config, window=2), max_new_tokens=20
    )
    prompt = result.sequences[:, : result.prompt_length]
    mask = (prompt != tokenizer.pad_token_id).long()
    proc = StructuralLogitsProcessor(tokenizer, tools=TOOLS)
    want = model.generate(
        input_ids=prompt,
        attention_mask=mask,
        max_new_tokens=20,
        do_sample=False,
        logits_processor=LogitsProcessorList([proc]),
        pad_token_id=tokenizer.pad_token_id,
        past_key_values=DynamicCache(config=model.config),
    )
    assert torch.equal(result.sequences, want)
    assert result.bytes_report()["budget_ratio"] == 1.0


def test_the_processor_emits_the_policys_tag_view(model, tokenizer):
    full = generate_calls(model, tokenizer, QUESTIONS, TOOLS, PolicyTable.all_high(model.config), max_new_tokens=12)
    policy = PolicyTable.all_high(model.config, tag_view="no_class")
    ablated = generate_calls(model, tokenizer, QUESTIONS, TOOLS, policy, max_new_tokens=12)
    assert full.processor.tag_view == "full" and ablated.processor.tag_view == "no_class"
    assert torch.equal(full.sequences, ablated.sequences)  # all-high: the view changes tags, not tokens
    for seq in range(2):
        want = [None if t is None else view_tags(t, "no_class", "function_calling") for t in full.processor.tags(seq)]
        assert ablated.processor.tags(seq) == want


def test_mixed_policy_reports_tags_actions_and_bytes(model, tokenizer):
    result = generate_calls(model, tokenizer, QUESTIONS, TOOLS, mixed_policy(model, window=3), max_new_tokens=24)
    assert len(result.texts) == len(result.calls) == 2
    for seq in range(2):
        report = result.token_report(seq, tokenizer)
        assert len(report) == result.processor.num_tagged(seq)
        scheduled = [row for row in report if row["actions"] is not None]
        assert scheduled and all(row["actions"] == "stop" or set(row["actions"]) <= set("RLH") for row in scheduled)
        assert all(row["text"] == tokenizer.decode([row["token"]]) for row in report)
    numbers = result.bytes_report()
    assert numbers["scheduled_payload_bytes"] == result.cache.scheduled_payload()
    assert 0 < numbers["budget_ratio"] < 1
    # the prompt is kept H (no prefill plan): the whole saving is in the decode stage
    assert numbers["prefill_ratio"] == 1.0 and numbers["decode_ratio"] < 1
    prompt_tokens = 2 * result.prompt_length
    decoded = sum(len(d) for d in result.cache.schedule.decided)
    mixed = (prompt_tokens + decoded * numbers["decode_ratio"]) / (prompt_tokens + decoded)
    full_tokens = numbers["full_payload_bytes"] * 8 / result.cache.costs.full
    assert numbers["budget_ratio"] == pytest.approx(mixed * (prompt_tokens + decoded) / full_tokens)
    bytes_per_token = result.cache.costs.full / 8
    assert numbers["prefill_full_bytes"] == prompt_tokens * bytes_per_token
    assert numbers["decode_full_bytes"] == decoded * bytes_per_token
    assert numbers["prefill_payload_bytes"] + numbers["decode_payload_bytes"] == numbers["scheduled_payload_bytes"]
    for stage in ("prefill", "decode"):
        ratio = numbers[f"{stage}_payload_bytes"] / numbers[f"{stage}_full_bytes"]
        assert numbers[f"{stage}_ratio"] == pytest.approx(ratio)


def test_bad_arguments_are_named(model, tokenizer):
    policy = PolicyTable.all_high(model.config)
    with pytest.raises(ValueError, match="builds logits_processor itself"):
        generate_calls(model, tokenizer, "q", TOOLS, policy, logits_processor=[])
    with pytest.raises(ValueError, match="questions must be"):
        generate_calls(model, tokenizer, [], TOOLS, policy)
    with pytest.raises(ValueError, match="each question must be"):
        generate_calls(model, tokenizer, [[{"content": "no role"}]], TOOLS, policy)
    with pytest.raises(TypeError, match="policy must be a RetentionPolicy"):
        generate_calls(model, tokenizer, "q", TOOLS, policy.to_json_dict())
    assert isinstance(StructuralLogitsProcessor(tokenizer, tools=TOOLS), TagSource)


def test_parse_calls_takes_a_json_list_only():
    assert parse_calls('[{"name": "f", "arguments": {"x": 1}}]') == [{"name": "f", "arguments": {"x": 1}}]
    assert parse_calls('{"name": "f"}') is None and parse_calls('[{"name": "f", "argu') is None


def test_generate_structured_continues_a_given_cache_and_checks_it(model, tokenizer):
    """A cache given to continue is used as it is (here empty: the same generation as a fresh one); one built for
    another policy or processor, or with a prefill plan beside it, is refused."""
    policy = PolicyTable.all_high(model.config, window=2)
    batch = left_padded_batch(tokenizer, [QUESTIONS[0]], model.device)
    fresh = generate_structured(model, tokenizer, batch, StructuralLogitsProcessor(tokenizer, tools=TOOLS), policy, 8)
    processor = StructuralLogitsProcessor(tokenizer, tools=TOOLS)
    cache = StructuredMixedPrecisionCache(model, policy, processor=processor)
    given = generate_structured(model, tokenizer, batch, processor, policy, 8, cache=cache)
    assert given.cache is cache and torch.equal(given.sequences, fresh.sequences)
    other = StructuredMixedPrecisionCache(model, PolicyTable.all_high(model.config), processor=processor)
    with pytest.raises(ValueError, match="built with this policy and processor"):
        generate_structured(model, tokenizer, batch, processor, policy, 8, cache=other)
    with pytest.raises(ValueError, match="no prefill_plan"):
        generate_structured(
            model, tokenizer, batch, processor, policy, 8, cache=cache, prefill_plan=torch.ones(1, 1, 3)
        )


def test_chat_messages_keep_their_system_message_after_the_call_instruction():
    from hf_structkv.structured_generation import CALL_INSTRUCTION, _chat

    chat = _chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}])
    assert (
        chat[0] == {"role": "system", "content": CALL_INSTRUCTION + "\n\nBe brief."}
        and chat[1]["content"] == "Weather?"
    )
    assert _chat([{"role": "user", "content": "Hi"}])[0]["content"] == CALL_INSTRUCTION


def test_call_prompt_is_the_prompt_generate_calls_feeds_the_model(model, tokenizer):
    from hf_structkv.structured_generation import call_prompt

    result = generate_calls(model, tokenizer, "Weather in Oslo?", TOOLS, PolicyTable.all_high(model), max_new_tokens=2)
    prompt = call_prompt(tokenizer, "Weather in Oslo?", TOOLS)
    assert prompt.endswith("<|im_start|>assistant\n") and "get_weather" in prompt
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    assert torch.equal(result.sequences[:, : result.prompt_length], ids)


@pytest.mark.slow
def test_embedded_model_calls_the_tool_with_the_illustrative_policy(default_model):
    model, tokenizer = default_model
    result = generate_calls(
        model, tokenizer, "What's the weather in Oslo in celsius?", TOOLS, illustrative_policy(model), max_new_tokens=48
    )
    assert result.calls[0] == [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]
    assert result.bytes_report()["budget_ratio"] < 1
