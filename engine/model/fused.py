"""Fused elementwise ops of a decoder layer on CPU, and the unfused torch ops they replace.

Unfused, one layer's elementwise half is a dozen torch ops, each a full pass over
memory (residual add; RMSNorm's pow/mean/rsqrt/mul; SiLU, then the multiply by up;
RoPE's two products, neg, cat and sum; two index_puts writing K and V into the
cache). `FusedOps` runs them as four C++ kernels (engine/csrc/fused_ops.cpp, built
with the decode-attention kernel by `cpu_kernels`; AVX2+FMA paths where the
compiler targets them, scalar elsewhere), each one pass with float32 math:

  add_rms_norm_  residual += x; x = RMSNorm(residual) * weight   (in place)
  rms_norm       RMSNorm(x) * weight
  silu_and_mul   silu(gate) * up
  rope_          RoPE in place on the q and k heads of qkv rows, optionally writing
                 the rotated K and V into their cache slots

They are CPU-only: on CUDA `load_fused_ops` returns the same four ops as Triton kernels
(engine/model/fused_triton.py; PDSERVE_FUSED_CUDA=0 keeps the unfused torch ops there),
and None for other devices, for dtypes other than float32/bfloat16 (float16 too on CUDA),
when the kernels cannot be built, or when PDSERVE_FUSED=0. The unfused ops they must equal are
`engine.model.llama.rms_norm`, `F.silu(gate) * up` and `RotaryEmbedding.apply`.
"""
from __future__ import annotations

import os
from types import ModuleType

import torch

from engine import cpu_kernels

FUSED_DTYPES = (torch.float32, torch.bfloat16)


def fused_enabled() -> bool:
    """False when PDSERVE_FUSED=0 (the unfused torch ops run: the A/B switch of the benchmarks)."""
    return os.environ.get("PDSERVE_FUSED", "1") != "0"


class FusedOps:
    """The fused kernels of one built module (see the module docstring)."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
        """residual += x, then x = RMSNorm(residual) * weight; both in place; returns x."""
        self.module.fused_add_rms_norm(x, residual, weight, eps)
        return x

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.module.rms_norm(x, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] rows of (gate, up) -> [T, I] silu(gate) * up."""
        return self.module.silu_and_mul(gate_up)

    def rope_(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              num_q_heads: int, num_kv_heads: int, k_cache: torch.Tensor | None = None,
              v_cache: torch.Tensor | None = None, slot_blocks: torch.Tensor | None = None,
              slot_offsets: torch.Tensor | None = None) -> None:
        """Rotate the q and k heads of qkv [T, (Hq + 2 Hkv) * D] in place (cos, sin: [max_pos, D]);
        with caches and slots given, also write each token's rotated K and its V into its slot."""
        self.module.rope_and_cache(qkv, positions, cos, sin, num_q_heads, num_kv_heads,
                                   k_cache, v_cache, slot_blocks, slot_offsets)


def load_fused_ops(device: torch.device, dtype: torch.dtype):
    """The fused ops for this device and dtype (`FusedOps`, or on CUDA the Triton ones of fused_triton.py unless
    PDSERVE_FUSED_CUDA=0), or None where the unfused torch ops must run."""
    if dtype not in FUSED_DTYPES and dtype != torch.float16 or not fused_enabled():
        return None
    if device.type == "cuda" and os.environ.get("PDSERVE_FUSED_CUDA", "1") != "0":
        from engine.model.fused_triton import TritonFusedOps
        return TritonFusedOps()
    if device.type != "cpu" or dtype not in FUSED_DTYPES:
        return None
    module = cpu_kernels.load()
    if module is None or not hasattr(module, "silu_and_mul"):
        return None
    return FusedOps(module)

