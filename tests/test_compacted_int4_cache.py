"""A `CompactedCache` holding KV heads in INT4 (issue 31): storage, serving through every attention path, bytes and the
saved format."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_structkv
from hf_structkv import CompactedCache
from hf_structkv.attention.backend import BACKEND_ENV
from hf_structkv.attention.compacted_inputs import key_groups
from hf_structkv.cache.compacted_layers import CompactedLayer, Int4Head
from hf_structkv.compaction.context_prefill import prefill_context as prefill
from hf_structkv.compaction.head_storage import OFFSET_BYTES, StorageLayout
from hf_structkv.models import tiny_model
from hf_structkv.persistence import model_fingerprint
from hf_structkv.quant import (
    dequantize_int4,
    dequantize_int4_channels,
    pack_int4,
    quantize_int4,
    quantize_int4_channels,
    unpack_int4,
)

CONTEXT_LEN = 40


def int4_cache(model, context: torch.Tensor, key_group: int | None = 8, plain_heads=(0,), seed: int = 0):
    """A compacted cache of ``context``: ragged random kept entries and biases per KV head; the KV heads of
    ``plain_heads`` in the model's dtype, the others quantised from their kept keys / values (INT4, keys per channel
    in groups of ``key_group``). Returns ``(cache, expected)`` with ``expected[layer][h] = (keys, values)`` the
    served rows (the kept rows for plain heads, the dequantised codes for INT4 heads)."""
    full = prefill(model, context)
    g = torch.Generator().manual_seed(seed)
    indices, biases, int4, expected = [], [], [], []
    for layer in full.layers:
        n_heads, length = layer.keys.shape[1], layer.keys.shape[-2]
        layer_idx, layer_bias, layer_int4, layer_expected = [], [], [], []
        for h in range(n_heads):
            t = 5 + 7 * h  # ragged, and not a multiple of the key group
            kept = torch.randperm(length, generator=g)[:t].sort().values
            keys, values = layer.keys[0, h, kept], layer.values[0, h, kept]
            layer_idx.append(kept)
            layer_bias.append(torch.randn(t, generator=g) * 0.3)
            if h in plain_heads:
                layer_int4.append(None)
                layer_expected.append((keys, values))
                continue
            key_parts, value_parts = quantize_int4_channels(keys, key_group), quantize_int4(values)
            layer_int4.append(Int4Head(*key_parts, *value_parts))
            served_keys = dequantize_int4_channels(*key_parts, keys.shape[-1], key_group)
            layer_expected.append((served_keys, dequantize_int4(*value_parts, values.shape[-1])))
        indices.append(layer_idx)
        biases.append(layer_bias)
        int4.append(layer_int4)
        expected.append(layer_expected)
    metadata = {"fingerprint": model_fingerprint(model), "method": "test"}
    cache = CompactedCache.from_selection(full, indices, biases, metadata=metadata, int4=int4, key_group=key_group)
    return cache, expected


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return tiny_model("llama")


def context_ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (1, CONTEXT_LEN), generator=torch.Generator().manual_seed(seed))


def test_pack_unpack_exact_for_every_code_and_odd_widths():
    codes = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 1)  # every code, 16 wide
    for width in (16, 15, 1):
        part = codes[:, :width]
        packed = pack_int4(part)
        assert packed.shape == (3, (width + 1) // 2) and packed.dtype == torch.uint8
        assert torch.equal(unpack_int4(packed, width), part)


@pytest.mark.parametrize("key_group", [8, None])
def test_served_prefix_is_dequantize_of_stored(llama, key_group):
    cache, expected = int4_cache(llama, context_ids(), key_group)
    for layer, layer_expected in zip(cache.layers, expected, strict=True):
        assert layer.head_storage() == ["bf16", "int4"]
        prefix = layer.served_prefix(torch.nn.Module())
        for h, (keys, values) in enumerate(layer_expected):
            served_keys, served_values, bias = prefix.head(h)
            assert torch.equal(served_keys, keys) and torch.equal(served_values, values)
            assert bias.dtype == torch.float32 and bias.shape == (keys.shape[0],)
        # nothing dequantised is stored: the layer's keys / values hold only the plain head's rows
        assert layer.prefix_keys.shape[0] == layer.head_lengths()[0]
        plain_keys, _, _, _ = layer.read_prefix(torch.nn.Module())
        assert torch.equal(plain_keys, torch.cat([k.float() for k, _ in layer_expected]))


@pytest.mark.parametrize("key_group", [8, None])
def test_nbytes_is_the_sum_of_the_stored_tensors_and_the_head_layouts(llama, key_group):
    cache, _ = int4_cache(llama, context_ids(), key_group)
    stored = 0
    by_layout = 0
    for layer in cache.layers:
        tensors = [layer.prefix_keys, layer.prefix_values, layer.prefix_bias, layer.prefix_offsets]
        tensors += [layer.quantized.key_codes, layer.quantized.key_scales, layer.quantized.key_offsets]
        tensors += [layer.quantized.value_codes, layer.quantized.value_scales]
        stored += sum(t.numel() * t.element_size() for t in tensors)
        dim, value_dim = layer.prefix_keys.shape[-1], layer.prefix_values.shape[-1]
        for kind, length in zip(layer.head_storage(), layer.head_lengths(), strict=True):
            layout = StorageLayout(kind, dim, value_dim, layer.prefix_keys.element_size(), key_group)
            by_layout += layout.nbytes(length)
        by_layout += OFFSET_BYTES  # the layer's extra offset (H_kv + 1 of them)
    assert cache.nbytes() == stored == by_layout
    assert cache.nbytes() < cache.full_nbytes()


def generate(model, ids, mask, cache, n=6):
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, past_key_values=cache, max_new_tokens=n, do_sample=False, min_new_tokens=n
        )
    return out[:, ids.shape[1] :]


def left_padded_batch(seed: int = 1):
    """Two questions after the context, the second one shorter and left-padded: ``(ids, mask)``."""
    g = torch.Generator().manual_seed(seed)
    questions = torch.randint(3, 256, (2, 6), generator=g)
    mask = torch.ones(2, CONTEXT_LEN + 6, dtype=torch.long)
    mask[1, CONTEXT_LEN : CONTEXT_LEN + 2] = 0  # the second row's question starts 2 tokens later
    questions[1, :2] = 0
    ids = torch.cat([torch.zeros(2, CONTEXT_LEN, dtype=torch.long), questions], dim=1)
    return ids, mask


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int4_cache_generates_the_same_tokens_on_every_attention_path(
    arch, monkeypatch, kernel_calls, refuse_int4_dequantisation
):
    """Reference, fused (torch) and Triton paths; the Triton kernel reads the INT4 codes (torch dequantisation of
    INT4 heads refused while it runs)."""
    from hf_structkv.attention.kernels import biased_attention

    torch.manual_seed(0)
    model = tiny_model(arch)  # 4 query heads over 2 KV heads (GQA)
    cache, _ = int4_cache(model, context_ids(), key_group=8)
    hf_structkv.enable(model)
    ids, mask = left_padded_batch()
    tokens = {}
    for backend in ("reference", "torch"):
        monkeypatch.setenv(BACKEND_ENV, backend)
        tokens[backend] = generate(model, ids, mask, cache.copy())
    monkeypatch.setenv(BACKEND_ENV, "triton")
    calls = kernel_calls(biased_attention, "triton_compacted_attention")
    refuse_int4_dequantisation()
    tokens["triton"] = generate(model, ids, mask, cache.copy())
    assert calls, "the Triton kernel was not called"
    assert torch.equal(tokens["torch"], tokens["reference"]), tokens
    assert torch.equal(tokens["triton"], tokens["reference"]), tokens


def test_int4_heads_change_what_is_served(llama, monkeypatch):
    """The INT4 heads are read: the same cache with the INT4 codes' value scales doubled generates differently."""
    cache, _ = int4_cache(llama, context_ids(), key_group=8, plain_heads=())
    hf_structkv.enable(llama)
    monkeypatch.setenv(BACKEND_ENV, "reference")
    ids, mask = left_padded_batch()
    original = generate(llama, ids, mask, cache.copy())
    for layer in cache.layers:
        layer.quantized = layer.quantized._replace(value_scales=layer.quantized.value_scales * 64)
    assert not torch.equal(generate(llama, ids, mask, cache.copy()), original)


@pytest.mark.parametrize("key_group", [8, None])
def test_round_trip_is_bitwise_and_records_the_storage(llama, key_group, tmp_path):
    cache, _ = int4_cache(llama, context_ids(), key_group)
    cache.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["format_version"] == 2
    assert config["layers"][0]["head_storage"] == ["bf16", "int4"] and config["layers"][0]["key_group"] == key_group
    assert config["context_nbytes"] == cache.nbytes()
    card = (tmp_path / "README.md").read_text()
    assert "| Storage | 2 of 4 KV heads in INT4" in card and "Stored bytes" in card
    loaded = CompactedCache.from_pretrained(tmp_path, model=llama)
    for mine, theirs in zip(cache.layers, loaded.layers, strict=True):
        assert mine.head_storage() == theirs.head_storage()
        assert theirs.quantized.key_group == key_group
        pairs = list(zip(mine.context_tensors(), theirs.context_tensors(), strict=True))
        assert len(pairs) == 9 and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in pairs)
    assert loaded.nbytes() == cache.nbytes()


def test_a_cache_without_int4_heads_is_still_written_as_format_1(llama, tmp_path):
    cache, _ = int4_cache(llama, context_ids(), plain_heads=(0, 1))
    assert all(layer.quantized is None for layer in cache.layers)
    cache.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["format_version"] == 1 and "head_storage" not in config["layers"][0]
    assert "every KV head in float32" in (tmp_path / "README.md").read_text()


def _edit_saved(folder, tensors_edit=None, config_edit=None):
    tensors = load_file(folder / "cache.safetensors")
    config = json.loads((folder / "config.json").read_text())
    if tensors_edit:
        tensors_edit(tensors)
        tensors = {name: t.contiguous() for name, t in tensors.items()}
        config.pop("tensors_sha256")
        config["context_nbytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, folder / "cache.safetensors", metadata={"format": "pt"})
    if config_edit:
        config_edit(config)
    (folder / "config.json").write_text(json.dumps(config))


def _set(mapping, key, value):
    mapping[key] = value


@pytest.mark.parametrize(
    ("tensors_edit", "config_edit", "message"),
    [
        (lambda t: _set(t, "layers.0.key_scales", t["layers.0.key_scales"][:-1]), None, "layers.0.key_scales"),
        (lambda t: _set(t, "layers.1.value_codes", t["layers.1.value_codes"][:, :-1]), None, "layers.1.value_codes"),
        (lambda t: _set(t, "layers.0.key_offsets", t["layers.0.key_offsets"].float()), None, "layers.0.key_offsets"),
        (lambda t: _set(t, "layers.0.value_scales", t["layers.0.value_scales"] * torch.inf), None, "value_scales"),
        (lambda t: t.pop("layers.0.key_codes"), None, "layers.0.key_codes"),
        (None, lambda c: _set(c["layers"][0], "head_storage", ["int4", "nf4"]), "head_storage"),
        (None, lambda c: _set(c["layers"][0], "head_storage", ["int4", "int4"]), "layers.0.keys"),
        (None, lambda c: _set(c["layers"][0], "key_group", 0), "key_group"),
        (None, lambda c: c["layers"][0].pop("key_group"), "key_group"),
        (None, lambda c: _set(c, "format_version", 1), "format_version 2"),
        (None, lambda c: _set(c, "format_version", 3), "format_version"),
    ],
)
def test_bad_int4_files_are_refused_naming_the_field(llama, tmp_path, tensors_edit, config_edit, message):
    cache, _ = int4_cache(llama, context_ids(), key_group=8)
    cache.save_pretrained(tmp_path)
    _edit_saved(tmp_path, tensors_edit, config_edit)
    with pytest.raises(ValueError, match=message):
        CompactedCache.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("key_codes", lambda t: t[:-1]),
        ("key_scales", lambda t: t.float()),
        ("key_offsets", lambda t: t[:, :-1]),
        ("value_scales", lambda t: t * torch.nan),
    ],
)
def test_from_selection_refuses_inconsistent_int4_heads(llama, field, bad):
    full = prefill(llama, context_ids())
    keys, values = full.layers[0].keys[0, 1, :9], full.layers[0].values[0, 1, :9]
    head = Int4Head(*quantize_int4_channels(keys, 4), *quantize_int4(values))
    head = head._replace(**{field: bad(getattr(head, field))})
    indices = [[torch.arange(9), torch.arange(9)] for _ in full.layers]
    int4 = [[None, head]] + [None] * (len(full.layers) - 1)
    with pytest.raises(ValueError, match=f"int4\\[0\\]\\[1\\].{field}"):
        CompactedCache.from_selection(full, indices, int4=int4, key_group=4)


def test_key_groups_counts_rows_of_scales():
    assert [key_groups(n, 4) for n in (0, 1, 4, 5, 9)] == [0, 1, 1, 2, 3]
    assert [key_groups(n, None) for n in (0, 1, 9)] == [0, 1, 1]


def test_copies_share_the_int4_tensors(llama):
    cache, _ = int4_cache(llama, context_ids())
    copy = cache.copy()
    for mine, theirs in zip(cache.layers, copy.layers, strict=True):
        assert isinstance(theirs, CompactedLayer) and theirs.quantized is mine.quantized


class DigitTokenizer:
    """Whitespace-separated integers -> ids (the calibration prompts' words hashed into the vocabulary)."""

    def __call__(self, text, return_tensors=None, add_special_tokens=False):
        ids = [int(t) if t.isdigit() else 3 + sum(map(ord, t)) % 250 for t in text.split()]
        return type("Encoding", (), {"input_ids": torch.tensor([ids])})

    def get_vocab(self):
        return {str(i): i for i in range(256)}


def test_compact_int4_spends_the_bytes_of_the_ratio_on_int4_entries():
    from hf_structkv.compaction import compact

    torch.manual_seed(0)
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (1, 64), generator=torch.Generator().manual_seed(3))
    ratio, key_group = 8, 8
    cache = compact(model, DigitTokenizer(), ids, ratio=ratio, storage="int4", key_group=key_group, progress=False)
    record = cache.metadata["storage"]
    assert record["requested"] == "int4" and record["key_group"] == key_group
    assert record["int4_heads"] + record["fallback_heads"] == 4
    dim = value_dim = 16
    budget_bytes = (64 // ratio) * (dim + value_dim) * 4  # float32 tiny model: 8 entries' keys and values
    int4_entries = StorageLayout("int4", dim, value_dim, key_group=key_group).entries_for(budget_bytes)
    bf16_layout = StorageLayout("bf16", dim, value_dim, 4)
    for layer in cache.layers:
        for kind, length in zip(layer.head_storage(), layer.head_lengths(), strict=True):
            if kind == "int4":
                assert length == int4_entries > 64 // ratio
            else:  # a fallback: the dtype head at the INT4 head's bytes
                int4_bytes = StorageLayout("int4", dim, value_dim, key_group=key_group).nbytes(int4_entries)
                assert length == bf16_layout.entries_for(int4_bytes)
    assert cache.nbytes() <= cache.full_nbytes() / ratio * 1.1  # bias / offset overhead beyond the K/V bytes


def test_compact_int4_refuses_chunks_and_bad_storage_before_prefilling():
    from hf_structkv.compaction import compact

    model = tiny_model("llama")
    ids = torch.randint(3, 256, (1, 32), generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match="storage must be one of"):
        compact(model, DigitTokenizer(), ids, storage="int8")
    with pytest.raises(ValueError, match="one chunk"):
        compact(model, DigitTokenizer(), ids, storage="int4", chunk_tokens=16)
    with pytest.raises(ValueError, match="key_group"):
        compact(model, DigitTokenizer(), ids, storage="int4", key_group=0)


def test_cli_info_shows_storage_and_bytes(llama, tmp_path, capsys):
    from hf_structkv.cli import main

    cache, _ = int4_cache(llama, context_ids(), key_group=8)
    cache.save_pretrained(tmp_path)
    assert main(["info", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "storage              2 of 4 KV heads in INT4" in out
    assert f"stored bytes         {cache.nbytes():,}" in out


def test_cli_compact_accepts_storage():
    from hf_structkv.cli import build_parser

    args = build_parser().parse_args(["compact", "--out", "x", "--storage", "int4", "--key-group", "16"])
    assert (args.storage, args.key_group) == ("int4", 16)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["compact", "--out", "x", "--storage", "int8"])
