"""Rotary position embeddings: a cos/sin table per position, as transformers computes it.

The scaling variants (default, linear, llama3, yarn, longrope) are in `engine/model/rope_scaling.py`.
LongRoPE: positions below `original_max_position_embeddings` use the short factors and the rest the
long ones, one table for both. transformers instead picks one set per forward pass from the largest
position in it, so a prompt longer than the original context gets long factors at every position there;
token-by-token decoding past that length is the same in both. Per position, a key's rotation depends only
on its position, so KV stays valid under prefix caching, chunked prefill, batching and P/D transfer
(vLLM switches per batch, on any position > the original length).
"""
from __future__ import annotations

import math

import torch

from engine.model.rope_scaling import attention_factor, long_factor_start


def inverse_frequencies(head_dim: int, theta: float, scaling: dict | None, long: bool = False) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] (float32). `long`: longrope's long_factor set."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    kind = scaling["rope_type"] if scaling else "default"
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling)
    if kind == "longrope":
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * theta ** exponents)
    raise ValueError(f"unsupported rope type {kind!r}")


class RotaryEmbedding:
    """Precomputed cos/sin (times the attention factor) for every position up to max_positions."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 dtype: torch.dtype, device: torch.device) -> None:
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = positions[:, None] * inverse_frequencies(head_dim, theta, scaling)[None, :]
        start = long_factor_start(scaling)
        if start is not None and start < max_positions:
            freqs[start:] = positions[start:, None] * inverse_frequencies(head_dim, theta, scaling, long=True)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = attention_factor(scaling)
        self.cos = (emb.cos() * scale).to(dtype=dtype, device=device)
        self.sin = (emb.sin() * scale).to(dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the step's positions, shaped [T, 1, D] (once per step, shared by layers)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x: [T, H, D] (query and key heads together)."""
        return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, base: float, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        """The dimension whose wavelength fits `num_rotations` times into the original context."""
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_weight = 1 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
