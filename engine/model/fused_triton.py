"""The fused elementwise ops of a decoder layer as Triton kernels, for CUDA (`FusedOps`' interface,
engine/model/fused.py): each one pass over memory with float32 math, rounded where the unfused torch ops round.

  add_rms_norm_  residual += x (stored in the model's dtype); x = RMSNorm(residual) * weight   (in place)
  rms_norm       RMSNorm(x) * weight
  silu_and_mul   silu(gate) * up of [T, 2I] rows
  gelu_tanh_and_mul  gelu_tanh(gate) * up of [T, 2I] rows (Gemma's MLP), the GELU rounded before the product
  rope_          RoPE (rotate-half) in place on the q and k heads of qkv rows; optionally writes each token's
                 rotated K and its V into its cache slot (no index_put per layer, no KV-write kernel), the slot
                 given as (block, offset) or as the Triton backend's flat slot (-1: a CUDA graph's padding)

Tested against the unfused ops under TRITON_INTERPRET=1 on CPU and compiled on an H100
(tests/engine/test_fused_triton.py); `load_fused_ops` uses them on CUDA unless PDSERVE_FUSED_CUDA=0. On the
H100 they took a Llama-1B decode step at 128 x 512 from 2.75 to 2.34 ms of GPU time (BENCHMARKS.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, out_ptr, res_ptr, w_ptr, n_cols, eps, stride_x, stride_out, stride_res,
                     ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:  # residual += x, in the residual's dtype; the norm reads what was stored
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32) + x
        stored = r.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_res + cols, stored, mask=mask)
        x = stored.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(var + eps) * w
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_and_mul_kernel(in_ptr, out_ptr, n, stride_in, stride_out, GELU: tl.constexpr, BLOCK: tl.constexpr):
    """act(gate) * up per [gate | up] row: SiLU, or with GELU the tanh GELU rounded before the product (as
    F.gelu's output is)."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(in_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(in_ptr + row * stride_in + n + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi) (g + 0.044715 g^3)
        inner = tl.minimum(inner, 20.0)  # tanh is 1 in float32 long before; exp(2 * inner) stays finite
        tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
        act = (0.5 * gate * (1.0 + tanh)).to(out_ptr.dtype.element_ty).to(tl.float32)
    else:
        act = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, k_ptr, v_ptr, blocks_ptr, offsets_ptr,
                 stride_t, stride_cos, num_q, num_kv, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
                 page, HALF: tl.constexpr, WRITE: tl.constexpr, FLAT: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (token, q or k head): x * cos + rotate_half(x) * sin, in place. With FLAT, blocks_ptr
    holds flat slots (block * page + offset; negative: a padding token, not written)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    m = i < HALF
    pos = tl.load(pos_ptr + t)
    head = qkv_ptr + t * stride_t + h * 2 * HALF
    x1 = tl.load(head + i, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(head + HALF + i, mask=m, other=0.0).to(tl.float32)
    table = pos * stride_cos
    c1 = tl.load(cos_ptr + table + i, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + table + HALF + i, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + table + i, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + table + HALF + i, mask=m, other=0.0).to(tl.float32)
    o1 = (x1 * c1 - x2 * s1).to(qkv_ptr.dtype.element_ty)
    o2 = (x2 * c2 + x1 * s2).to(qkv_ptr.dtype.element_ty)
    tl.store(head + i, o1, mask=m)
    tl.store(head + HALF + i, o2, mask=m)
    if WRITE:
        if FLAT:
            slot = tl.load(blocks_ptr + t).to(tl.int64)
            block = slot // page
            offset = slot % page
            write = slot >= 0
        else:
            block = tl.load(blocks_ptr + t)
            offset = tl.load(offsets_ptr + t)
            write = block >= 0
        if h >= num_q and write:  # a k head: it and the token's v head of the same index go into the cache slot
            kh = h - num_q
            k_slot = k_ptr + block * stride_kb + offset * stride_ko + kh * stride_kh
            tl.store(k_slot + i, o1, mask=m)
            tl.store(k_slot + HALF + i, o2, mask=m)
            v_head = qkv_ptr + t * stride_t + (num_q + num_kv + kh) * 2 * HALF
            v_slot = v_ptr + block * stride_vb + offset * stride_vo + kh * stride_vh
            tl.store(v_slot + i, tl.load(v_head + i, mask=m, other=0.0), mask=m)
            tl.store(v_slot + HALF + i, tl.load(v_head + HALF + i, mask=m, other=0.0), mask=m)


class TritonFusedOps:
    """`FusedOps` (engine/model/fused.py) on Triton: the same four ops, and Gemma's GELU * up, for CUDA tensors
    (CPU ones under the interpreter)."""

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
        """residual += x, then x = RMSNorm(residual) * weight; both in place; returns x."""
        _norm(x, x, residual, weight, eps)
        return x

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm(x) * weight in float32, rounded once (F.rms_norm's rounding; with a float32 weight of (1 + w),
        Gemma's RMSNorm)."""
        out = torch.empty_like(x)
        _norm(x, out, None, weight, eps)
        return out

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] rows of (gate, up) -> [T, I] silu(gate) * up."""
        return _gated(gate_up, gelu=False)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] rows of (gate, up) -> [T, I] F.gelu(gate, approximate="tanh") * up."""
        return _gated(gate_up, gelu=True)

    writes_flat_slots = True
    """`rope_` also takes the varlen backends' flat slot mapping (the Triton attention backend's)."""

    def rope_(self, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              num_q_heads: int, num_kv_heads: int, k_cache: torch.Tensor | None = None,
              v_cache: torch.Tensor | None = None, slot_blocks: torch.Tensor | None = None,
              slot_offsets: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None) -> None:
        """Rotate the q and k heads of qkv [T, (Hq + 2 Hkv) * D] in place (cos, sin: [max_pos, D]); with caches
        ([blocks, block_size, Hkv, D] views) and slots given (block and offset per token, or `slot_mapping`:
        block * block_size + offset, -1 for a padding token not written), also write each token's rotated K
        and its V."""
        tokens, head_dim = qkv.shape[0], cos.shape[-1]
        if not tokens:
            return
        write = k_cache is not None
        flat = slot_mapping is not None
        k, v = (k_cache, v_cache) if write else (qkv, qkv)
        blocks, offsets = (slot_mapping, slot_mapping) if flat else \
            (slot_blocks, slot_offsets) if write else (positions, positions)
        _rope_kernel[(tokens, num_q_heads + num_kv_heads)](
            qkv, positions, cos, sin, k, v, blocks, offsets, qkv.stride(0), cos.stride(0), num_q_heads, num_kv_heads,
            *(k.stride()[:3] if write else (0, 0, 0)), *(v.stride()[:3] if write else (0, 0, 0)),
            k.shape[1] if write else 1, HALF=head_dim // 2, WRITE=write, FLAT=flat,
            BLOCK=triton.next_power_of_2(head_dim // 2))


def _gated(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(n))
        _act_and_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, n, gate_up.stride(0), out.stride(0),
                                                           GELU=gelu, BLOCK=block)
    return out


def _norm(x: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
          eps: float) -> None:
    rows, n = x.shape
    if not rows:
        return
    res = residual if residual is not None else x
    _rms_norm_kernel[(rows,)](x, out, res, weight, n, eps, x.stride(0), out.stride(0), res.stride(0),
                              ADD=residual is not None, BLOCK=triton.next_power_of_2(n))
