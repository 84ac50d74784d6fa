"""``compact``: prefill once, keep StreamingLLM positions per KV head, build a `CompactedCache` with metadata."""

import math
import re

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from hf_structkv.cache.compacted_layers import CompactedLayer, SharedContextSlidingLayer
from hf_structkv.compaction import HEAD_METHODS, METHODS, compact, compact_head, prefill_context
from hf_structkv.models import tiny_model
from hf_structkv.persistence import model_fingerprint, tokenizer_hash


def context_ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(seed))


class FakeTokenizer:
    """Whitespace-separated integers -> ids; records how it was called."""

    def __init__(self):
        self.calls = []

    def __call__(self, text, return_tensors, add_special_tokens):
        self.calls.append((return_tensors, add_special_tokens))
        return type("Encoding", (), {"input_ids": torch.tensor([[int(t) for t in text.split()]])})

    def get_vocab(self):
        return {str(i): i for i in range(256)}


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


# ---------------------------------------------------------------------------------------------------- positions
def streaming_llm_positions(length: int, budget: int, sinks: int) -> torch.Tensor:
    keys = torch.randn(length, 4)
    return compact_head(keys, keys, None, budget, method="streaming_llm", sink_tokens=sinks).indices


@pytest.mark.parametrize(
    "length, budget, sinks, expected",
    [
        (10, 4, 2, [0, 1, 8, 9]),  # sinks + most recent
        (10, 4, 0, [6, 7, 8, 9]),  # recent only
        (10, 20, 4, list(range(10))),  # budget > length: everything
        (10, 3, 5, [0, 1, 2]),  # sinks > budget: the first budget positions
        (10, 5, 5, [0, 1, 2, 3, 4]),
        (1, 1, 4, [0]),
    ],
)
def test_streaming_llm_positions(length, budget, sinks, expected):
    kept = streaming_llm_positions(length, budget, sinks)
    assert kept.dtype == torch.long
    assert kept.tolist() == expected


@pytest.mark.parametrize("length, budget, sinks", [(100, 25, 4), (41, 10, 4), (7, 3, 1), (64, 16, 16)])
def test_streaming_llm_positions_closed_form(length, budget, sinks):
    kept = streaming_llm_positions(length, budget, sinks)
    assert kept.tolist() == list(range(sinks)) + list(range(length - (budget - sinks), length))
    assert kept.numel() == budget == torch.unique(kept).numel()


# ---------------------------------------------------------------------------------------------------- prefill
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_prefill_context_equals_a_manual_prefill(arch):
    model = tiny_model(arch)
    ids = context_ids(20)
    manual = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=manual)
    cache = prefill_context(model, ids)
    assert cache.get_seq_length() == 20
    assert len(cache.layers) == model.config.num_hidden_layers
    for mine, theirs in zip(cache.layers, manual.layers, strict=True):
        assert type(mine) is type(theirs)
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    if arch == "gemma3":  # layers 0 and 2 are sliding (window 8): they keep the last 7 tokens only
        assert [type(layer) for layer in cache.layers] == [DynamicSlidingWindowLayer, DynamicLayer] * 2
        assert [layer.keys.shape[-2] for layer in cache.layers] == [7, 20, 7, 20]
    else:
        assert all(layer.keys.shape == (1, 2, 20, 16) for layer in cache.layers)


@pytest.mark.parametrize("prefill_chunk_tokens", [1, 7, 20, 64])
def test_prefill_in_pieces_equals_one_forward(llama, prefill_chunk_tokens):
    ids = context_ids(20, seed=2)
    whole = prefill_context(llama, ids)
    pieces = prefill_context(llama, ids, prefill_chunk_tokens=prefill_chunk_tokens)
    for a, b in zip(whole.layers, pieces.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError)])
def test_prefill_rejects_bad_piece_sizes(llama, bad, error):
    with pytest.raises(error, match=r"prefill_chunk_tokens must be an integer >= 1 \(tokens per forward\) or None"):
        prefill_context(llama, context_ids(8), prefill_chunk_tokens=bad)


# ---------------------------------------------------------------------------------------------------- compact
@pytest.mark.parametrize("length, ratio", [(40, 4.0), (41, 3), (37, 2.5), (9, 1)])
def test_compact_keeps_sinks_and_recent_per_head(llama, length, ratio):
    ids = context_ids(length, seed=length)
    full = prefill_context(llama, ids)
    cache = compact(llama, None, ids, method="streaming_llm", ratio=ratio)
    kept_per_head = math.floor(length / ratio)
    expected = list(range(4)) + list(range(length - (kept_per_head - 4), length))
    assert cache.original_length == length == cache.get_seq_length()
    assert cache.head_lengths() == [[kept_per_head] * 2] * 2
    for layer, source in zip(cache.layers, full.layers):
        assert isinstance(layer, CompactedLayer)
        offsets = layer.prefix_offsets.tolist()
        for h in range(2):
            rows = slice(offsets[h], offsets[h + 1])
            torch.testing.assert_close(layer.prefix_keys[rows], source.keys[0, h, expected], rtol=0, atol=0)
            torch.testing.assert_close(layer.prefix_values[rows], source.values[0, h, expected], rtol=0, atol=0)
        assert torch.equal(layer.prefix_bias, torch.zeros(2 * kept_per_head))
    kv_bytes = cache.nbytes() - cache.overhead_nbytes()
    assert cache.full_nbytes() == sum(layer.keys.nbytes + layer.values.nbytes for layer in full.layers)
    assert kv_bytes <= cache.full_nbytes() / ratio
    assert kv_bytes == cache.full_nbytes() * kept_per_head // length


def test_compact_keeps_at_least_one_entry(llama):
    cache = compact(llama, None, context_ids(5), method="streaming_llm", ratio=100, sink_tokens=2)
    assert cache.head_lengths() == [[1, 1], [1, 1]]
    layer = cache.layers[0]
    full = prefill_context(llama, context_ids(5))
    assert torch.equal(layer.prefix_keys[:1], full.layers[0].keys[0, 0, :1])


def test_compact_metadata(llama):
    cache = compact(llama, None, context_ids(16), method="streaming_llm", ratio=2, sink_tokens=3)
    metadata = cache.metadata
    assert set(metadata) == {
        "fingerprint",
        "method",
        "hyperparameters",
        "calibration",
        "budgets",
        "chunking",
        "prefill_chunk_tokens",
        "compaction_seconds",
    }
    assert metadata["fingerprint"] == model_fingerprint(llama)
    assert metadata["fingerprint"]["tokenizer_hash"] is None
    assert metadata["method"] == "streaming_llm" and METHODS == tuple(sorted(HEAD_METHODS))
    assert metadata["hyperparameters"] == {"ratio": 2.0, "seed": 0, "sink_tokens": 3}
    assert isinstance(metadata["hyperparameters"]["ratio"], float)
    assert metadata["calibration"] == "none (query-free selection)"
    assert metadata["budgets"] == {
        "source": "uniform",
        "rule": "max(1, floor(chunk_length / ratio)) per KV head",
        "requested": "auto",
    }
    assert metadata["chunking"] == {
        "chunk_tokens": None,
        "prefix_tokens": 0,
        "document_lengths": [16],
        "chunk_spans": [[0, 16]],
    }
    assert metadata["prefill_chunk_tokens"] == 1024
    assert 0 <= metadata["compaction_seconds"] < 60


def test_compact_text_context_is_tokenized_without_special_tokens(llama):
    tokenizer = FakeTokenizer()
    ids = context_ids(24, seed=4)
    from_text = compact(llama, tokenizer, " ".join(map(str, ids[0].tolist())), method="streaming_llm", ratio=4)
    assert tokenizer.calls == [("pt", False)]
    from_ids = compact(llama, tokenizer, ids, method="streaming_llm", ratio=4)
    assert from_text.metadata["fingerprint"]["tokenizer_hash"] == tokenizer_hash(tokenizer)
    for a, b in zip(from_text.layers, from_ids.layers):
        assert all(torch.equal(x, y) for x, y in zip(a.context_tensors(), b.context_tensors()))


def test_compact_leaves_sliding_layers_whole():
    model = tiny_model("gemma3")
    ids = context_ids(41)
    cache = compact(model, None, ids, method="streaming_llm", ratio=4)
    full = prefill_context(model, ids)
    assert cache.head_lengths() == [None, [10, 10], None, [10, 10]]
    for layer, source in zip(cache.layers, full.layers):
        if source.is_sliding:
            assert isinstance(layer, SharedContextSlidingLayer) and layer.sliding_window == 8
            assert torch.equal(layer.window_keys, source.keys) and torch.equal(layer.window_values, source.values)
    compacted_kv = sum(layer.prefix_keys.nbytes + layer.prefix_values.nbytes for layer in cache.layers[1::2])
    full_kv = sum(layer.keys.nbytes + layer.values.nbytes for layer in full.layers[1::2])
    assert compacted_kv <= full_kv / 4


class TestCompactRejectsBadInput:
    def test_unknown_method(self, llama):
        with pytest.raises(ValueError, match=r"method must be one of \(.*'kv_surgeon'.*\), got 'nope'"):
            compact(llama, None, context_ids(8), method="nope")

    @pytest.mark.parametrize("ratio", [0.5, 0, -2, float("nan"), float("inf"), "4"])
    def test_ratio(self, llama, ratio):
        with pytest.raises(ValueError, match=r"ratio must be a finite number >= 1 \(original / kept entries\), got"):
            compact(llama, None, context_ids(8), method="streaming_llm", ratio=ratio)

    @pytest.mark.parametrize("sinks, error", [(-1, ValueError), (2.0, TypeError)])
    def test_sink_tokens(self, llama, sinks, error):
        with pytest.raises(error, match=r"sink_tokens must be an integer >= 0, got"):
            compact(llama, None, context_ids(8), method="streaming_llm", sink_tokens=sinks)

    @pytest.mark.parametrize(
        "ids", [torch.zeros(1, 0, dtype=torch.long), torch.randint(3, 256, (2, 8)), torch.randint(3, 256, (8,))]
    )
    def test_empty_batched_or_flat_context(self, llama, ids):
        with pytest.raises(ValueError, match=r"context must be a non-empty text or a \[1, T\] tensor of token ids"):
            compact(llama, None, ids, method="streaming_llm")

    def test_empty_text(self, llama):
        with pytest.raises(ValueError, match="context must be a non-empty text"):
            compact(llama, FakeTokenizer(), "", method="streaming_llm")


# ---------------------------------------------------------------------------------------------------- calibrated
INSTRUCTION = "Repeat the text above verbatim."


class WordTokenizer:
    """Just enough tokenizer for the repeat prompt on tiny models: one id per character, and a vocabulary hash."""

    def __call__(self, text, return_tensors=None, add_special_tokens=False):
        ids = torch.tensor([[3 + ord(ch) % 250 for ch in text]])
        return type("Encoding", (), {"input_ids": ids})()

    def get_vocab(self):
        return {chr(i): 3 + i % 250 for i in range(256)}

    all_special_tokens = []


def test_kv_surgeon_pipeline_records_calibration_and_heldout_quality():
    model = tiny_model("llama")
    cache = compact(model, WordTokenizer(), context_ids(40), ratio=4, method="kv_surgeon", heldout_fraction=0.2)
    assert cache.head_lengths() == [[10, 10], [10, 10]]
    calibration = cache.metadata["calibration"]
    assert calibration["queries"] == "repeat" and calibration["on_policy"] is True
    losses = cache.metadata["quality"]["heldout_relative_loss_per_layer"]
    assert set(losses) == {"0", "1"} and all(0 <= v < 1 for v in losses.values())
    full = prefill_context(model, context_ids(40))
    layer = cache.layers[0]
    kept = layer.prefix_offsets[1]
    assert layer.prefix_bias.abs().max() > 0  # multipliers were fitted
    assert not torch.equal(layer.prefix_values[:kept], full.layers[0].values[0, 0, : int(kept)])
    assert cache.metadata["hyperparameters"] == {"ratio": 4.0, "seed": 0, "refit_guard": 0.2}


def test_compact_guards_the_refit_by_default_and_refit_guard_zero_is_the_papers_refit():
    from hf_structkv.compaction.layer_compaction import split_queries
    from hf_structkv.compaction.queries import repeat_pass_queries
    from hf_structkv.compaction.settings import DEFAULT_REFIT_GUARD

    model, tokenizer, ids = tiny_model("llama"), WordTokenizer(), context_ids(40)
    full = prefill_context(model, ids)
    fit, _ = split_queries(repeat_pass_queries(model, tokenizer, ids, cap=None)[0], 0.1, 50_000, 0)
    for guard in (DEFAULT_REFIT_GUARD, 0.0):
        kwargs = {} if guard == DEFAULT_REFIT_GUARD else {"refit_guard": 0.0}
        cache = compact(model, tokenizer, ids, ratio=4, method="loo", on_policy=False, **kwargs)
        assert cache.metadata["hyperparameters"]["refit_guard"] == guard
        layer = cache.layers[0]
        for h in range(2):
            expected = compact_head(
                full.layers[0].keys[0, h], full.layers[0].values[0, h], fit[h], 10, "loo", refit_guard=guard
            )
            a, b = layer.prefix_offsets[h], layer.prefix_offsets[h + 1]
            torch.testing.assert_close(layer.prefix_values[a:b], expected.values)


def test_on_policy_layer_is_fitted_to_queries_with_earlier_layers_compacted():
    """Layer 1 of the pipeline's cache equals compacting layer 1 against the repeat-pass queries that run through the
    pipeline's compacted layer 0 (and layer 0 equals the off-policy fit, whose queries come from the full cache)."""
    from hf_structkv.compaction.layer_compaction import CacheSelection, split_queries
    from hf_structkv.compaction.queries import repeat_pass_queries

    model, tokenizer, ids = tiny_model("qwen2"), WordTokenizer(), context_ids(40)
    on = compact(model, tokenizer, ids, ratio=4, method="kv_surgeon", on_policy=True)
    off = compact(model, tokenizer, ids, ratio=4, method="kv_surgeon", on_policy=False)
    for mine, theirs in zip(on.layers[0].context_tensors(), off.layers[0].context_tensors()):
        assert torch.equal(mine, theirs)
    full = prefill_context(model, ids)
    selection = CacheSelection.keep_everything(full)
    layer0 = on.layers[0]
    offsets = layer0.prefix_offsets.tolist()
    # Layer 0's kept positions: match its kept keys against the full cache's keys.
    kept_keys = [layer0.prefix_keys[offsets[h] : offsets[h + 1]] for h in range(2)]
    selection.indices[0] = [
        (kept_keys[h][:, None] == full.layers[0].keys[0, h][None]).all(-1).int().argmax(-1) for h in range(2)
    ]
    selection.biases[0] = [layer0.prefix_bias[offsets[h] : offsets[h + 1]] for h in range(2)]
    selection.values[0] = [layer0.prefix_values[offsets[h] : offsets[h + 1]] for h in range(2)]
    queries = repeat_pass_queries(model, tokenizer, ids, cap=None, context_cache=selection.build(full))
    fit, _ = split_queries(queries[1], 0.1, 50_000, 0)
    for h in range(2):
        expected = compact_head(
            full.layers[1].keys[0, h], full.layers[1].values[0, h], fit[h], 10, "kv_surgeon", refit_guard=0.2
        )
        a, b = on.layers[1].prefix_offsets[h], on.layers[1].prefix_offsets[h + 1]
        torch.testing.assert_close(on.layers[1].prefix_bias[a:b], expected.bias)
        torch.testing.assert_close(on.layers[1].prefix_values[a:b], expected.values)
    assert not torch.equal(on.layers[1].prefix_bias, off.layers[1].prefix_bias)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma3"])
def test_attention_modules_are_the_self_attention_of_each_layer(arch):
    from hf_structkv.attention.modules import attention_modules

    model = tiny_model(arch)
    found = attention_modules(model)
    blocks = model.model.layers
    assert list(found) == list(range(len(blocks)))
    assert all(found[i] is blocks[i].self_attn for i in found)
    assert attention_modules(blocks[1]) == {1: blocks[1].self_attn} and attention_modules(model.lm_head) == {}


def test_calibrated_compaction_skips_sliding_layers_and_uses_the_model_scale():
    from hf_structkv.attention.modules import attention_scalings

    model = tiny_model("gemma3", query_pre_attn_scalar=64)
    scalings = attention_scalings(model)
    assert scalings == {i: 64**-0.5 for i in range(4)}
    cache = compact(model, WordTokenizer(), context_ids(40), ratio=4, method="loo", on_policy=False)
    assert cache.head_lengths() == [None, [10, 10], None, [10, 10]]
    assert set(cache.metadata["quality"]["heldout_relative_loss_per_layer"]) == {"1", "3"}


def test_calibrated_method_rejects_unknown_query_tier():
    match = r"queries must be one of \('repeat', 'self_study'\) for method 'kv_surgeon', got 'ruler'"
    with pytest.raises(ValueError, match=match):
        compact(tiny_model("llama"), WordTokenizer(), context_ids(8), method="kv_surgeon", queries="ruler")
    with pytest.raises(ValueError, match="needs the tokenizer for its calibration prompts"):
        compact(tiny_model("llama"), None, context_ids(8), method="kv_surgeon")
    with pytest.raises(TypeError, match="self_study must be a SelfStudy or None"):
        compact(tiny_model("llama"), WordTokenizer(), context_ids(8), self_study={"answer_tokens": 4})
    with pytest.raises(ValueError, match=r"heldout_fraction must be in \[0, 1\)"):
        compact(tiny_model("llama"), WordTokenizer(), context_ids(8), method="kv_surgeon", heldout_fraction=1.0)


def test_defaults_are_on_policy_kv_surgeon_at_ratio_50():
    cache = compact(tiny_model("llama"), WordTokenizer(), context_ids(100))
    assert cache.metadata["method"] == "kv_surgeon"
    assert cache.metadata["hyperparameters"]["ratio"] == 50.0
    assert cache.metadata["calibration"]["on_policy"] is True
    assert cache.metadata["calibration"]["query_cap_per_head"] == 50_000
    assert cache.head_lengths() == [[2, 2], [2, 2]]


# ---------------------------------------------------------------------------------------------------- budgets
class FakeBudgets:
    """Stands in for ``HeadBudgets``: head h of every layer keeps ``shares[h] * length / ratio`` entries (floored)."""

    def __init__(self, shares=(0.5, 1.5), layers=(0, 1)):
        self.shares, self.layers, self.calls = shares, layers, []

    def token_budgets(self, ratio, length):
        self.calls.append((ratio, length))
        return {layer: [math.floor(share * length / ratio) for share in self.shares] for layer in self.layers}


def test_head_budgets_set_each_heads_kept_entries(llama):
    budgets = FakeBudgets()
    ids = context_ids(40, seed=5)
    cache = compact(llama, None, ids, ratio=4, method="streaming_llm", budgets=budgets, sink_tokens=2)
    assert budgets.calls == [(4, 40)]
    assert cache.head_lengths() == [[5, 15], [5, 15]]
    full = prefill_context(llama, ids)
    for layer, source in zip(cache.layers, full.layers):
        offsets = layer.prefix_offsets.tolist()
        for h, kept in enumerate((5, 15)):
            expected = [0, 1, *range(40 - (kept - 2), 40)]
            assert torch.equal(layer.prefix_keys[offsets[h] : offsets[h + 1]], source.keys[0, h, expected])
    assert cache.metadata["budgets"] == {"source": "FakeBudgets", "kept_per_chunk": [{"0": [5, 15], "1": [5, 15]}]}


def test_head_budgets_drive_calibrated_methods_and_zero_counts_keep_one_entry():
    model = tiny_model("qwen2")
    cache = compact(model, WordTokenizer(), context_ids(40), ratio=8, budgets=FakeBudgets(shares=(0.0, 2.0)))
    assert cache.head_lengths() == [[1, 10], [1, 10]]
    assert cache.metadata["budgets"]["kept_per_chunk"] == [{"0": [1, 10], "1": [1, 10]}]


def test_budgets_from_a_saved_file_go_through_head_budgets_load(llama, tmp_path, monkeypatch):
    from hf_structkv.compaction import pipeline

    loaded = []

    class HeadBudgets:
        @staticmethod
        def load(path, model):
            loaded.append((path, model))
            budgets = FakeBudgets()
            budgets.provenance = {"kind": "fake"}
            return budgets

    monkeypatch.setattr(pipeline, "HeadBudgets", HeadBudgets)
    path = tmp_path / "budgets"
    path.mkdir()
    cache = compact(llama, None, context_ids(40), ratio=4, method="streaming_llm", budgets=str(path))
    assert loaded == [(str(path), llama)] and cache.head_lengths() == [[5, 15], [5, 15]]
    record = cache.metadata["budgets"]
    assert (record["source"], record["path"], record["provenance"]) == ("HeadBudgets.load", str(path), {"kind": "fake"})


def test_budgets_from_a_real_head_budgets_file(llama, tmp_path):
    from hf_structkv.compaction.budgets import HeadBudgets

    HeadBudgets.uniform(llama).save_pretrained(tmp_path / "uniform")
    ids = context_ids(40)
    from_file = compact(llama, None, ids, ratio=4, method="streaming_llm", budgets=tmp_path / "uniform")
    uniform = compact(llama, None, ids, ratio=4, method="streaming_llm")
    assert from_file.head_lengths() == uniform.head_lengths() == [[10, 10], [10, 10]]
    assert from_file.metadata["budgets"]["provenance"] == {"kind": "uniform"}


def test_auto_budgets_fall_back_to_uniform_for_a_model_without_a_shipped_allocation(llama):
    ids = context_ids(40)
    auto = compact(llama, None, ids, ratio=4, method="streaming_llm")
    uniform = compact(llama, None, ids, ratio=4, method="streaming_llm", budgets="uniform")
    assert auto.head_lengths() == uniform.head_lengths() == [[10, 10], [10, 10]]
    assert auto.metadata["budgets"]["requested"] == "auto" and "requested" not in uniform.metadata["budgets"]


def test_resolve_budgets_is_what_compact_keeps():
    """`resolve_budgets` per spelling of ``budgets``; a sliding-window model's uniform rule covers its global layers
    only; the shipped allocation needs the embedded model's structure and a ratio within its cap."""
    from hf_structkv.compaction import UniformBudgets, resolve_budgets

    gemma = tiny_model("gemma3", vocab_size=300)
    uniform, record = resolve_budgets("uniform", gemma, 4.0)
    assert uniform == UniformBudgets({1: 2, 3: 2})  # layers 0 and 2 slide
    assert uniform.token_budgets(4.0, 41) == {1: [10, 10], 3: [10, 10]}
    assert uniform.token_budgets(100.0, 41) == {1: [1, 1], 3: [1, 1]}
    assert record["source"] == "uniform" and "requested" not in record
    auto, record = resolve_budgets("auto", gemma, 4.0)
    assert auto == uniform and record["requested"] == "auto"
    fake = FakeBudgets()
    assert resolve_budgets(fake, gemma, 4.0) == (fake, {"source": "FakeBudgets"})
    cache = compact(gemma, None, context_ids(41), ratio=4, method="streaming_llm", budgets="uniform")
    assert [n for n in cache.head_lengths() if n] == [[10, 10], [10, 10]]


def test_a_hub_repository_id_of_budgets_goes_to_head_budgets_load(llama, monkeypatch):
    from hf_structkv.compaction import pipeline

    loaded = []
    monkeypatch.setattr(pipeline.HeadBudgets, "load", lambda path, model: loaded.append(path) or FakeBudgets())
    compact(llama, None, context_ids(40), ratio=4, method="streaming_llm", budgets="someone/head-budgets")
    assert loaded == ["someone/head-budgets"]


class TestBudgetsRejectBadInput:
    def test_not_a_budget(self, llama):
        with pytest.raises(TypeError, match=r"budgets must be one of \('auto', 'uniform'\), a HeadBudgets .* got int"):
            compact(llama, None, context_ids(8), method="streaming_llm", budgets=3)

    @pytest.mark.parametrize(
        "budgets, message",
        [
            ("nope", "is no such keyword and no existing file or folder"),
            ("Uniform", "is no such keyword"),
            ("auto ", "is no such keyword"),
            ("", "is no such keyword"),
            ("budgets/head_budgets.json", "is neither an existing folder nor a Hub repository id: it names a file"),
            ("./nope", "is neither an existing folder nor a Hub repository id: it is a local path"),
            ("a/b/c", "is neither an existing folder nor a Hub repository id"),
            ("~/budgets", "is neither an existing folder nor a Hub repository id: it is a local path"),
        ],
    )
    def test_a_mistyped_keyword_or_path_is_refused_locally(self, llama, monkeypatch, budgets, message):
        """Issue 34: ``budgets="nope"`` asked the Hub ("check your internet connection"); now no request is made,
        and a word that is no keyword lists the accepted ones."""
        import huggingface_hub

        from hf_structkv.compaction import pipeline

        def no_request(*args, **kwargs):
            raise AssertionError("the Hub was asked")

        monkeypatch.setattr(huggingface_hub, "snapshot_download", no_request)
        monkeypatch.setattr(pipeline, "prefill_context", no_request)  # refused before the prefill
        if "keyword" in message:
            message = (
                r"budgets must be one of \('auto', 'uniform'\), the path of a saved head-budgets folder or file, or a "
                rf"Hub repository id 'namespace/name'; {re.escape(repr(budgets))} {message}"
            )
        with pytest.raises(ValueError, match=message):
            compact(llama, None, context_ids(8), method="streaming_llm", budgets=budgets)

    def test_missing_file(self, llama, tmp_path):
        missing = tmp_path / "nope.json"
        for budgets in (missing, str(missing)):
            with pytest.raises(ValueError, match=f"{re.escape(repr(str(missing)))} is neither an existing folder"):
                compact(llama, None, context_ids(8), method="streaming_llm", budgets=budgets)
        with pytest.raises(ValueError, match="'nope.json' is no such keyword and no existing file or folder"):
            compact(llama, None, context_ids(8), method="streaming_llm", budgets="nope.json")

    @pytest.mark.parametrize("budgets", [FakeBudgets(shares=(1.0,)), FakeBudgets(layers=(0,))])
    def test_budgets_of_another_model(self, llama, budgets):
        with pytest.raises(ValueError, match="must give 2 counts for global layer .*another model"):
            compact(llama, None, context_ids(8), method="streaming_llm", budgets=budgets)

    def test_negative_counts(self, llama):
        with pytest.raises(ValueError, match=r"counts \[-4, 12\]; need ints >= 0"):
            compact(llama, None, context_ids(8), ratio=1, method="streaming_llm", budgets=FakeBudgets((-0.5, 1.5)))


@pytest.mark.parametrize("method", ["streaming_llm", "key_norm", "random"])
def test_a_query_free_compaction_enables_the_model_so_its_cache_serves_at_once(method):
    """``compact`` switches the model to hf_structkv's attention for every method, so ``generate`` on the returned
    cache works without a separate ``enable`` (it raised for query-free methods, which capture no queries)."""
    import hf_structkv
    from hf_structkv.generation import generation_inputs

    model = tiny_model("llama")
    assert not hf_structkv.is_enabled(model)
    cache = compact(model, None, context_ids(24), method=method, ratio=4)
    assert hf_structkv.is_enabled(model)
    inputs = generation_inputs(cache, context_ids(3, seed=1))
    with torch.no_grad():
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=2, do_sample=False)
    assert out.shape == (1, 24 + 3 + 2)
