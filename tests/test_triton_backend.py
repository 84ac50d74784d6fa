"""Backend choice for compacted attention, and generation through the Triton kernel (interpreter) vs torch."""

import os

# Triton reads this when it decorates kernels, triton.language's own included, so it must be set before triton is
# first imported (hf_structkv and transformers import it): this line covers a run of this file alone, a session-wide
# setting (tests/conftest.py) a whole suite.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import hf_structkv  # noqa: E402
from hf_structkv import CompactedCache  # noqa: E402
from hf_structkv.attention import backend  # noqa: E402
from hf_structkv.attention.backend import (  # noqa: E402
    BACKEND_ENV,
    choose_backend,
    compacted_attention_for,
    mixed_precision_attention_for,
)
from hf_structkv.attention.compacted_reference import compacted_attention  # noqa: E402
from hf_structkv.attention.compacted_sdpa import fused_compacted_attention  # noqa: E402
from hf_structkv.attention.mixed_reference import mixed_precision_attention  # noqa: E402
from hf_structkv.attention.mixed_sdpa import fused_mixed_precision_attention  # noqa: E402
from hf_structkv.models import tiny_model  # noqa: E402

try:
    import triton  # noqa: F401

    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False
requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not importable: pip install hf-structkv[triton]")


def test_auto_serves_cpu_tensors_with_torch(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert choose_backend(torch.zeros(1)) == "torch"
    assert compacted_attention_for(torch.zeros(1)) is fused_compacted_attention
    assert mixed_precision_attention_for(torch.zeros(1)) is fused_mixed_precision_attention
    assert mixed_precision_attention_for(torch.zeros(1), with_prefix=True) is fused_mixed_precision_attention


def test_torch_can_be_forced(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert choose_backend(torch.zeros(1)) == "torch"


def test_the_references_can_be_forced(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "Reference")
    assert choose_backend(torch.zeros(1)) == "reference"
    assert compacted_attention_for(torch.zeros(1)) is compacted_attention
    assert mixed_precision_attention_for(torch.zeros(1)) is mixed_precision_attention
    assert mixed_precision_attention_for(torch.zeros(1), with_prefix=True) is mixed_precision_attention


@requires_triton
def test_triton_can_be_forced_on_cpu_under_the_interpreter(monkeypatch):
    from hf_structkv.attention.kernels.biased_attention import triton_compacted_attention
    from hf_structkv.attention.kernels.mixed_attention import triton_mixed_precision_attention

    monkeypatch.setenv(BACKEND_ENV, " Triton ")
    assert choose_backend(torch.zeros(1)) == "triton"
    assert compacted_attention_for(torch.zeros(1)) is triton_compacted_attention
    assert mixed_precision_attention_for(torch.zeros(1)) is triton_mixed_precision_attention
    assert mixed_precision_attention_for(torch.zeros(1), with_prefix=True) is fused_mixed_precision_attention


@requires_triton
def test_forcing_triton_on_cpu_without_the_interpreter_is_an_error(monkeypatch):
    import triton.language as tl

    from hf_structkv.attention.kernels import runtime

    monkeypatch.setenv(BACKEND_ENV, "triton")
    monkeypatch.setattr(runtime, "INTERPRETED", tl.constexpr(False))  # as if triton_ops was imported without it
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        choose_backend(torch.zeros(1))


def test_forcing_triton_without_triton_is_an_error(monkeypatch):
    monkeypatch.setattr(backend, "_triton_imports", lambda: False)
    monkeypatch.setenv(BACKEND_ENV, "triton")
    with pytest.raises(ImportError, match="hf-structkv\\[triton\\]"):
        choose_backend(torch.zeros(1))
    monkeypatch.setenv(BACKEND_ENV, "auto")
    assert choose_backend(torch.zeros(1)) == "torch"


def test_unknown_backend_and_bad_argument(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        choose_backend(torch.zeros(1))
    with pytest.raises(TypeError, match="torch.Tensor"):
        choose_backend([1.0])


def test_import_does_not_import_triton():
    """triton stays optional: ``import hf_structkv`` never imports the Triton kernels (torch may import triton)."""
    import subprocess
    import sys

    code = "import sys, hf_structkv; assert not any(m.startswith('hf_structkv.attention.kernels') for m in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "TRITON_INTERPRET": "0"})


CONTEXT_LEN = 40


def compacted_llama_cache(model):
    """A CompactedCache of a random 40-token context, ragged per KV head (30% .. 30% + h kept), random biases."""
    g = torch.Generator().manual_seed(0)
    context = torch.randint(3, 256, (1, CONTEXT_LEN), generator=g)
    dense = DynamicCache(config=model.config)
    with torch.no_grad():
        model(context, cache=dense)
    indices, biases = [], []
    for _ in dense.layers:
        kept = [torch.randperm(CONTEXT_LEN, generator=g)[: 12 + 5 * h].sort().values for h in range(2)]
        indices.append(kept)
        biases.append([torch.randn(len(k), generator=g) for k in kept])
    return CompactedCache.from_selection(dense, indices, biases)


QUESTION_LEN = 5


def question_after_context() -> torch.Tensor:
    """``[1, CONTEXT_LEN + QUESTION_LEN]``: placeholder context ids (served by the cache), then a seeded question."""
    question = torch.randint(3, 256, (1, QUESTION_LEN), generator=torch.Generator().manual_seed(1))
    return torch.cat([torch.zeros(1, CONTEXT_LEN, dtype=torch.long), question], 1)


def generate(monkeypatch, model, cache, ids: torch.Tensor, backend_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy 4 tokens from a copy of ``cache`` under ``backend_name``: ``(new tokens [1, 4], logits [4, 1, V])``."""
    monkeypatch.setenv(BACKEND_ENV, backend_name)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=cache.copy(),
            max_new_tokens=4,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[:, ids.shape[1] :], torch.stack(out.logits)


def test_generation_with_the_fused_torch_path_equals_the_reference(monkeypatch):
    model = hf_structkv.enable(tiny_model("llama"))
    cache, ids = compacted_llama_cache(model), question_after_context()
    reference_tokens, reference_logits = generate(monkeypatch, model, cache, ids, "reference")
    fused_tokens, fused_logits = generate(monkeypatch, model, cache, ids, "torch")
    assert torch.equal(fused_tokens, reference_tokens)
    torch.testing.assert_close(fused_logits, reference_logits, atol=1e-4, rtol=0)


@requires_triton
def test_generation_with_triton_equals_torch(monkeypatch, kernel_calls):
    from hf_structkv.attention.kernels import biased_attention

    calls = kernel_calls(biased_attention, "triton_compacted_attention")  # each call's query shape
    model = hf_structkv.enable(tiny_model("llama"))
    cache, ids = compacted_llama_cache(model), question_after_context()
    torch_tokens, torch_logits = generate(monkeypatch, model, cache, ids, "torch")
    assert not calls
    triton_tokens, triton_logits = generate(monkeypatch, model, cache, ids, "triton")
    assert len(calls) == 4 * model.config.num_hidden_layers  # prefill of the question + 3 decode steps
    assert calls[0][2] == QUESTION_LEN and calls[-1][2] == 1
    assert torch.equal(triton_tokens, torch_tokens)
    torch.testing.assert_close(triton_logits, torch_logits, atol=1e-4, rtol=0)
