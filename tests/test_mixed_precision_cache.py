"""`StructuredMixedPrecisionCache`: all-high == DynamicCache, mixed attention == a dense reference over the same
stored entries, released / quantised tokens really leave the stored tensors, crop restores state, clear errors."""

import os

import pytest
import torch
from transformers import DynamicCache, LogitsProcessor

from hf_structkv.attention.mixed_reference import mixed_precision_attention
from hf_structkv.attention.mixed_sdpa import fused_mixed_precision_attention
from hf_structkv.cache.mixed_precision import StructuredMixedPrecisionCache
from hf_structkv.cache.mixed_precision_layer import MixedPrecisionLayer
from hf_structkv.models import tiny_model
from hf_structkv.policy.costs import Action, GroupCosts
from hf_structkv.policy.table import PolicyEntry, PolicyTable
from hf_structkv.quant import dequantize_int4
from hf_structkv.structure.tags import StructuralTag

SCAFFOLD = StructuralTag("pure_scaffold", "scaffold_separator", "boundary", "no_lookahead")
FREE = StructuralTag("free_generation", "optional", "boundary", "no_lookahead")
KEY = StructuralTag("schema_bearing", "dispatch_key", "critical", "no_lookahead")


class ParityTagger(LogitsProcessor):
    """Test double of the structural processor: tags generated tokens by token id (even: scaffold, odd: free
    text, multiples of 5: a dispatch key), derived from input_ids on every call, as the real one."""

    family = "function_calling"
    tag_view = "full"
    position_bins = ()

    def __init__(self):
        self.prompt_length = None
        self.generated: list[list[int]] = []

    def reset(self):
        self.__init__()

    def __call__(self, input_ids, scores):
        if self.prompt_length is None:
            self.prompt_length = input_ids.shape[1]
        self.generated = input_ids[:, self.prompt_length :].tolist()
        return scores

    def tags(self, seq):
        return [self.tag_at(seq, i) for i in range(self.num_tagged(seq))]

    def num_tagged(self, seq):
        return len(self.generated[seq])

    def tag_at(self, seq, index):
        token = self.generated[seq][index]
        return (KEY,) if token % 5 == 0 else (SCAFFOLD,) if token % 2 == 0 else (FREE,)


def mixed_policy(model, window=3, sink=2, budget=0.5, groups=3):
    costs = GroupCosts.from_config(model.config, groups)
    groups = len(costs.groups)

    def entry(action, floor):
        return PolicyEntry((Action[action],) * groups, (Action[floor],) * groups, ((1.0, 1.0),) * groups)

    entries = {"pure_scaffold": entry("R", "R"), "free_generation": entry("L", "L"), "schema_bearing": entry("H", "H")}
    return PolicyTable(
        family="function_calling",
        costs=costs,
        entries=entries,
        budget=budget,
        sink_tokens=sink,
        window=window,
        provenance="illustrative",
    )


def padded_batch(seed=0, length=9):
    torch.manual_seed(seed)
    ids = torch.randint(3, 256, (2, length))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    return ids, mask


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma3"])
def test_all_high_policy_generates_what_dynamic_cache_generates(arch):
    model = tiny_model(arch)
    ids, mask = padded_batch()
    want = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=12,
        do_sample=False,
        past_key_values=DynamicCache(config=model.config),
    )
    tagger = ParityTagger()
    cache = StructuredMixedPrecisionCache(model, PolicyTable.all_high(model.config, window=2), processor=tagger)
    got = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=12,
        do_sample=False,
        logits_processor=[tagger],
        past_key_values=cache,
    )
    assert torch.equal(got, want)
    assert cache.scheduled_payload() == cache.full_payload()


def test_all_high_beam_search_equals_dynamic_cache():
    model = tiny_model("llama")
    ids, mask = padded_batch()
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, num_beams=3)
    want = model.generate(**kwargs, past_key_values=DynamicCache(config=model.config))
    got = model.generate(
        **kwargs, past_key_values=StructuredMixedPrecisionCache(model, PolicyTable.all_high(model.config, window=1))
    )
    assert torch.equal(got, want)


def _dense_view(layer: MixedPrecisionLayer):
    """Keys / values ``[B, H, seen, D]`` rebuilt slot by slot from wherever the layer holds them (INT4 entries
    dequantised) and ``stored [B, seen]``; also checks that no slot is held twice."""
    batch, heads, _, dim = layer.keys.shape
    seen = layer.get_seq_length()
    keys, values = torch.zeros(batch, heads, seen, dim), torch.zeros(batch, heads, seen, dim)
    count = torch.zeros(batch, seen, dtype=torch.int64)
    count[:, layer.first_recent :] += 1
    keys[:, :, layer.first_recent :], values[:, :, layer.first_recent :] = layer.keys.float(), layer.values.float()
    for store, rebuild in (
        (layer.high, lambda f: (f["keys"].float(), f["values"].float())),
        (
            layer.low,
            lambda f: (
                dequantize_int4(f["key_codes"], f["key_scales"], dim),
                dequantize_int4(f["value_codes"], f["value_scales"], dim),
            ),
        ),
    ):
        if not store.num_entries():
            continue
        fields, positions = store.view()
        k, v = rebuild(fields)
        for b in range(batch):
            for j, p in enumerate(positions[b].tolist()):
                if p >= 0:
                    keys[b, :, p], values[b, :, p] = k[b, :, j], v[b, :, j]
                    count[b, p] += 1
    assert int(count.max()) == 1
    return keys, values, count.bool()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_mixed_attention_equals_dense_attention_over_the_stored_entries(arch):
    model = tiny_model(arch)
    ids, mask = padded_batch(seed=1)
    tagger = ParityTagger()
    cache = StructuredMixedPrecisionCache(model, mixed_policy(model), processor=tagger)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=20,
        do_sample=False,
        logits_processor=[tagger],
        past_key_values=cache,
    )
    generated = out[:, ids.shape[1] :]
    for layer in cache.mixed_layers():
        keys, values, stored = _dense_view(layer)
        # the stored set is exactly: prompt and sinks (H), generated tokens per their tag, the recent window
        for b in range(2):
            for i, token in enumerate(generated[b, :-1].tolist()):  # the last token's K/V is never computed
                slot = ids.shape[1] + i
                released = token % 5 != 0 and token % 2 == 0 and slot < layer.first_recent
                assert bool(stored[b, slot]) != released
        query = torch.randn(2, model.config.num_attention_heads, 1, keys.shape[-1])
        padding = torch.cat([mask, torch.ones(2, keys.shape[2] - mask.shape[1], dtype=torch.long)], 1).bool()
        attn_mask = padding[:, None, None, :]
        group = query.shape[1] // keys.shape[1]
        scores = (query.double() @ keys.double().repeat_interleave(group, 1).transpose(-1, -2)) * 0.25
        scores = scores.masked_fill(~(stored & padding)[:, None, None, :], float("-inf"))
        want = (torch.softmax(scores, -1) @ values.double().repeat_interleave(group, 1)).transpose(1, 2)
        for attend in (mixed_precision_attention, fused_mixed_precision_attention):
            got = attend(query, layer.partitions(attn_mask, 1), scaling=0.25)
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def tagged_generation(model, policy, new_tokens: int, **inputs) -> tuple[StructuredMixedPrecisionCache, torch.Tensor]:
    """Greedy ``new_tokens`` tokens on a mixed cache of ``policy`` tagged by a `ParityTagger`: (cache, sequences)."""
    tagger = ParityTagger()
    cache = StructuredMixedPrecisionCache(model, policy, processor=tagger)
    sequences = model.generate(
        **inputs,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        logits_processor=[tagger],
        past_key_values=cache,
    )
    return cache, sequences


def test_released_and_quantised_tokens_shrink_the_stored_tensors():
    model = tiny_model("llama")
    cache, _ = tagged_generation(model, mixed_policy(model, window=4), 300, input_ids=torch.randint(3, 256, (1, 8)))
    layer = cache.mixed_layers()[0]
    assert layer.low.num_entries() > 0 and layer.high.num_entries() < cache.get_seq_length() - 4
    assert cache.nbytes() < cache.full_nbytes()
    assert cache.scheduled_payload() < cache.full_payload()


def test_one_layer_group_stores_and_charges_what_three_groups_with_the_same_actions_do():
    """The no-layer-groups ablation: a one-group table whose entries equal a three-group table's tied entries (floors
    at the actions, so no demotion or promotion can differ) gives the same tokens, stores, ledger and bytes."""
    model = tiny_model("qwen2", num_hidden_layers=4)
    ids, mask = padded_batch(length=7)
    states, outputs = [], []
    for groups in (3, 1):
        policy = mixed_policy(model, window=3, groups=groups)
        cache, sequences = tagged_generation(model, policy, 20, input_ids=ids, attention_mask=mask)
        outputs.append(sequences)
        assert len(cache.schedule.decided[0][0]) == groups
        layer = cache.mixed_layers()[-1]
        assert layer.low.num_entries() > 0 and layer.high.num_entries() < cache.get_seq_length() - 4
        states.append((_state(cache)[0], [c.scheduled_bits for c in cache.schedule.controllers], cache.nbytes()))
    assert torch.equal(outputs[0], outputs[1])
    (layers_3, bits_3, bytes_3), (layers_1, bits_1, bytes_1) = states
    assert bits_3 == bits_1 and bytes_3 == bytes_1
    for a, b in zip(layers_3, layers_1, strict=True):
        assert a[0] == b[0] and a[3:5] == b[3:5]
        assert all(torch.equal(a[i][k], b[i][k]) for i in (5, 6) for k in a[i])
    with pytest.raises(ValueError, match=r"prefill_plan must be an int tensor \[batch, prompt_tokens, 1\]"):
        StructuredMixedPrecisionCache(
            model, mixed_policy(model, groups=1), prefill_plan=torch.full((1, 4, 3), 2, dtype=torch.int64)
        )


def _state(cache):
    layers = [
        (
            layer.first_recent,
            layer.keys.clone(),
            layer.values.clone(),
            list(layer.high.counts),
            list(layer.low.counts),
            {k: v.clone() for k, v in layer.high.view()[0].items()},
            {k: v.clone() for k, v in layer.low.view()[0].items()},
        )
        for layer in cache.mixed_layers()
    ]
    ledgers = [(c.balance, c.scheduled_bits, c.num_steps) for c in cache.schedule.controllers]
    return layers, ledgers, [list(d) for d in cache.schedule.decided]


def _assert_same_state(a, b):
    """Ledgers, schedules, slot layout and committed stores exactly; the recent region up to float round-off (a
    token's K/V computed in a 4-token forward differs from the same token computed alone in the last bits)."""
    (layers_a, ledgers_a, decided_a), (layers_b, ledgers_b, decided_b) = a, b
    assert ledgers_a == ledgers_b and decided_a == decided_b
    for la, lb in zip(layers_a, layers_b):
        assert la[0] == lb[0] and la[3:5] == lb[3:5]
        torch.testing.assert_close(la[1], lb[1])
        torch.testing.assert_close(la[2], lb[2])
        for fa, fb in ((la[5], lb[5]), (la[6], lb[6])):
            assert fa.keys() == fb.keys()
            assert all(torch.equal(fa[k], fb[k]) for k in fa)  # committed stores: exact


def test_speculative_rollback_restores_storage_schedule_and_ledger_bit_for_bit():
    model = tiny_model("qwen2")
    ids, mask = padded_batch(seed=2)
    caches = []
    for _ in range(2):
        tagger = ParityTagger()
        cache = StructuredMixedPrecisionCache(model, mixed_policy(model, window=4), processor=tagger)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=12,
            do_sample=False,
            logits_processor=[tagger],
            past_key_values=cache,
        )
        caches.append((cache, tagger))
    (plain, plain_tagger), (speculated, spec_tagger) = caches
    draft = torch.randint(3, 256, (2, 3))
    full_mask = torch.ones(2, out.shape[1] + 3, dtype=torch.long)
    full_mask[:, : mask.shape[1]] = mask
    with torch.no_grad():
        # speculate on the last generated token + 3 drafted ones, tag them, schedule them, then reject the draft
        model(input_ids=torch.cat([out[:, -1:], draft], 1), attention_mask=full_mask, past_key_values=speculated)
        spec_tagger(torch.cat([out, draft], 1), None)
        speculated.scheduled_payload()
        speculated.crop(-3)
        # the accepted token alone, on both caches
        plain_logits = model(input_ids=out[:, -1:], attention_mask=full_mask[:, :-3], past_key_values=plain).logits
    spec_tagger(out, None)
    plain_tagger(out, None)
    plain.scheduled_payload()
    speculated.scheduled_payload()
    _assert_same_state(_state(plain), _state(speculated))
    with torch.no_grad():
        nxt = plain_logits[:, -1].argmax(-1, keepdim=True)
        step_mask = torch.cat([full_mask[:, :-3], torch.ones(2, 1, dtype=torch.long)], 1)
        a = model(input_ids=nxt, attention_mask=step_mask, past_key_values=plain).logits
        b = model(input_ids=nxt, attention_mask=step_mask, past_key_values=speculated).logits
    torch.testing.assert_close(a, b)


def test_mismatches_are_clear_errors():
    model = tiny_model("llama")
    other = tiny_model("gemma3")
    with pytest.raises(ValueError, match="calibrated for this model"):
        StructuredMixedPrecisionCache(model, PolicyTable.all_high(other.config))
    with pytest.raises(TypeError, match="processor must be a TagSource"):
        StructuredMixedPrecisionCache(model, PolicyTable.all_high(model.config), processor=object())
    with pytest.raises(TypeError, match="model must be"):
        StructuredMixedPrecisionCache("llama", PolicyTable.all_high(model.config))
    ablated = PolicyTable.all_high(model.config, tag_view="no_role")
    with pytest.raises(
        ValueError, match=r"calibrated on \(tag_view, position_bins\)=\('no_role', \(\)\), the processor emits \('full'"
    ):
        StructuredMixedPrecisionCache(model, ablated, processor=ParityTagger())
    by_position = PolicyTable.all_high(model.config, tag_view="position_bins", position_bins=(4, 8))
    tagger = ParityTagger()
    tagger.tag_view, tagger.position_bins = "position_bins", (4, 9)
    with pytest.raises(
        ValueError, match=r"\('position_bins', \(4, 8\)\), the processor emits \('position_bins', \(4, 9\)\)"
    ):
        StructuredMixedPrecisionCache(model, by_position, processor=tagger)
    tagger = ParityTagger()
    cache = StructuredMixedPrecisionCache(model, mixed_policy(model, window=1), processor=tagger)
    ids = torch.randint(3, 256, (1, 5))
    with pytest.raises(RuntimeError, match="pass the cache's processor in logits_processor"):
        model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, past_key_values=cache)


def test_policy_and_processor_must_be_of_the_declared_interfaces():
    """Having the members is not enough: the policy must be a `RetentionPolicy`; the processor must offer every
    member of `TagSource`, its tag view included."""
    model = tiny_model("llama")
    table = PolicyTable.all_high(model.config)

    class DuckPolicy:  # every member of a RetentionPolicy, without being one
        costs, sink_tokens, window, tag_view, position_bins = table.costs, 0, 1, "full", ()

        def controller(self, costs):
            return table.controller(costs)

        def attention_statistics(self):
            return None

    with pytest.raises(TypeError, match=r"^policy must be a RetentionPolicy .*got DuckPolicy$"):
        StructuredMixedPrecisionCache(model, DuckPolicy())

    class ViewlessTagger:  # what the cache read before tag views existed: no tag_view / position_bins
        prompt_length = None

        def num_tagged(self, seq):
            return 0

        def tag_at(self, seq, index):
            return ()

    with pytest.raises(TypeError, match=r"^processor must be a TagSource.*got ViewlessTagger$"):
        StructuredMixedPrecisionCache(model, table, processor=ViewlessTagger())
    assert StructuredMixedPrecisionCache(model, table, processor=ParityTagger()).processor is not None


@pytest.mark.slow
def test_all_high_on_the_embedded_model_equals_dynamic_cache(default_model):
    model, tokenizer = default_model
    prompts = ["def fibonacci(n):", "Write a JSON object with a name and an age:"]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    kwargs = dict(**batch, max_new_tokens=16, do_sample=False)
    want = model.generate(**kwargs, past_key_values=DynamicCache(config=model.config))
    cache = StructuredMixedPrecisionCache(model, PolicyTable.all_high(model.config, window=4))
    got = model.generate(**kwargs, past_key_values=cache)
    assert torch.equal(got, want)


def test_generation_through_the_triton_kernel_equals_the_torch_reference(monkeypatch):
    pytest.importorskip("triton", reason="triton is not importable: pip install hf-structkv[triton]")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU runs of the Triton kernels need TRITON_INTERPRET=1 before triton is imported (conftest)")
    from hf_structkv.attention.backend import BACKEND_ENV

    model = tiny_model("llama")
    ids, mask = padded_batch(seed=3)
    outputs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv(BACKEND_ENV, backend)
        tagger = ParityTagger()
        cache = StructuredMixedPrecisionCache(model, mixed_policy(model, window=2), processor=tagger)
        outputs[backend] = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=6,
            do_sample=False,
            logits_processor=[tagger],
            past_key_values=cache,
            output_scores=True,
            return_dict_in_generate=True,
        )
    assert torch.equal(outputs["torch"].sequences, outputs["triton"].sequences)
    for a, b in zip(outputs["torch"].scores, outputs["triton"].scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_a_prefill_plan_quantises_and_releases_prompt_tokens_after_the_window():
    model = tiny_model("llama")
    torch.manual_seed(4)
    ids = torch.randint(3, 256, (2, 12))
    plan = torch.full((2, 12, 3), int(Action.H))
    plan[0, :, :] = int(Action.R)  # row 0 releases its prompt
    plan[1, :, 0] = int(Action.L)  # row 1 quantises it in the lower group only
    cache = StructuredMixedPrecisionCache(model, mixed_policy(model, window=3, sink=2), prefill_plan=plan)
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache)
        model(input_ids=ids[:, :1], past_key_values=cache)  # the next update commits the prompt
    lower, middle = cache.mixed_layers()  # tiny llama: layer 0 lower group, layer 1 middle group
    # the plan is followed as given (it carries its own sink protection): row 0 keeps nothing of its prompt
    assert lower.high.num_entries() == 0 and lower.low.counts == [0, 12 - 3] and middle.high.counts == [0, 12 - 3]
    assert lower.first_recent == 12 - 3 + 1 - 1 and lower.keys.shape[-2] == 3 + 1
    lower_l = cache.costs.cost(Action.L, 0) + cache.costs.cost(Action.H, 1) + cache.costs.cost(Action.H, 2)
    want = 0 + 12 * lower_l  # row 0 releases everything; row 1 keeps 12 tokens, L in the lower group
    assert cache.schedule.scheduled_bits(12) == want
    with pytest.raises(ValueError, match="prefill_plan must be"):
        StructuredMixedPrecisionCache(model, mixed_policy(model), prefill_plan=torch.zeros(2, 12))
    with pytest.raises(ValueError, match="outside Action"):
        StructuredMixedPrecisionCache(model, mixed_policy(model), prefill_plan=torch.full((1, 2, 3), 5))
