"""fp8 (float8_e4m3fn) KV cache: store K/V divided by a per-layer scale, read them back times it.

float8_e4m3fn has no infinity (an overflowing cast gives NaN), so values are
saturated to ±448 before the cast. Reads widen to float32 before the scale
multiply, then round once to the compute dtype.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0


def is_fp8(cache: torch.Tensor) -> bool:
    """True when `cache` stores fp8 values (scales apply)."""
    return cache.dtype == FP8_DTYPE


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale, saturated and cast to float8_e4m3fn."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """fp8 values times scale, in `dtype` (float32 math)."""
    return (x.float() * scale).to(dtype)
