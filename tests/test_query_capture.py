"""Calibration queries: `capture_queries`, `subsample_queries` and the repeat-pass tier on tiny models."""

import sys

import pytest
import torch

import hf_structkv
from hf_structkv.attention.recording import _ACTIVE, capture_queries
from hf_structkv.compaction import compact, prefill_context
from hf_structkv.compaction.queries import (
    Conversation,
    Piece,
    answer_pieces,
    cap_queries,
    conversation_queries,
    join_pieces,
    piece_spans,
    repeat_pass_queries,
    repetition_conversation,
    subsample_queries,
)
from hf_structkv.generation import context_copy
from hf_structkv.models import tiny_model

N_Q_HEADS, N_KV_HEADS, HEAD_DIM = 4, 2, 16
GROUP = N_Q_HEADS // N_KV_HEADS


def token_ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(seed))


def global_layers(model) -> list[int]:
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
    return [i for i, kind in enumerate(types) if kind == "full_attention"]


def reference_queries(model, input_ids: torch.Tensor, layer: int, cache=None) -> torch.Tensor:
    """``[1, H_q, L, D]`` recomputed from the layer's attention input: q_proj, q_norm (if any), the model's RoPE."""
    attn = model.model.layers[layer].self_attn
    seen = {}

    def grab(module, args, kwargs):
        seen["hidden"], seen["rope"] = kwargs["hidden_states"], kwargs["position_embeddings"]

    handle = attn.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad():
            model(input_ids, cache=cache, use_cache=cache is not None)
    finally:
        handle.remove()
    hidden, (cos, sin) = seen["hidden"], seen["rope"]
    with torch.no_grad():
        query = attn.q_proj(hidden).view(1, hidden.shape[1], -1, HEAD_DIM)
        if hasattr(attn, "q_norm"):
            query = attn.q_norm(query)
        rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        query, _ = rotary(query.transpose(1, 2), query.transpose(1, 2), cos, sin)
    return query


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_queries_match_recomputation_and_are_grouped_per_kv_head(arch):
    model = tiny_model(arch)
    ids = token_ids(10)
    captured = capture_queries(model, ids)
    for layer in global_layers(model):
        reference = reference_queries(model, ids, layer)[0]  # [H_q, L, D]
        got = captured[layer]
        assert got.shape == (N_KV_HEADS, GROUP * 10, HEAD_DIM)
        for h in range(N_KV_HEADS):
            for j in range(GROUP):
                torch.testing.assert_close(got[h, j * 10 : (j + 1) * 10], reference[h * GROUP + j], atol=1e-6, rtol=0)


def test_queries_continue_a_prefilled_cache():
    model = tiny_model("qwen3")
    context, question = token_ids(12), token_ids(5, seed=1)
    captured = capture_queries(model, question, cache=prefill_context(model, context))
    reference = reference_queries(model, question, 1, cache=prefill_context(model, context))[0]
    torch.testing.assert_close(captured[1], reference.reshape(N_KV_HEADS, GROUP * 5, HEAD_DIM), atol=1e-6, rtol=0)


def test_gemma3_records_only_full_attention_layers():
    model = tiny_model("gemma3")
    assert sorted(capture_queries(model, token_ids(12))) == global_layers(model) == [1, 3]


@pytest.mark.parametrize("positions", [slice(3, 8), torch.tensor([0, 4, 9]), torch.tensor([7])])
def test_positions_select_the_same_queries_as_the_full_capture(positions):
    model = tiny_model("llama")
    ids = token_ids(10)
    full, selected = capture_queries(model, ids), capture_queries(model, ids, positions=positions)
    kept = torch.arange(10)[positions]
    for layer, queries in full.items():
        expected = queries.reshape(N_KV_HEADS, GROUP, 10, HEAD_DIM)[:, :, kept].reshape(N_KV_HEADS, -1, HEAD_DIM)
        assert torch.equal(selected[layer], expected)


@pytest.mark.parametrize(("arch", "layers"), [("llama", [0]), ("llama", [1]), ("gemma3", [1, 3]), ("gemma3", [3])])
def test_chosen_layers_equal_the_full_capture_and_stop_the_forward(arch, layers):
    model = tiny_model(arch)
    ids = token_ids(10)
    full = capture_queries(model, ids)
    ran = []
    blocks = model.model.layers
    hooks = [block.register_forward_pre_hook(lambda m, a, i=i: ran.append(i)) for i, block in enumerate(blocks)]
    try:
        chosen = capture_queries(model, ids, layers=layers)
    finally:
        for hook in hooks:
            hook.remove()
    assert sorted(chosen) == layers
    for layer in layers:
        assert torch.equal(chosen[layer], full[layer])
    assert ran == list(range(max(layers) + 1))  # the decoder layers after the last chosen one never ran
    assert model.config._attn_implementation == "sdpa" and _ACTIVE.get() is None


def test_chosen_layers_are_validated():
    model = tiny_model("gemma3")
    with pytest.raises(ValueError, match=r"layers \[0\] are not global"):
        capture_queries(model, token_ids(6), layers=[0])  # a sliding-window layer
    with pytest.raises(ValueError, match=r"layers \[7\] are not global"):
        capture_queries(model, token_ids(6), layers=[7])
    with pytest.raises(ValueError, match="non-empty"):
        capture_queries(model, token_ids(6), layers=[])
    with pytest.raises(TypeError, match="collection"):
        capture_queries(model, token_ids(6), layers=3)


def test_conversation_queries_of_chosen_layers_equal_the_full_capture():
    model = tiny_model("qwen2")
    context = token_ids(9)
    conversations = [
        Conversation("a", token_ids(3, seed=1)[0], token_ids(5, seed=2)[0]),
        Conversation("b", token_ids(2, seed=3)[0], token_ids(4, seed=4)[0]),
    ]
    cache = prefill_context(model, context)
    full = conversation_queries(model, context, conversations, cache)
    chosen = conversation_queries(model, context, conversations, cache, layers=[1])
    assert list(chosen) == [1] and torch.equal(chosen[1], full[1])
    assert cache.get_seq_length() == 9  # the context cache is left as it is


def test_attention_implementation_is_restored_also_when_the_forward_raises():
    model = tiny_model("llama")
    capture_queries(model, token_ids(4))
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(IndexError):
        capture_queries(model, torch.tensor([[3, 10_000]]))  # outside the vocabulary
    assert model.config._attn_implementation == "sdpa"
    assert _ACTIVE.get() is None
    hf_structkv.enable(model)
    capture_queries(model, token_ids(4))
    assert hf_structkv.is_enabled(model)


def test_rejects_batches_and_bad_positions():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"\[1, L\]"):
        capture_queries(model, token_ids(8).repeat(2, 1))
    with pytest.raises(ValueError, match="1-D integer"):
        capture_queries(model, token_ids(8), positions=torch.tensor([[1]]))


def test_enabled_model_serves_a_compacted_cache_while_recording():
    model = tiny_model("qwen2")
    context, question = token_ids(24), token_ids(6, seed=1)
    compacted = compact(model, None, context, ratio=3, method="streaming_llm")
    hf_structkv.enable(model)
    with torch.no_grad():
        expected = model(question, cache=compacted.copy()).logits
    seen = []
    handle = model.register_forward_hook(lambda module, args, output: seen.append(output.logits))
    try:
        captured = capture_queries(model, question, cache=compacted.copy())
    finally:
        handle.remove()
    # capture_queries computes the logits of the last position only (logits_to_keep=1): a one-row lm_head matmul,
    # whose fp32 blocking (and so rounding) differs from the six-row one with the thread count.
    torch.testing.assert_close(seen[0], expected[:, -1:], atol=1e-5, rtol=1e-5)
    assert sorted(captured) == [0, 1]
    assert hf_structkv.is_enabled(model)


# ---------------------------------------------------------------------------------------------------- subsample
def test_subsample_is_seeded_capped_and_without_duplicates():
    queries = torch.arange(1000, dtype=torch.float32)[:, None].repeat(1, 3)  # row i is [i, i, i]
    first, again, other = (subsample_queries(queries, cap=100, seed=s) for s in (0, 0, 1))
    assert first.shape == (100, 3)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    rows = first[:, 0].long()
    assert rows.unique().numel() == 100
    assert torch.equal(first, queries[rows])


def test_subsample_below_cap_returns_everything():
    queries = torch.randn(7, 4)
    assert torch.equal(subsample_queries(queries, cap=7), queries)
    assert torch.equal(subsample_queries(queries), queries)
    with pytest.raises(ValueError, match="cap"):
        subsample_queries(queries, cap=0)


# ---------------------------------------------------------------------------------------------------- repeat pass
INSTRUCTION = torch.tensor([[11, 12, 13, 14, 15]])


def test_repeat_pass_records_the_second_copy_of_the_context():
    model = tiny_model("qwen3")
    context = token_ids(12)
    got = repeat_pass_queries(model, None, context, instruction_ids=INSTRUCTION)
    sequence = torch.cat([context, INSTRUCTION, context], 1)
    expected = capture_queries(model, sequence, positions=torch.arange(17, 29))
    assert sorted(got) == sorted(expected) == [0, 1]
    for layer in got:
        assert got[layer].shape == (N_KV_HEADS, GROUP * 12, HEAD_DIM)
        assert torch.equal(got[layer], expected[layer])


def test_repeat_pass_continuing_a_context_cache_equals_the_single_pass():
    model = tiny_model("llama")
    context = token_ids(12)
    one_pass = repeat_pass_queries(model, None, context, instruction_ids=INSTRUCTION, cap=None)
    cached = prefill_context(model, context)
    continued = repeat_pass_queries(model, None, context, instruction_ids=INSTRUCTION, cap=None, context_cache=cached)
    for layer in one_pass:
        torch.testing.assert_close(continued[layer], one_pass[layer], atol=1e-5, rtol=1e-5)
    assert cached.get_seq_length() == 12  # the pass ran on a copy
    again = repeat_pass_queries(model, None, context, instruction_ids=INSTRUCTION, cap=None, context_cache=cached)
    assert all(torch.equal(again[layer], continued[layer]) for layer in again)
    longer = prefill_context(model, token_ids(13))
    with pytest.raises(ValueError, match="context_cache holds 13 tokens, the context has 12"):
        repeat_pass_queries(model, None, context, instruction_ids=INSTRUCTION, context_cache=longer)


def test_repeat_pass_caps_each_kv_head_with_the_seeded_subsample():
    model = tiny_model("gemma3")
    context = token_ids(12)
    got = repeat_pass_queries(model, None, context, cap=10, seed=3, instruction_ids=INSTRUCTION)
    full = repeat_pass_queries(model, None, context, instruction_ids=INSTRUCTION)
    for layer in (1, 3):
        assert got[layer].shape == (N_KV_HEADS, 10, HEAD_DIM)
        for h in range(N_KV_HEADS):
            assert torch.equal(got[layer][h], subsample_queries(full[layer][h], cap=10, seed=3))


class FakeTokenizer:
    """Whitespace-separated integers -> ids; records the add_special_tokens flag."""

    def __init__(self):
        self.special = []

    def __call__(self, text, return_tensors, add_special_tokens):
        self.special.append(add_special_tokens)
        return type("Encoding", (), {"input_ids": torch.tensor([[int(t) for t in text.split()]])})


def test_repeat_pass_tokenizes_the_instruction_without_special_tokens():
    model = tiny_model("llama")
    context, tokenizer = token_ids(6), FakeTokenizer()
    got = repeat_pass_queries(model, tokenizer, context, instruction="11 12 13 14 15")
    expected = repeat_pass_queries(model, None, context, instruction_ids=INSTRUCTION)
    assert tokenizer.special == [False]
    for layer in expected:
        assert torch.equal(got[layer], expected[layer])
    with pytest.raises(ValueError, match="tokenizer"):
        repeat_pass_queries(model, None, context)


# ---------------------------------------------------------------------------------------------------- conversations
def test_conversation_queries_are_the_answer_tokens_of_each_conversation_in_order():
    model = tiny_model("qwen3")
    context = token_ids(10)
    first = Conversation("a", torch.tensor([11, 12]), torch.tensor([40, 41, 42]))
    empty = Conversation("b", torch.tensor([13]), torch.zeros(0, dtype=torch.long))
    second = Conversation("c", torch.tensor([14, 15, 16]), torch.tensor([50, 51]))
    got = conversation_queries(model, context, [first, empty, second])
    one = capture_queries(model, torch.tensor([[*context[0], 11, 12, 40, 41, 42]]), positions=slice(12, None))
    two = capture_queries(model, torch.tensor([[*context[0], 14, 15, 16, 50, 51]]), positions=slice(13, None))
    for layer in (0, 1):
        assert got[layer].shape == (N_KV_HEADS, GROUP * 5, HEAD_DIM)
        assert torch.equal(got[layer], torch.cat([one[layer], two[layer]], dim=1))
    cached = conversation_queries(model, context, [first, second], context_cache=prefill_context(model, context))
    for layer in (0, 1):
        torch.testing.assert_close(cached[layer], got[layer], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="no conversation has answer tokens"):
        conversation_queries(model, context, [empty])


def test_conversation_continues_a_compacted_cache_without_touching_it():
    model = tiny_model("llama")
    context = token_ids(24)
    compacted = compact(model, None, context, ratio=3, method="streaming_llm")
    hf_structkv.enable(model)
    turn = Conversation("q", torch.tensor([7, 8]), torch.tensor([9, 10, 11]))
    got = conversation_queries(model, context, [turn], context_cache=compacted)
    expected = capture_queries(
        model, torch.tensor([[7, 8, 9, 10, 11]]), positions=slice(2, None), cache=compacted.copy()
    )
    assert all(torch.equal(got[layer], expected[layer]) for layer in got)
    assert compacted.get_seq_length() == 24 and context_copy(compacted).get_seq_length() == 24
    full = prefill_context(model, context)
    copied = context_copy(full)
    assert copied is not full and torch.equal(copied.layers[0].keys, full.layers[0].keys)
    assert copied.layers[0].keys.data_ptr() != full.layers[0].keys.data_ptr()


def test_repetition_conversation_answers_with_the_text():
    turn = repetition_conversation(None, token_ids(6), instruction_ids=INSTRUCTION)
    assert turn.name == "repetition"
    assert torch.equal(turn.prompt_ids, INSTRUCTION[0]) and torch.equal(turn.answer_ids, token_ids(6)[0])
    with pytest.raises(ValueError, match=r"Conversation.answer_ids must be a 1-D tensor of token ids"):
        Conversation("x", torch.tensor([1]), torch.ones(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"Conversation.prompt_ids must be a 1-D tensor of token ids"):
        Conversation("x", torch.tensor([1.0]), torch.tensor([1]))


def test_cap_queries_subsamples_every_head_with_one_draw():
    queries = {3: torch.arange(2 * 30 * 2, dtype=torch.float32).reshape(2, 30, 2)}
    capped = cap_queries(queries, cap=7, seed=5)
    assert capped[3].shape == (2, 7, 2)
    for h in range(2):
        assert torch.equal(capped[3][h], subsample_queries(queries[3][h], cap=7, seed=5))
    assert cap_queries(queries, cap=None) is queries


# ---------------------------------------------------------------------------------------------------- pieces
def test_piece_spans_cover_the_sequence_in_order():
    assert piece_spans(7, 3) == [(0, 3), (3, 6), (6, 7)]
    assert piece_spans(6, 3) == [(0, 3), (3, 6)]
    assert piece_spans(2, 5) == [(0, 2)]


def test_answer_pieces_select_the_answer_positions_of_each_piece():
    pieces = answer_pieces(10, 4, 3)  # tokens 0-2 | 3-5 | 6-8 | 9, answer from 4
    assert [(p.start, p.end) for p in pieces] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [p.count for p in pieces] == [0, 2, 3, 1]
    tokens = torch.arange(10)
    picked = torch.cat([tokens[p.start : p.end][p.positions] for p in pieces])
    assert torch.equal(picked, tokens[4:])
    assert answer_pieces(10, 4, None) == [Piece(0, 10, 4)]
    for bad, error in [(0, ValueError), (1.5, TypeError)]:
        with pytest.raises(error, match=r"chunk_tokens must be an integer >= 1 \(tokens per forward\) or None"):
            answer_pieces(10, 4, bad)


def test_join_pieces_keeps_the_layout_of_one_capture():
    n_kv, group, length, dim = 2, 3, 9, 4
    raw = torch.randn(n_kv * group, length, dim)  # [H_q, n, D], what one forward's attention sees

    def grouped(positions) -> torch.Tensor:  # capture_queries' layout of the selected positions
        selected = raw[:, positions]
        return selected.reshape(n_kv, group * selected.shape[1], dim)

    pieces = answer_pieces(length, 2, 4)
    parts = [{5: grouped(torch.arange(p.start, p.end)[p.positions])} for p in pieces]
    assert torch.equal(join_pieces(parts, pieces)[5], grouped(torch.arange(2, length)))


@pytest.mark.parametrize(("arch", "chunk_tokens"), [("llama", 1), ("qwen3", 3), ("gemma3", 5), ("mistral", 14)])
def test_conversation_queries_in_pieces_equal_one_forward(arch, chunk_tokens):
    model = tiny_model(arch)
    context = token_ids(11)
    first = Conversation("a", torch.tensor([11, 12]), torch.tensor([40, 41, 42, 43]))
    second = Conversation("b", torch.tensor([14, 15, 16]), torch.tensor([50, 51]))
    for cache in (None, prefill_context(model, context)):
        for layers in (None, global_layers(model)[-1:]):
            whole = conversation_queries(model, context, [first, second], cache, layers)
            pieces = conversation_queries(model, context, [first, second], cache, layers, chunk_tokens=chunk_tokens)
            assert whole.keys() == pieces.keys()
            for layer in whole:
                torch.testing.assert_close(pieces[layer], whole[layer], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="chunk_tokens must be"):
        conversation_queries(model, context, [first], chunk_tokens=0)
