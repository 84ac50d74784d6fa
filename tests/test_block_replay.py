"""BlockReplay: on-policy queries from the model's blocks replayed one at a time equal a forward per layer."""

import pytest
import torch
from test_compaction_pipeline import WordTokenizer, context_ids

from hf_structkv.compaction import compact, prefill_context
from hf_structkv.compaction.block_replay import BlockReplay, decoder_blocks
from hf_structkv.compaction.queries import Conversation, conversation_queries
from hf_structkv.models import tiny_model

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3"]


def global_layers(model) -> list[int]:
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
    return [i for i, kind in enumerate(types) if kind == "full_attention"]


def conversation(seed: int = 1) -> Conversation:
    return Conversation("c", context_ids(4, seed)[0], context_ids(9, seed + 1)[0])


@pytest.mark.parametrize("arch", ARCHS)
def test_replayed_queries_equal_a_forward_per_layer_through_a_compacted_cache(arch):
    model, ids = tiny_model(arch), context_ids(48)
    # a context cache with its global layers compacted (what later layers see on-policy)
    cache = compact(model, WordTokenizer(), ids, ratio=4, method="kv_surgeon", on_policy=False, progress=False)
    talk = conversation()
    replay = BlockReplay.build(model, talk, cache)
    assert replay is not None and replay.next_block == 0
    for layer in global_layers(model):
        want = conversation_queries(model, ids, [talk], cache, layers=[layer])[layer]
        torch.testing.assert_close(replay.queries(layer, cache), want, rtol=0, atol=1e-6)
        assert replay.next_block == layer
    assert cache.get_seq_length() == 48  # every block ran on copies


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_on_policy_compaction_with_replay_equals_a_forward_per_layer(arch):
    model, ids = tiny_model(arch), context_ids(40)
    replayed = compact(model, WordTokenizer(), ids, ratio=4, method="kv_surgeon", progress=False)
    forwarded = compact(model, WordTokenizer(), ids, ratio=4, method="kv_surgeon", progress=False, block_replay=False)
    assert replayed.metadata["calibration"]["on_policy_capture"] == "block replay"
    assert forwarded.metadata["calibration"]["on_policy_capture"] == "forward per layer"
    for mine, theirs in zip(replayed.layers, forwarded.layers, strict=True):
        for a, b in zip(mine.context_tensors(), theirs.context_tensors(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    mine, theirs = (c.metadata["quality"]["heldout_relative_loss_per_layer"] for c in (replayed, forwarded))
    assert mine == pytest.approx(theirs, abs=1e-6)


def test_replay_refuses_a_forward_that_changes_hidden_states_between_blocks():
    model, ids = tiny_model("llama"), context_ids(12)
    blocks = decoder_blocks(model)
    assert blocks is model.model.layers
    hook = blocks[1].register_forward_pre_hook(lambda module, args: (args[0] * 2, *args[1:]))
    try:
        assert BlockReplay.build(model, conversation(), prefill_context(model, ids)) is None
    finally:
        hook.remove()
    assert BlockReplay.build(model, conversation(), prefill_context(model, ids)) is not None


def test_decoder_blocks_of_a_model_without_them_is_none():
    model = tiny_model("llama")
    model.model.layers = torch.nn.ModuleList(list(model.model.layers)[::-1])  # block i no longer holds layer i
    assert decoder_blocks(model) is None


def test_layers_are_asked_in_order_and_must_be_global():
    model, ids = tiny_model("gemma3"), context_ids(12)
    cache = prefill_context(model, ids)
    replay = BlockReplay.build(model, conversation(), cache)
    with pytest.raises(ValueError, match=r"layers \[0\] are not global"):
        replay.queries(0, cache)  # a sliding-window layer
    replay.queries(3, cache)
    with pytest.raises(ValueError, match="increasing order"):
        replay.queries(1, cache)


def test_a_model_whose_blocks_cannot_be_replayed_is_tried_once_then_falls_back(monkeypatch):
    model, ids = tiny_model("qwen2"), context_ids(40)
    want = compact(model, WordTokenizer(), ids, ratio=4, method="kv_surgeon", progress=False)
    tries = []
    monkeypatch.setattr(BlockReplay, "build", classmethod(lambda cls, *args: tries.append(args) or None))
    got = compact(model, WordTokenizer(), ids, ratio=4, method="kv_surgeon", progress=False)
    assert len(tries) == 1  # one conversation (the repetition), not one try per layer
    assert got.metadata["calibration"]["on_policy_capture"] == "forward per layer"
    for mine, theirs in zip(got.layers, want.layers, strict=True):
        for a, b in zip(mine.context_tensors(), theirs.context_tensors(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("arch", "chunk_tokens"), [("llama", 1), ("qwen2", 4), ("gemma3", 6)])
def test_replay_in_pieces_equals_the_replay_of_one_forward(arch, chunk_tokens):
    model, ids = tiny_model(arch), context_ids(30)
    cache = compact(model, WordTokenizer(), ids, ratio=4, method="kv_surgeon", on_policy=False, progress=False)
    talk = conversation()  # 4 prompt + 9 answer tokens
    whole = BlockReplay.build(model, talk, cache)
    pieces = BlockReplay.build(model, talk, cache, chunk_tokens=chunk_tokens)
    assert pieces is not None
    for layer in global_layers(model):
        torch.testing.assert_close(pieces.queries(layer, cache), whole.queries(layer, cache), rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == 30


def test_on_policy_compaction_with_calibration_in_pieces_equals_one_forward_each():
    model, ids = tiny_model("qwen3"), context_ids(40)
    kwargs = dict(ratio=4, method="kv_surgeon", progress=False)
    for on_policy in (True, False):
        whole = compact(model, WordTokenizer(), ids, on_policy=on_policy, prefill_chunk_tokens=None, **kwargs)
        pieces = compact(model, WordTokenizer(), ids, on_policy=on_policy, prefill_chunk_tokens=16, **kwargs)
        for mine, theirs in zip(pieces.layers, whole.layers, strict=True):
            for a, b in zip(mine.context_tensors(), theirs.context_tensors(), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_block_replay_must_be_a_bool():
    with pytest.raises(TypeError, match="block_replay must be True or False"):
        compact(tiny_model("qwen2"), WordTokenizer(), context_ids(8), ratio=4, block_replay="no", progress=False)
