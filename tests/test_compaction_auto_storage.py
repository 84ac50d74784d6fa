"""Compacted heads sized by bytes (issue 31): ``storage="auto"`` keeps, per head, the candidate with the lower
calibration loss within the byte budget (brute force over the candidates), and bad arguments are named."""

import contextlib
import math

import pytest
import torch

from hf_structkv.compaction import compact_head_to_bytes  # exported next to compact_head
from hf_structkv.compaction.head_compaction import HEAD_METHODS, compact_head, relative_loss
from hf_structkv.compaction.head_statistics import HeadProblem, QuantizedHead
from hf_structkv.compaction.head_storage import StorageLayout
from hf_structkv.compaction.quantized_refit import compact_int4, quantize_head

DIM = 8
KEY_GROUP = 8
BUDGETS = (200, 400, 800, 1500, 3000)


def head_inputs(seed: int, length: int = 96, queries: int = 160):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(length, DIM, generator=generator) * 2
    keys[:, 0] += 6.0  # a channel far from zero, as post-RoPE keys have
    values = torch.randn(length, DIM, generator=generator)
    calibration = torch.randn(queries, DIM, generator=generator)
    return keys.bfloat16(), values.bfloat16(), calibration


def most_entries(per_entry: int, fixed, nbytes: int) -> int:
    """The largest t <= 96 (the head's length) with per_entry * t + fixed(t) <= nbytes, by trying every t (at least
    1)."""
    return max([t for t in range(1, 97) if per_entry * t + fixed(t) <= nbytes], default=1)


def candidate_entries(nbytes: int) -> tuple[int, int]:
    """(dtype entries, INT4 entries) a head of 8 + 8 channels keeps within ``nbytes``, counted by hand: BF16 key and
    value rows (2 bytes an element) + an FP32 bias per entry; INT4 codes (4 + 4 bytes), an FP16 value scale and an
    FP32 bias per entry, 8 FP16 key scales and 8 offsets per group of 8 entries; one int64 offset per head."""
    in_dtype = most_entries(2 * DIM * 2 + 4, lambda t: 8, nbytes)
    int4 = most_entries(DIM // 2 * 2 + 2 + 4, lambda t: -(-t // KEY_GROUP) * 2 * DIM * 2 + 8, nbytes)
    return in_dtype, int4


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auto_keeps_the_candidate_with_the_lower_calibration_loss(seed):
    keys, values, calibration = head_inputs(seed)
    problem = HeadProblem.build(keys, values, calibration)
    rule = HEAD_METHODS["kv_surgeon"]()
    storages = set()
    for nbytes in BUDGETS:
        in_dtype_entries, int4_entries = candidate_entries(nbytes)
        # the candidates computed directly: the dtype head on its entries, the INT4 head (refit with the served keys)
        plain = compact_head(keys, values, calibration, in_dtype_entries)
        selected = compact_head(keys, values, calibration, int4_entries)
        quantized = quantize_head(problem, selected, rule, KEY_GROUP)
        losses = {"bf16": plain.train_loss, "int4": problem.relative_loss(quantized)}
        # without the held-back-queries guard, auto is the minimum of the two
        unguarded = compact_int4(
            problem, rule, int4_entries, 0, values.dtype, KEY_GROUP, guard_share=0.0, fallback_entries=in_dtype_entries
        )
        assert problem.relative_loss(unguarded) == min(losses.values())
        # with it (compact_head_to_bytes), the INT4 head is kept only where it also passes the guard, computed here
        fit, check = problem.split(0.25, 0)
        passes = check.relative_loss(quantize_head(fit, selected, rule, KEY_GROUP)) <= check.relative_loss(plain)
        admitted = {"bf16": losses["bf16"]} | ({"int4": losses["int4"]} if passes else {})
        head = compact_head_to_bytes(keys, values, calibration, nbytes, storage="auto", key_group=KEY_GROUP)
        winner = min(admitted, key=lambda kind: (admitted[kind], kind == "bf16"))  # a tie keeps the INT4 head
        assert head.storage == winner and head.train_loss == admitted[winner]
        assert head.indices.numel() == {"bf16": in_dtype_entries, "int4": int4_entries}[winner]
        assert head.storage_fallback == (winner == "bf16")
        assert head.nbytes(DIM) <= nbytes
        storages.add(head.storage)
    if seed == 0:  # both choices are exercised
        assert storages == {"bf16", "int4"}


def test_bf16_and_int4_to_bytes_keep_the_most_entries_that_fit():
    keys, values, calibration = head_inputs(3)
    for nbytes in BUDGETS:
        in_dtype_entries, int4_entries = candidate_entries(nbytes)
        plain = compact_head_to_bytes(keys, values, calibration, nbytes, storage="bf16")
        assert plain.indices.numel() == in_dtype_entries and plain.nbytes(DIM) <= nbytes
        int4 = compact_head_to_bytes(keys, values, calibration, nbytes, storage="int4", key_group=KEY_GROUP)
        same = compact_head(keys, values, calibration, int4_entries, storage="int4", key_group=KEY_GROUP)
        assert type(int4) is type(same) and int4.train_loss == same.train_loss
        if isinstance(int4, QuantizedHead):
            assert int4.indices.numel() == int4_entries and int4.nbytes() <= nbytes


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda k, v, q: compact_head_to_bytes(k, v, q, 0), ValueError, "nbytes must be an integer >= 1"),
        (lambda k, v, q: compact_head_to_bytes(k, v, q, 1.5), TypeError, "nbytes must be an integer"),
        (lambda k, v, q: compact_head_to_bytes(k, v, None, 400, "streaming_llm"), ValueError, "needs queries"),
        (lambda k, v, q: compact_head_to_bytes(k, v, q, 400, storage="fp8"), ValueError, "storage must be one of"),
        (lambda k, v, q: compact_head_to_bytes(k, v, q, 400, storage="bf16", key_group=4), ValueError, "key_group"),
        (lambda k, v, q: compact_head(k, v, q, 10, storage="auto"), ValueError, "compact_head_to_bytes"),
    ],
)
def test_bad_byte_budget_arguments_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call(*head_inputs(4))


# ------------------------------------------------------------------------------------------------ the pipeline
class WordTokenizer:
    """One id per character: enough for the repeat prompt on tiny models."""

    all_special_tokens = []

    def __call__(self, text, return_tensors=None, add_special_tokens=False):
        return type("Encoding", (), {"input_ids": torch.tensor([[3 + ord(ch) % 250 for ch in text]])})()

    def get_vocab(self):
        return {chr(i): 3 + i % 250 for i in range(256)}


LENGTH = 48


@pytest.fixture(scope="module")
def tiny():
    """``(model, tokenizer, ids, full cache, {layer: (fit, held-out)})``: the queries an off-policy compaction of
    ``ids`` fits to and is scored on (the repeat pass, split as `compact` splits it)."""
    from hf_structkv.compaction.context_prefill import prefill_context
    from hf_structkv.compaction.layer_compaction import split_queries
    from hf_structkv.compaction.queries import repeat_pass_queries
    from hf_structkv.models import tiny_model

    model, tokenizer = tiny_model("llama"), WordTokenizer()
    ids = torch.randint(3, 256, (1, LENGTH), generator=torch.Generator().manual_seed(5))
    queries = repeat_pass_queries(model, tokenizer, ids, cap=None)
    splits = {layer: split_queries(q, 0.25, 50_000, 0) for layer, q in queries.items()}
    return model, tokenizer, ids, prefill_context(model, ids), splits


def served_heads(cache, layer: int):
    """``(storage, kept entries, bias)`` of each KV head of ``layer``."""
    compacted = cache.layers[layer]
    offsets = compacted.prefix_offsets.tolist()
    return [
        (kind, length, compacted.prefix_bias[offsets[h] : offsets[h + 1]])
        for h, (kind, length) in enumerate(zip(compacted.head_storage(), compacted.head_lengths(), strict=True))
    ]


def test_compact_auto_keeps_what_compact_head_to_bytes_keeps_within_each_heads_bytes(tiny):
    from hf_structkv.compaction import compact

    model, tokenizer, ids, full, splits = tiny
    ratio = 4
    cache = compact(
        model, tokenizer, ids, ratio=ratio, storage="auto", key_group=KEY_GROUP, on_policy=False, heldout_fraction=0.25
    )
    record = cache.metadata["storage"]
    assert record["requested"] == "auto" and record["int4_heads"] + record["fallback_heads"] == 4
    # uniform budgets, float32 keys and values of 16 channels: (48 // 4) * 128 = 1536 bytes per head, capped at the
    # bytes of the whole head in INT4 (1448); the 4 * 88 left cannot keep a head whole in float32 (head_byte_budgets)
    nbytes = min((LENGTH // ratio) * (16 + 16) * 4, StorageLayout("int4", 16, 16, key_group=KEY_GROUP).nbytes(LENGTH))
    assert cache.metadata["budgets"]["bytes_per_chunk"] == [{"0": [nbytes] * 2, "1": [nbytes] * 2}]
    for layer, (fit, _) in splits.items():
        for h, (kind, length, bias) in enumerate(served_heads(cache, layer)):
            keys, values = full.layers[layer].keys[0, h], full.layers[layer].values[0, h]
            expected = compact_head_to_bytes(
                keys, values, fit[h], nbytes, storage="auto", key_group=KEY_GROUP, refit_guard=0.2
            )
            assert (kind, length) == (expected.storage, expected.indices.numel())
            torch.testing.assert_close(bias, expected.bias)
            assert expected.nbytes(16) <= nbytes


def test_max_loss_gives_each_head_the_smallest_size_meeting_it_on_its_heldout_share(tiny):
    from hf_structkv.compaction import compact
    from hf_structkv.compaction.settings import MAX_LOSS_RATIOS

    model, tokenizer, ids, full, splits = tiny
    chosen = set()
    for max_loss in (0.02, 0.2):
        cache = compact(model, tokenizer, ids, max_loss=max_loss, on_policy=False, heldout_fraction=0.25)
        record = cache.metadata["max_loss"]
        assert record["max_loss"] == max_loss and record["sizes_tried"] == list(MAX_LOSS_RATIOS)
        assert record["byte_ratio"] == pytest.approx(cache.full_nbytes() / cache.nbytes())
        assert cache.metadata["hyperparameters"]["ratio"] is None
        for layer, (fit, heldout) in splits.items():
            for h, (_, length, _) in enumerate(served_heads(cache, layer)):
                keys, values = full.layers[layer].keys[0, h], full.layers[layer].values[0, h]
                # brute force: every size, its held-out loss; the smallest meeting max_loss, else the whole head
                sizes = [(max(1, math.floor(LENGTH / r)), r) for r in MAX_LOSS_RATIOS] + [(LENGTH, 1.0)]
                losses = {
                    budget: relative_loss(
                        compact_head(keys, values, fit[h], budget, refit_guard=0.2), keys, heldout[h], values
                    )
                    for budget, _ in sizes
                }
                budget, ratio = min((b, r) for b, r in sizes if losses[b] <= max_loss)
                assert length == budget and record["head_ratios"][str(layer)][h] == ratio
                assert losses[budget] <= max_loss
                chosen.add(ratio)
        per_layer = cache.metadata["quality"]["heldout_relative_loss_per_layer"]
        assert all(loss <= max_loss for loss in per_layer.values())
    assert len(chosen) > 1  # the targets give the heads different sizes


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_loss": 0}, "max_loss must be a finite number > 0"),
        ({"max_loss": -0.1}, "max_loss must be a finite number > 0"),
        ({"max_loss": float("nan")}, "max_loss must be a finite number > 0"),
        ({"max_loss": float("inf")}, "max_loss must be a finite number > 0"),
        ({"max_loss": True}, "max_loss must be a finite number > 0"),
        ({"max_loss": "0.1"}, "max_loss must be a finite number > 0"),
        ({"max_loss": 0.1, "ratio": 8}, "exclude each other"),
        ({"max_loss": 0.1, "budgets": "uniform"}, "budgets has no effect with max_loss"),
        ({"max_loss": 0.1, "method": "streaming_llm"}, "max_loss measures each head on held-out"),
        ({"max_loss": 0.1, "heldout_fraction": 0}, "heldout_fraction must be in"),
        ({"storage": "auto", "method": "key_norm"}, "storage='auto' chooses"),
        ({"storage": "fp8"}, "storage must be one of"),
    ],
)
def test_bad_size_arguments_are_refused_before_any_model_work(kwargs, match):
    from hf_structkv.compaction import compact

    with pytest.raises(ValueError, match=match):
        compact(object(), WordTokenizer(), "some context", **kwargs)  # the model is never touched


# ------------------------------------------------------------------------------------------------ command line
def test_cli_compact_max_loss_prints_and_records_the_byte_ratio(tmp_path, monkeypatch, capsys):
    from hf_structkv import CompactedCache, cli
    from hf_structkv.models import tiny_model

    monkeypatch.setattr(cli, "load_model", lambda name, dtype: (tiny_model("llama"), WordTokenizer()))
    context = tmp_path / "context.txt"
    context.write_text("".join(chr(97 + (7 * i) % 26) for i in range(LENGTH)), encoding="utf-8")
    out = tmp_path / "cache"
    argv = ["compact", "--context-file", str(context), "--max-loss", "0.05", "--storage", "auto", "--key-group", "8"]
    assert cli.main([*argv, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    cache = CompactedCache.load(out)
    record = cache.metadata["max_loss"]
    assert record["max_loss"] == 0.05 and cache.metadata["storage"]["requested"] == "auto"
    assert f"byte ratio {record['byte_ratio']:.2f}x" in printed
    assert f"{cache.full_nbytes() / cache.nbytes():.2f}x" in printed
    assert "max_loss" in (out / "README.md").read_text()  # the card shows the target


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-loss", "0.1", "--ratio", "8"], "--ratio and --max-loss exclude each other"),
        (["--max-loss", "0"], "argument --max-loss: must be a finite number > 0"),
        (["--max-loss", "nan"], "argument --max-loss: must be a finite number > 0"),
        (["--max-loss", "x"], "argument --max-loss: must be a finite number > 0"),
        (["--storage", "int8"], "argument --storage: invalid choice"),
    ],
)
def test_cli_refuses_bad_size_options_before_loading_a_model(argv, message, tmp_path, monkeypatch, capsys):
    from hf_structkv import cli

    monkeypatch.setattr(cli, "load_model", lambda name, dtype: pytest.fail("a model was loaded"))
    with contextlib.suppress(SystemExit):
        assert cli.main(["compact", *argv, "--out", str(tmp_path / "cache")]) == 2
    assert message in capsys.readouterr().err
