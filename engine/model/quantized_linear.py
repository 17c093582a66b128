"""Linears over quantized weights (see engine/model/quantization.py for the formats).

int8 weight-only: `torch._weight_int8pack_mm` (x @ q^T * s in one kernel) where it runs. On CPU
it is fast only with bf16 activations (its float32 path is 10x slower than float32 `F.linear`
here), so on CPU a float32 model's activations are rounded to bf16 for these four linears; the
product is widened back. Where the kernel does not run (a probe at load says), the weight is
widened per call: `F.linear(x, q) * s`, correct but no faster than the unquantized model.

fp8: on CUDA devices with fp8 tensor cores (compute capability 8.9+) `torch._scaled_mm` with the
weight kept in fp8 and the activations quantized per token on the fly (dynamic scales), scales per
output channel (rowwise). Elsewhere, CPU included, no fp8 GEMM is fast (torch's CPU `_scaled_mm`
takes 8-130x `F.linear`'s time here), so the weight is dequantized once at load into the model dtype:
fp8's numerics, none of its memory or speed.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from engine.model.linear import Linear
from engine.model.quantization import FP8_DTYPE, FP8_MAX, dequantize

logger = logging.getLogger(__name__)


class Int8Linear:
    """y = (x @ q^T) * s + b with q int8 [N, K] and s float32 per output channel."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        self.out_features, self.in_features = qweight.shape
        self.qweight = qweight.contiguous()
        self.bias = bias
        self.act_dtype = torch.bfloat16 if qweight.device.type == "cpu" else dtype
        """The activations' dtype inside the kernel (bf16 on CPU: its fast path)."""
        self.scales = scales.to(self.act_dtype)
        self.kernel = _int8pack_works(self.qweight, self.scales)
        """True when `torch._weight_int8pack_mm` runs here; else the weight is widened per call."""
        if not self.kernel:
            logger.info("torch._weight_int8pack_mm unavailable on %s; int8 weights widened per call",
                        qweight.device)

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * self.scales.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            y = torch._weight_int8pack_mm(x.to(self.act_dtype), self.qweight, self.scales).to(x.dtype)
        else:
            y = F.linear(x, self.qweight.to(x.dtype)) * self.scales.to(x.dtype)
        return y if self.bias is None else y + self.bias


def _int8pack_works(qweight: torch.Tensor, scales: torch.Tensor) -> bool:
    try:
        probe = torch.randn(3, qweight.shape[1], dtype=scales.dtype, device=qweight.device)
        got = torch._weight_int8pack_mm(probe, qweight, scales).float()
        want = (probe.float() @ qweight.float().t()) * scales.float()
        return bool(torch.allclose(got, want, rtol=3e-2, atol=3e-2 * float(want.abs().max()) + 1e-3))
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


class Fp8Linear:
    """CUDA fp8 GEMM: y = (xq @ q^T) * (sx sw) + b, xq the activations quantized per token."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        self.out_features, self.in_features = qweight.shape
        self.weight_t = qweight.t()
        """[K, N] column-major: the layout `_scaled_mm` wants for its second operand."""
        self.scale_b = scales.float().reshape(1, -1)
        self.bias = bias
        self.out_dtype = dtype

    @property
    def nbytes(self) -> int:
        return self.weight_t.numel() + self.scale_b.numel() * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        scale_a = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
        xq = (x.float() / scale_a).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return torch._scaled_mm(xq, self.weight_t, scale_a=scale_a, scale_b=self.scale_b, bias=self.bias,
                                out_dtype=self.out_dtype)


def fp8_gemm_supported(device: torch.device) -> bool:
    """fp8 tensor cores: CUDA compute capability 8.9 (Ada) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def make_fp8_linear(qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                    dtype: torch.dtype) -> Fp8Linear | Linear:
    """An fp8 GEMM where the device has one and it agrees with the dequantized weight on a probe;
    else a plain `Linear` over the dequantized weight."""
    if fp8_gemm_supported(qweight.device) and dtype == torch.bfloat16:
        linear = Fp8Linear(qweight, scales, bias, dtype)
        try:
            probe = torch.randn(3, qweight.shape[1], dtype=dtype, device=qweight.device)
            want = F.linear(probe, dequantize(qweight, scales, dtype), bias).float()
            if torch.allclose(linear(probe).float(), want, rtol=0.1, atol=0.1 * float(want.abs().max())):
                return linear
            logger.warning("fp8 GEMM disagrees with the dequantized weight; dequantizing at load")
        except (RuntimeError, NotImplementedError) as exc:
            logger.warning("fp8 GEMM unavailable (%s); dequantizing at load", exc)
    return Linear(dequantize(qweight, scales, dtype), bias)


QUANTIZED_LINEARS = {"int8": Int8Linear, "fp8": make_fp8_linear}
"""quantization -> builder(qweight, scales, bias, dtype)."""
