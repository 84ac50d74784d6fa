"""Saving, loading and sharing compacted caches (cache/compacted_files.py): round trips, validation errors, mocked
Hub."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache, LlamaForCausalLM

import hf_structkv
from hf_structkv import CompactedCache
from hf_structkv.cache.compacted_files import render_model_card
from hf_structkv.models import tiny_model
from hf_structkv.persistence import model_fingerprint, tokenizer_hash

# The cards and the brief use generate(past_key_values=...), deprecated in transformers 5.x but supported until 6.
pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

CONTEXT_LEN = 24
CACHE_FILES = {"config.json", "cache.safetensors", "README.md"}


class FakeTokenizer:
    """Just what the tokenizer hash reads."""

    def __init__(self, vocab: dict[str, int], special_tokens_map: dict[str, str] | None = None):
        self.vocab = vocab
        self.special_tokens_map = special_tokens_map or {"eos_token": "</s>"}

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


TOKENIZER = FakeTokenizer({"</s>": 1, "a": 3, "b": 4})


def tiny_llama(dtype: torch.dtype = torch.float32, **overrides) -> LlamaForCausalLM:
    return tiny_model("llama", dtype=dtype, **overrides)


def context_ids(length: int = CONTEXT_LEN) -> torch.Tensor:
    return torch.randint(3, 256, (1, length), generator=torch.Generator().manual_seed(1))


def compacted_cache(model, tokenizer=None, **metadata) -> CompactedCache:
    """Prefill the context, then keep a different random number of positions per KV head (random biases and values).

    Sliding-window layers (Gemma3) are kept as they are.
    """
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(context_ids(), cache=cache)
    gen = torch.Generator().manual_seed(2)
    indices, biases, values = [], [], []
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False):
            indices.append(None), biases.append(None), values.append(None)
            continue
        heads, dim_v = layer.keys.shape[1], layer.values.shape[-1]
        lengths = [5 + 4 * h for h in range(heads)]  # ragged: 5, 9, ...
        indices.append([torch.randperm(CONTEXT_LEN, generator=gen)[:n].sort().values for n in lengths])
        biases.append([torch.randn(n, generator=gen) for n in lengths])
        values.append([torch.randn(n, dim_v, generator=gen).to(layer.values.dtype) for n in lengths])
    metadata = {
        "fingerprint": model_fingerprint(model, tokenizer),
        "method": "test",
        "hyperparameters": {"ratio": 0.3, "seed": 2},
        "calibration": "random positions",
        "quality": {"mean_kl": 0.125},
        **metadata,
    }
    return CompactedCache.from_selection(cache, indices, biases, values, metadata=metadata)


def context_tensors(cache: CompactedCache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in layer.context_tensors()]


def assert_same_context(a: CompactedCache, b: CompactedCache) -> None:
    assert a.original_length == b.original_length
    assert [type(layer) for layer in a.layers] == [type(layer) for layer in b.layers]
    pairs = list(zip(context_tensors(a), context_tensors(b), strict=True))
    assert all(x.dtype == y.dtype and torch.equal(x, y) for x, y in pairs)
    assert a.metadata == b.metadata


@pytest.fixture
def saved(tmp_path) -> tuple[LlamaForCausalLM, CompactedCache, Path]:
    model = tiny_llama()
    cache = compacted_cache(model, TOKENIZER)
    folder = tmp_path / "cache"
    cache.save_pretrained(folder)
    return model, cache, folder


def rewrite_tensors(folder: Path, edit) -> None:
    path = folder / "cache.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def rewrite_config(folder: Path, edit) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


# ---------------------------------------------------------------------------------------------------- round trips
def test_round_trip_is_bitwise_and_resave_is_byte_identical(saved, tmp_path):
    model, cache, folder = saved
    assert {p.name for p in folder.iterdir()} == CACHE_FILES
    loaded = CompactedCache.load(folder)
    assert_same_context(cache, loaded)
    assert loaded.head_lengths() == [[5, 9], [5, 9]]
    again = tmp_path / "again"
    loaded.save_pretrained(again)
    for name in CACHE_FILES:
        assert (again / name).read_bytes() == (folder / name).read_bytes(), name


def test_config_json_describes_the_layout(saved):
    _, cache, folder = saved
    config = json.loads((folder / "config.json").read_text())
    assert config["format_version"] == 1
    assert config["hf_structkv_version"] == hf_structkv.__version__
    assert config["original_length"] == CONTEXT_LEN
    assert config["dtype"] == "float32"
    assert config["layers"] == [{"type": "compacted", "head_lengths": [5, 9]}] * 2
    assert config["method"] == "test" and config["quality"] == {"mean_kl": 0.125}
    assert config["fingerprint"]["tokenizer_hash"] == tokenizer_hash(TOKENIZER)
    assert config["context_nbytes"] == sum(t.numel() * t.element_size() for t in context_tensors(cache))
    assert set(load_file(folder / "cache.safetensors")) == {
        f"layers.{i}.{name}" for i in range(2) for name in ("keys", "values", "bias", "offsets")
    }


def test_loaded_cache_generates_like_the_original(saved):
    model, cache, folder = saved
    loaded = CompactedCache.load(folder, model=model, tokenizer=TOKENIZER)
    question = torch.randint(3, 256, (1, 6), generator=torch.Generator().manual_seed(3))

    def generate(prefix_ids: torch.Tensor, source: CompactedCache):
        ids = torch.cat([prefix_ids, question], dim=1)
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=source.copy(),
            max_new_tokens=5,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
        )

    original, reloaded = generate(context_ids(), cache), generate(context_ids(), loaded)
    assert torch.equal(original.sequences, reloaded.sequences)
    assert all(torch.equal(a, b) for a, b in zip(original.logits, reloaded.logits, strict=True))
    # The model card's recipe: placeholder ids stand for the context (generate skips them).
    placeholder = generate(torch.zeros(1, CONTEXT_LEN, dtype=torch.long), loaded)
    assert torch.equal(placeholder.sequences[:, CONTEXT_LEN:], original.sequences[:, CONTEXT_LEN:])


def test_load_with_model_enables_it(saved):
    _, _, folder = saved
    model = tiny_llama()
    assert not hf_structkv.is_enabled(model)
    CompactedCache.load(folder, model=model)
    assert hf_structkv.is_enabled(model)


def test_bf16_round_trip(tmp_path):
    model = tiny_llama(torch.bfloat16)
    cache = compacted_cache(model)
    cache.save_pretrained(tmp_path)
    loaded = CompactedCache.load(tmp_path, model=model)
    assert_same_context(cache, loaded)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    keys, values, bias, offsets = loaded.layers[0].context_tensors()
    assert (keys.dtype, values.dtype, bias.dtype, offsets.dtype) == (
        torch.bfloat16,
        torch.bfloat16,
        torch.float32,
        torch.int64,
    )


def test_gemma3_sliding_layers_round_trip(tmp_path):
    model = tiny_model("gemma3")
    cache = compacted_cache(model)
    cache.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    window = model.config.sliding_window
    assert config["layers"][0] == {"type": "sliding", "sliding_window": window}
    assert config["layers"][1]["type"] == "compacted"
    assert config["fingerprint"]["layer_types"] == model.config.layer_types
    assert "sliding_attention" in config["fingerprint"]["rope_parameters"]
    loaded = CompactedCache.load(tmp_path, model=model)
    assert_same_context(cache, loaded)
    assert loaded.layers[0].context_tensors()[0].shape == (1, 2, window - 1, 16)
    ids = torch.cat([context_ids(), torch.tensor([[5, 6, 7]])], dim=1)
    outputs = [
        model.generate(
            ids, attention_mask=torch.ones_like(ids), past_key_values=c.copy(), max_new_tokens=4, do_sample=False
        )
        for c in (cache, loaded)
    ]
    assert torch.equal(*outputs)


# ---------------------------------------------------------------------------------------------------- bad inputs
def test_save_without_fingerprint_is_refused(tmp_path):
    cache = compacted_cache(tiny_llama())
    del cache.metadata["fingerprint"]
    with pytest.raises(ValueError, match=r'metadata=\{"fingerprint": model_fingerprint\(model, tokenizer\)'):
        cache.save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_save_with_a_reserved_metadata_key_is_refused(tmp_path):
    cache = compacted_cache(tiny_llama(), dtype="float32")
    with pytest.raises(ValueError, match=r"reserved by the file format: \['dtype'\]"):
        cache.save_pretrained(tmp_path)


@pytest.mark.parametrize("name", ["config.json", "cache.safetensors"])
def test_missing_file(saved, name):
    _, _, folder = saved
    (folder / name).unlink()
    with pytest.raises(ValueError, match=f"{name} is missing"):
        CompactedCache.load(folder)


def test_neither_folder_nor_repo_id(tmp_path):
    with pytest.raises(ValueError, match="neither an existing folder nor a Hub repository id"):
        CompactedCache.load(tmp_path / "does" / "not" / "exist")


def test_truncated_safetensors(saved):
    _, _, folder = saved
    path = folder / "cache.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match="cache.safetensors is truncated or corrupt"):
        CompactedCache.load(folder)


def test_nan_is_named(saved):
    _, _, folder = saved

    def inject(tensors):
        tensors["layers.1.values"][3, 1] = float("nan")

    rewrite_tensors(folder, inject)
    with pytest.raises(ValueError, match=r"tensor layers\.1\.values holds NaN or infinite values \(1 entries\)"):
        CompactedCache.load(folder)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.update({"layers.0.extra": torch.zeros(1)}), r"missing \[\], unexpected \['layers\.0\.extra'\]"),
        (lambda t: t.pop("layers.1.bias"), r"missing \['layers\.1\.bias'\], unexpected \[\]"),
    ],
    ids=["extra", "missing"],
)
def test_wrong_tensor_set(saved, edit, message):
    _, _, folder = saved
    rewrite_tensors(folder, edit)
    with pytest.raises(ValueError, match=message):
        CompactedCache.load(folder)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: t.update({"layers.0.offsets": torch.tensor([0, 9, 14])}),
            r"layers\.0\.offsets is \[0, 9, 14\].*needs \[0, 5, 14\]",
        ),
        (lambda t: t.update({"layers.0.offsets": torch.tensor([1, 5, 14])}), r"layers\.0\.offsets is \[1, 5, 14\]"),
        (
            lambda t: t.update({"layers.0.offsets": torch.tensor([0, 5, 14], dtype=torch.int32)}),
            r"layers\.0\.offsets has dtype torch\.int32",
        ),
        (
            lambda t: t.update({"layers.1.keys": t["layers.1.keys"][:-1]}),
            r"layers\.1\.keys has shape \(13, 16\), expected \(14, 16\)",
        ),
        (lambda t: t.update({"layers.1.values": t["layers.1.values"][:-2]}), r"layers\.1\.values has shape \(12, 16\)"),
        (
            lambda t: t.update({"layers.0.bias": t["layers.0.bias"].half()}),
            r"layers\.0\.bias has dtype torch\.float16, expected torch\.float32",
        ),
        (
            lambda t: t.update({"layers.0.keys": t["layers.0.keys"].double()}),
            r"layers\.0\.keys has dtype torch\.float64",
        ),
    ],
    ids=["offsets-vs-lengths", "offsets-start", "offsets-dtype", "key-rows", "value-rows", "bias-dtype", "keys-dtype"],
)
def test_inconsistent_tensors(saved, edit, message):
    _, _, folder = saved
    rewrite_tensors(folder, edit)
    with pytest.raises(ValueError, match=message):
        CompactedCache.load(folder)


def test_head_lengths_not_matching_offsets(saved):
    _, _, folder = saved
    rewrite_config(folder, lambda c: c["layers"][1].update(head_lengths=[6, 8]))
    with pytest.raises(ValueError, match=r"layers\.1\.offsets is \[0, 5, 14\] but layers\[1\]\.head_lengths \[6, 8\]"):
        CompactedCache.load(folder)


def test_unknown_format_version(saved):
    _, _, folder = saved
    rewrite_config(folder, lambda c: c.update(format_version=3))
    with pytest.raises(ValueError, match="unknown format_version 3"):
        CompactedCache.load(folder)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(num_key_value_heads=4), r"num_key_value_heads is 2 in the cache's fingerprint but 4 in the given model"),
        (dict(num_hidden_layers=3), r"num_hidden_layers is 2 in the cache's fingerprint but 3"),
        (
            dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
            r"rope_parameters is .*10000\.0.* but .*500000\.0",
        ),
    ],
    ids=["kv-heads", "layers", "rope"],
)
def test_fingerprint_mismatch(saved, overrides, message):
    _, _, folder = saved
    other = tiny_llama(**overrides)
    with pytest.raises(ValueError, match=message):
        CompactedCache.load(folder, model=other)
    assert not hf_structkv.is_enabled(other)


def test_tokenizer_mismatch(saved):
    _, _, folder = saved
    CompactedCache.load(folder, tokenizer=FakeTokenizer({"b": 4, "a": 3, "</s>": 1}))  # same vocabulary, any order
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        CompactedCache.load(folder, tokenizer=FakeTokenizer({"</s>": 1, "a": 3, "c": 4}))
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        CompactedCache.load(folder, tokenizer=FakeTokenizer(TOKENIZER.vocab, {"eos_token": "a"}))


def test_tokenizer_check_needs_a_saved_hash(tmp_path):
    compacted_cache(tiny_llama()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no tokenizer hash"):
        CompactedCache.load(tmp_path, tokenizer=TOKENIZER)


def test_failed_overwrite_leaves_no_loadable_mix(saved, monkeypatch):
    model, _, folder = saved

    def crash(path, data):  # half the tensors reach the temporary file, then the disk is full
        with open(path, "wb") as file:
            file.write(data[: len(data) // 2])
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_bytes", crash)
    with pytest.raises(OSError, match="disk full"):
        compacted_cache(model, quality={"mean_kl": 9.0}).save_pretrained(folder)
    assert {p.name for p in folder.iterdir()} == {"cache.safetensors", "README.md"}  # no temporary files left
    with pytest.raises(ValueError, match="config.json is missing"):
        CompactedCache.load(folder)


# ---------------------------------------------------------------------------------------------------- Hub (mocked)
def test_load_from_repo_id_downloads_only_the_cache_files(saved, tmp_path, monkeypatch, fake_hub):
    _, cache, folder = saved
    calls = fake_hub(served=folder)
    monkeypatch.chdir(tmp_path)
    loaded = CompactedCache.load("someone/context-cache", revision="v1", token="hf_test")
    assert_same_context(cache, loaded)
    [(repo_id, kwargs)] = calls["downloads"]
    assert repo_id == "someone/context-cache"
    assert kwargs["revision"] == "v1" and kwargs["token"] == "hf_test"
    assert set(kwargs["allow_patterns"]) == CACHE_FILES


def test_push_to_hub_uploads_the_three_files(saved, fake_hub):
    _, cache, _ = saved
    calls = fake_hub(load=CompactedCache.load)
    url = cache.push_to_hub("someone/context-cache", private=True, token="hf_test", revision="v1")
    assert url == "https://huggingface.co/someone/context-cache/commit/abc123"
    assert calls["create_repo"] == ("someone/context-cache", {"private": True, "exist_ok": True})
    assert calls["create_branch"] == ("someone/context-cache", {"branch": "v1", "exist_ok": True})
    assert calls["upload_folder"]["repo_id"] == "someone/context-cache"
    assert calls["upload_folder"]["revision"] == "v1"
    assert calls["files"] == CACHE_FILES
    readme = calls["readme"]
    assert readme.startswith("---\nlibrary_name: hf_structkv\ntags:\n- hf_structkv\n- kv-cache\n- compacted-kv-cache\n")
    assert 'CompactedCache.load("someone/context-cache", model=model' in readme
    assert_same_context(cache, calls["loaded"])


# ---------------------------------------------------------------------------------------------------- model card
def test_model_card_states_sizes_method_and_fingerprint(saved):
    _, cache, folder = saved
    config = json.loads((folder / "config.json").read_text())
    card = render_model_card(config)
    assert card == (folder / "README.md").read_text()
    kept, full = 2 * (5 + 9), 2 * 2 * CONTEXT_LEN
    assert f"{kept} of {full} ({100 * kept / full:.1f}%" in card
    nbytes = sum(t.numel() * t.element_size() for t in context_tensors(cache))
    assert f"({nbytes:,} bytes)" in card and f"({config['full_kv_nbytes']:,} bytes)" in card
    assert f"{100 * nbytes / config['full_kv_nbytes']:.1f}%" in card
    assert "Method: test" in card and "- **ratio**: 0.3" in card and "random positions" in card
    assert "- **mean_kl**: 0.125" in card
    assert config["fingerprint"]["tokenizer_hash"] in card
    assert "past_key_values=cache.copy()" in card and "cache.original_length" in card
    assert "base_model" not in card.split("---")[1]


def test_model_card_front_matter_names_the_base_model(saved):
    _, _, folder = saved
    config = json.loads((folder / "config.json").read_text())
    config["fingerprint"]["name_or_path"] = "/local/snapshot"
    assert "base_model" not in render_model_card(config).split("---")[1]
    config["fingerprint"]["name_or_path"] = "Qwen/Qwen2.5-Coder-0.5B-Instruct"
    assert 'base_model: "Qwen/Qwen2.5-Coder-0.5B-Instruct"\n' in render_model_card(config).split("---")[1]
    config["base_model"] = "org/other-model"
    card = render_model_card(config)
    assert 'base_model: "org/other-model"\n' in card.split("---")[1]
    assert 'AutoModelForCausalLM.from_pretrained("org/other-model")' in card


def test_fingerprint_fields():
    fingerprint = model_fingerprint(tiny_llama())
    assert fingerprint["architecture"] == "LlamaForCausalLM"
    assert (
        fingerprint["num_hidden_layers"],
        fingerprint["num_attention_heads"],
        fingerprint["num_key_value_heads"],
    ) == (2, 4, 2)
    assert (fingerprint["head_dim"], fingerprint["hidden_size"]) == (16, 64)
    assert fingerprint["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}
    assert fingerprint["tokenizer_hash"] is None
    assert json.loads(json.dumps(fingerprint)) == fingerprint
    assert tokenizer_hash(TOKENIZER) == tokenizer_hash(FakeTokenizer({"b": 4, "a": 3, "</s>": 1}))


def test_saved_files_get_the_usual_permissions_not_owner_only(tmp_path):
    import os
    import stat

    from hf_structkv.persistence import replace_file

    target = tmp_path / "file.json"
    replace_file(target, lambda tmp: tmp.write_text("{}", encoding="utf-8"))
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask
