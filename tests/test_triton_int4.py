"""The Triton INT4 quantise + pack kernel: bit-exact against ``hf_structkv.quant.quantize_int4`` and a brute-force
per-element loop, under the Triton interpreter on CPU."""

import os

# Triton reads this when it decorates kernels, triton.language's own included, so it must be set before triton is
# first imported (hf_structkv and transformers import it): this line covers a run of this file alone, a session-wide
# setting (tests/conftest.py) a whole suite.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from hf_structkv.quant import SMALLEST_FP16, dequantize_int4, quantize_int4  # noqa: E402

try:
    import triton.language as tl

    from hf_structkv.attention.kernels import runtime
    from hf_structkv.attention.kernels.int4 import MAX_BLOCK_PAIRS, triton_quantize_int4
except ImportError as error:  # only where triton cannot be installed
    pytest.skip(f"triton cannot be imported ({error}); pip install 'hf-structkv[triton]'", allow_module_level=True)

if not runtime.interpreter_ready():  # triton was imported before TRITON_INTERPRET=1 was set (by another test module)
    pytest.fail(
        "TRITON_INTERPRET=1 must be set before triton is first imported: set it in tests/conftest.py", pytrace=False
    )


def brute_force_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PASK B.5 element by element: rows of the last dim, scale max|x|/7 in FP16 (floor 2**-24, 1 for zero rows),
    codes round-half-even(x / scale) clipped to [-7, 7], element 2i low nibble / 2i+1 high nibble of byte i."""
    rows = x.float().reshape(-1, x.shape[-1])
    d = rows.shape[1]
    codes = torch.zeros(rows.shape[0], (d + 1) // 2, dtype=torch.uint8)
    scales = torch.zeros(rows.shape[0], 1, dtype=torch.float16)
    for r, row in enumerate(rows):
        peak = max(abs(float(v)) for v in row)
        scale = torch.tensor(peak, dtype=torch.float32) / 7
        scale = max(float(scale.half()), SMALLEST_FP16) if peak > 0 else 1.0
        scales[r, 0] = scale
        for j, v in enumerate(row):
            ratio = float(torch.tensor(float(v), dtype=torch.float32) / torch.tensor(scale, dtype=torch.float32))
            code = min(7, max(-7, round(ratio)))  # Python's round is half-to-even too
            codes[r, j // 2] |= (code & 0xF) << (4 * (j % 2))
    return codes.reshape(*x.shape[:-1], -1), scales.reshape(*x.shape[:-1], 1)


SHAPES = [(3, 16), (5, 7), (2, 3, 1), (4, 2 * MAX_BLOCK_PAIRS + 3), (33, 128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_bit_exact_with_reference(shape, dtype):
    g = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    x.reshape(-1, shape[-1])[0] = 0  # a zero row
    codes, scales = triton_quantize_int4(x)
    ref_codes, ref_scales = quantize_int4(x)
    assert codes.dtype == torch.uint8 and scales.dtype == torch.float16
    assert codes.shape == (*shape[:-1], (shape[-1] + 1) // 2) and scales.shape == (*shape[:-1], 1)
    assert torch.equal(codes, ref_codes)
    assert torch.equal(scales, ref_scales)


@pytest.mark.parametrize("shape", [(3, 5), (2, 2, 8)])
def test_matches_brute_force_loop(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 2
    codes, scales = triton_quantize_int4(x)
    ref_codes, ref_scales = brute_force_quantize(x)
    assert torch.equal(codes, ref_codes)
    assert torch.equal(scales, ref_scales)


def test_ties_round_half_to_even():
    """Peak 3.5 gives scale 0.5 exactly, so x / scale lands on k + 0.5 for every listed x."""
    x = torch.tensor([[3.5, 0.25, 0.75, 1.25, -0.25, -0.75, 1.75, -1.25, 2.25, -2.75, 0.0]])
    codes, scales = triton_quantize_int4(x)
    assert scales.item() == 0.5
    expected = torch.tensor([[7, 0, 2, 2, 0, -2, 4, -2, 4, -6, 0]], dtype=torch.float32) * 0.5
    assert torch.equal(dequantize_int4(codes, scales, x.shape[-1]), expected)
    assert torch.equal(codes, brute_force_quantize(x)[0])


def test_extreme_scales():
    """Tiny rows floor the scale at the smallest FP16; zero rows get scale 1; rows past FP16's range cap the scale at
    65504 and saturate their codes (as quantize_int4 does since issue 34: no inf scale, no NaN)."""
    x = torch.tensor([[1e-30, -3e-31, 0.0], [0.0, 0.0, 0.0], [1e38, -2e38, 1.0], [7e-8, -1e-8, 3e-8]])
    codes, scales = triton_quantize_int4(x)
    ref_codes, ref_scales = quantize_int4(x)
    assert torch.equal(codes, ref_codes) and torch.equal(scales, ref_scales)
    assert scales[0].item() == SMALLEST_FP16 and scales[1].item() == 1.0 and scales[2].item() == 65504.0


def test_non_contiguous_input():
    x = torch.randn(6, 10, generator=torch.Generator().manual_seed(2)).t()  # [10, 6], last-dim stride 10
    assert torch.equal(triton_quantize_int4(x)[0], quantize_int4(x)[0])


def test_empty_leading_dims():
    codes, scales = triton_quantize_int4(torch.zeros(0, 3, 9))
    assert codes.shape == (0, 3, 5) and scales.shape == (0, 3, 1)


@pytest.mark.parametrize(
    ("x", "error"),
    [
        ([1.0, 2.0], TypeError),
        (torch.ones(3, 4, dtype=torch.float64), TypeError),
        (torch.ones(3, 4, dtype=torch.int32), TypeError),
        (torch.ones(3, 0), ValueError),
        (torch.tensor(1.0), ValueError),
    ],
)
def test_bad_inputs_are_rejected(x, error):
    with pytest.raises(error):
        triton_quantize_int4(x)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setattr(runtime, "INTERPRETED", tl.constexpr(False))
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        triton_quantize_int4(torch.ones(2, 4))
