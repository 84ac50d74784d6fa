"""Models loaded with bitsandbytes (`BitsAndBytesConfig`, 8-bit and 4-bit, on CPU) serve `CompactedCache` and
`StructuredMixedPrecisionCache` correctly: a keep-everything compacted cache and the all-high policy generate what
`DynamicCache` generates on the same quantized model (issue 31)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, DynamicCache

import hf_structkv
from hf_structkv import CompactedCache
from hf_structkv.attention.mixed_reference import head_output_projections
from hf_structkv.cache.mixed_precision import StructuredMixedPrecisionCache
from hf_structkv.models import tiny_byte_tokenizer, tiny_model
from hf_structkv.policy.table import PolicyTable

bnb = pytest.importorskip("bitsandbytes", reason="scripts/setup.sh installs bitsandbytes==0.50.2")

pytestmark = pytest.mark.filterwarnings("ignore:MatMul8bitLt. inputs will be cast:UserWarning")

QUANTIZATIONS = {
    "int8": (BitsAndBytesConfig(load_in_8bit=True), bnb.nn.Linear8bitLt),
    "nf4": (
        BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32),
        bnb.nn.Linear4bit,
    ),
    "fp4": (
        BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_compute_dtype=torch.float32),
        bnb.nn.Linear4bit,
    ),
}
ARCHS = ["llama", "gemma3"]  # gemma3: sliding-window layers beside global ones
CASES = [(arch, quant) for arch in ARCHS for quant in QUANTIZATIONS]


@pytest.fixture(scope="module")
def saved_tiny_models(tmp_path_factory) -> dict[str, str]:
    """The float32 tiny models (byte-tokenizer vocabulary) saved once, to be reloaded through `BitsAndBytesConfig`."""
    folders = {}
    for arch in ARCHS:
        folders[arch] = str(tmp_path_factory.mktemp(arch))
        tiny_model(arch, vocab_size=300).save_pretrained(folders[arch])  # tiny_byte_tokenizer's 259 ids
    return folders


def quantized_model(folders: dict[str, str], arch: str, quant: str):
    """The tiny model of ``arch`` loaded on CPU with its linear layers quantized by bitsandbytes."""
    config, linear_class = QUANTIZATIONS[quant]
    model = AutoModelForCausalLM.from_pretrained(
        folders[arch], quantization_config=config, device_map="cpu", attn_implementation="sdpa"
    ).eval()
    assert isinstance(model.model.layers[0].self_attn.k_proj, linear_class)  # really quantized
    return model


def prefilled(model, context: torch.Tensor) -> DynamicCache:
    """A `DynamicCache` holding ``context``. References continue from it: an 8-bit model's outputs for a token depend
    on the other tokens of its forward pass (LLM.int8 computes the activation columns holding an outlier in any row
    in FP16), so the reference runs the same forward passes (context, then question) as the compacted cache."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(context, cache=cache)
    return cache


def greedy(model, ids, mask, cache, n=10):
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, past_key_values=cache
        )
    return out[:, ids.shape[1] :]


def keep_all(cache: DynamicCache) -> list:
    """Every position of every KV head of each global layer (None for sliding layers)."""
    return [
        None if layer.is_sliding else [torch.arange(layer.keys.shape[-2]) for _ in range(layer.keys.shape[1])]
        for layer in cache.layers
    ]


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize(("arch", "quant"), CASES)
def test_keep_everything_compacted_cache_generates_like_dynamic_cache(
    saved_tiny_models, arch, quant, backend, monkeypatch
):
    monkeypatch.setenv("HF_STRUCTKV_ATTENTION_BACKEND", backend)
    model = quantized_model(saved_tiny_models, arch, quant)
    g = torch.Generator().manual_seed(0)
    context, question = torch.randint(3, 256, (1, 30), generator=g), torch.randint(3, 256, (1, 6), generator=g)
    full = torch.cat([context, question], 1)
    expected = greedy(model, full, torch.ones_like(full), prefilled(model, context))

    prefix = prefilled(model, context)
    compacted = CompactedCache.from_selection(prefix, keep_all(prefix))
    hf_structkv.enable(model)
    got = greedy(model, full, torch.ones_like(full), compacted)
    assert torch.equal(got, expected), (got, expected)


@pytest.mark.parametrize(("arch", "quant"), CASES)
def test_all_high_mixed_precision_cache_generates_like_dynamic_cache(saved_tiny_models, arch, quant):
    model = quantized_model(saved_tiny_models, arch, quant)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # a left-padded row
    expected = greedy(model, ids, mask, DynamicCache(config=model.config), n=12)

    cache = StructuredMixedPrecisionCache(model, PolicyTable.all_high(model.config, window=2))
    got = greedy(model, ids, mask, cache, n=12)
    assert torch.equal(got, expected), (got, expected)
    assert cache.scheduled_payload() == cache.full_payload()


@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_compact_at_ratio_one_on_a_quantized_model_generates_like_dynamic_cache(saved_tiny_models, quant):
    """`compact` (queries captured from the quantized model) at ratio 1 keeps every entry as it is."""
    model = quantized_model(saved_tiny_models, "llama", quant)
    g = torch.Generator().manual_seed(2)
    context, question = torch.randint(3, 256, (1, 24), generator=g), torch.randint(3, 256, (1, 5), generator=g)
    full = torch.cat([context, question], 1)
    expected = greedy(model, full, torch.ones_like(full), prefilled(model, context))

    tokenizer = tiny_byte_tokenizer()
    compacted = hf_structkv.compact(model, tokenizer, context, ratio=1, budgets="uniform", progress=False)
    got = greedy(model, full, torch.ones_like(full), compacted)
    assert torch.equal(got, expected), (got, expected)


@pytest.mark.parametrize("quant", list(QUANTIZATIONS))
def test_head_output_projections_of_a_quantized_o_proj_compute_what_it_computes(saved_tiny_models, quant):
    """CriticalKV's per-head output projections (value-weighted statistics) of a bitsandbytes ``o_proj``, whose
    weight holds codes: summed over heads they give ``o_proj(x)`` up to the layer's own rounding of ``x``."""
    model = quantized_model(saved_tiny_models, "llama", quant)
    attention = model.model.layers[0].self_attn
    n_q_heads, head_dim = model.config.num_attention_heads, model.config.head_dim
    projections = head_output_projections(attention, n_q_heads, head_dim)  # [H_q, D_v, d_model]
    x = torch.randn(7, n_q_heads * head_dim, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = attention.o_proj(x).float()
    got = torch.einsum("nhd,hdm->nm", x.view(7, n_q_heads, head_dim), projections)
    assert (got - want).abs().max() <= 0.02 * want.abs().max()  # the int8 codes read as weights: ~300x off
    with pytest.raises(ValueError, match="o_proj"):
        head_output_projections(attention, n_q_heads, head_dim + 1)
