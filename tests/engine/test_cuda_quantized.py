"""The quantized linears' CUDA paths: fp8 through `torch._scaled_mm` (activations quantized per token, weight
scales per output channel) on fp8 tensor cores, and int8 weight-only. Each must equal the float product of
its dequantized weight within the activations' quantization error; CPU keeps its own tests
(test_quantization.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.quantization import dequantize, quantize_fp8, quantize_int8
from engine.model.quantized_linear import Fp8Linear, Int8Linear, fp8_gemm_supported, make_fp8_linear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def case(with_bias: bool, tokens: int = 37, k: int = 512, n: int = 384):
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(n, k, device="cuda", generator=gen) * 0.05
    x = torch.randn(tokens, k, device="cuda", generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16) if with_bias else None
    return weight, x, bias


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_gemm_runs_on_fp8_tensor_cores_and_matches_the_dequantized_weight(with_bias):
    if not fp8_gemm_supported(torch.device("cuda")):
        pytest.skip("this GPU has no fp8 tensor cores (compute capability < 8.9)")
    weight, x, bias = case(with_bias)
    q, scales = quantize_fp8(weight)
    linear = make_fp8_linear(q, scales, bias, torch.bfloat16)
    assert isinstance(linear, Fp8Linear)  # not the dequantized fallback
    want = F.linear(x.float(), dequantize(q, scales, torch.float32), None if bias is None else bias.float())
    got = linear(x)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # e4m3 activations: a 3-bit mantissa, ~3% per element, averaging down over K=512 products
    assert relative_error(got, want) < 0.05
    assert linear.nbytes == weight.numel() + 4 * weight.shape[0]  # a byte per weight, float32 scales


@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_weight_only_matches_the_dequantized_weight(with_bias):
    weight, x, bias = case(with_bias)
    q, scales = quantize_int8(weight)
    linear = Int8Linear(q, scales, bias, torch.bfloat16)
    want = F.linear(x.float(), dequantize(q, scales, torch.float32), None if bias is None else bias.float())
    got = linear(x)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert relative_error(got, want) < 0.01  # bf16 activations and output only: the weight is exact
