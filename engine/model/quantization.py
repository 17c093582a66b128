"""Weight quantization: int8 weight-only and fp8 (e4m3), symmetric, one scale per output channel.

    int8   q = round(w / s) in [-127, 127],  s = max|w_row| / 127
    fp8    q = float8_e4m3fn(w / s),          s = max|w_row| / 448   (448: e4m3's largest finite value)

w ~= q * s row by row, so y = x @ w^T = (x @ q^T) * s: the scale is applied once per output,
after the multiply. Scales are float32. Quantizing from float32 (the checkpoint widened) keeps the
rounding to the one step here.

Checkpoints already in fp8 use the format vLLM's `fp8` method and llm-compressor write:
config.json `"quantization_config": {"quant_method": "fp8", ...}`; each linear's `weight` stored as
float8_e4m3fn beside a float32 `weight_scale`, one per tensor (shape [] or [1]) or one per output
channel ([N] or [N, 1]). `save_fp8_checkpoint` writes that format (per tensor, as vLLM reads it).
"""
from __future__ import annotations

import torch

from engine.attention.fp8_kv import FP8_DTYPE, FP8_MAX  # one definition for weights and the KV cache

INT8_MAX = 127.0


def _scales(weight: torch.Tensor, qmax: float, per_channel: bool = True) -> torch.Tensor:
    """max|w| / qmax per output row ([N]), or for the whole tensor ([])."""
    w = weight.detach().float().abs()
    amax = w.amax(dim=1) if per_channel else w.max()
    return (amax / qmax).clamp(min=torch.finfo(torch.float32).tiny)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] weight -> (int8 [N, K], float32 scales [N])."""
    scales = _scales(weight, INT8_MAX)
    q = torch.round(weight.float() / scales[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.contiguous(), scales


def quantize_fp8(weight: torch.Tensor, per_channel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] weight -> (float8_e4m3fn [N, K], float32 scales [N], or [] with `per_channel` False)."""
    scales = _scales(weight, FP8_MAX, per_channel)
    q = (weight.float() / (scales[:, None] if per_channel else scales)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.contiguous(), scales


QUANTIZERS = {"int8": quantize_int8, "fp8": quantize_fp8}
"""quantization -> quantizer(weight) -> (q, per-channel scales)."""


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * s row by row, in `dtype`."""
    return (q.float() * scales.float()[:, None]).to(dtype)


def checkpoint_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint's `weight_scale` (per tensor or per channel) as one float32 scale per row."""
    scale = scale.float().reshape(-1)
    if scale.numel() == 1:
        return scale.expand(rows).clone()
    if scale.numel() != rows:
        raise ValueError(f"weight_scale has {scale.numel()} values for a weight of {rows} rows "
                         "(expected 1 per tensor or 1 per output channel)")
    return scale.clone()
