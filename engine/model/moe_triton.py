"""Fused Mixture-of-Experts on Triton (CUDA): grouped GEMMs over (token, expert) pairs sorted by expert.

  align_block_size  the T*k pairs sorted by expert, each expert's run padded to a multiple of BLOCK_M
                    with the sentinel T*k, and one expert id per block of BLOCK_M rows (-1 past the
                    last): vLLM's moe_align_block_size, in torch, with no host sync. With expert
                    parallelism an `expert_map` ([E]: local index, -1 for another rank's expert) turns
                    each block's global expert into the local index of this rank's weights, -1 for the
                    blocks of experts held elsewhere.
  _grouped_gemm     one program per (block of BLOCK_M sorted rows, BLOCK_N output columns): gathers its
                    rows of A, multiplies them by its block's expert's [N, K] weight, adds the expert's
                    bias, optionally scales each row by its pair's routing weight, stores each row at its
                    pair's index. Padding rows load nothing and store nothing; a block whose expert is
                    -1 stores zeros for its pairs (another rank computes them; the all-reduce adds them).
  fused_moe         GEMM 1 (hidden rows `pair // k` x w13) -> SwiGLU (`engine.model.moe.swiglu`) ->
                    GEMM 2 (x w2, routing weights applied) -> sum of each token's k rows.
Same contract as `engine.model.moe.experts_forward`; tested against it under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.model.moe import MoeOutput, MoeSpec, MoeWeights, swiglu


@triton.jit
def _grouped_gemm(a_ptr, b_ptr, bias_ptr, c_ptr, weight_ptr, sorted_ptr, expert_ptr,
                  N, K, num_pairs, a_row_div, stride_am, stride_be, stride_bn, stride_biase, stride_cm,
                  HAS_BIAS: tl.constexpr, MUL_WEIGHT: tl.constexpr, PRECISION: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(expert_ptr + pid_m)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if expert < 0:  # unused block (all padding: stores nothing) or another rank's expert: zeros
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty)
        tl.store(c_ptr + pairs[:, None] * stride_cm + offs_n[None, :], zeros,
                 mask=valid[:, None] & (offs_n[None, :] < N))
        return
    rows = pairs // a_row_div
    offs_k = tl.arange(0, BLOCK_K)
    b_base = b_ptr + expert.to(tl.int64) * stride_be + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(a_ptr + rows[:, None] * stride_am + kk[None, :], mask=valid[:, None] & (kk[None, :] < K),
                    other=0.0)
        b = tl.load(b_base + kk[:, None], mask=(offs_n[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * stride_biase + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc *= tl.load(weight_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + pairs[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & (offs_n[None, :] < N))


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                     expert_map: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, k] expert ids -> (sorted pair ids padded per expert to `block_m` [max_rows], expert per block
    [max_rows / block_m] (-1: unused block; with `expert_map`, the local index, -1 also for another rank's
    expert), pairs per expert [E] (all E))."""
    flat = topk_ids.flatten()
    n, device = flat.numel(), flat.device
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_start = padded.cumsum(0) - padded
    start = counts.cumsum(0) - counts
    expert_of = flat[order]
    max_blocks = (n + num_experts * (block_m - 1) + block_m - 1) // block_m
    sorted_ids = torch.full((max_blocks * block_m,), n, dtype=torch.int32, device=device)
    sorted_ids[padded_start[expert_of] + torch.arange(n, device=device) - start[expert_of]] = order.to(torch.int32)
    block_ends = padded.cumsum(0) // block_m
    block_expert = torch.searchsorted(block_ends, torch.arange(max_blocks, device=device), right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    if expert_map is not None:
        local = expert_map.to(torch.int32)[block_expert.clamp(min=0).long()]
        block_expert = torch.where(block_expert >= 0, local, -1)
    return sorted_ids, block_expert, counts


def _launch(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
            routing: torch.Tensor | None, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
            a_row_div: int, block_m: int) -> None:
    """out[pair] = a[pair // a_row_div] @ w[expert].T (+ bias[expert]) (* routing[pair]) for the sorted pairs."""
    n_out, k_in = w.shape[1], w.shape[2]
    block_n, block_k = 64, 32
    grid = (block_expert.numel(), triton.cdiv(n_out, block_n))
    _grouped_gemm[grid](
        a, w, bias if bias is not None else w, out, routing if routing is not None else w, sorted_ids, block_expert,
        n_out, k_in, out.shape[0], a_row_div, a.stride(0), w.stride(0), w.stride(1),
        bias.stride(0) if bias is not None else 0, out.stride(0),
        HAS_BIAS=bias is not None, MUL_WEIGHT=routing is not None,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)


def fused_moe(hidden: torch.Tensor, weights: MoeWeights, spec: MoeSpec, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, expert_map: torch.Tensor | None = None) -> MoeOutput:
    """The experts half of the MoE layer on Triton; same arguments and result as `experts_forward`. With
    `expert_map` (expert parallelism) `weights` holds only this rank's experts and the pairs of the others
    come out as zeros (engine/parallel/expert_parallel.py's `local_experts_forward` on CUDA)."""
    num_tokens, k = topk_ids.shape
    # Few pairs per expert (decode): small row blocks waste less on padding.
    block_m = 16 if num_tokens * k <= 4 * spec.num_experts else 64
    sorted_ids, block_expert, counts = align_block_size(topk_ids, spec.num_experts, block_m, expert_map)
    hidden, w13, w2 = hidden.contiguous(), weights.w13.contiguous(), weights.w2.contiguous()
    gate_up = hidden.new_empty(num_tokens * k, w13.shape[1])
    _launch(hidden, w13, weights.b13, gate_up, None, sorted_ids, block_expert, k, block_m)
    act = swiglu(gate_up, spec).contiguous()
    out = hidden.new_empty(num_tokens * k, w2.shape[1])
    _launch(act, w2, weights.b2, out, topk_weights.flatten().float().contiguous(), sorted_ids, block_expert, 1,
            block_m)
    return MoeOutput(out.view(num_tokens, k, w2.shape[1]).sum(dim=1), counts)
