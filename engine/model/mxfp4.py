"""MXFP4 expert weights (gpt-oss's published checkpoints), dequantised on the CPU at load.

An MXFP4 tensor stores each row of a weight `[out, in]` as blocks of 32 values sharing one scale:

  <name>_blocks  uint8 [*prefix, out, in / 32, 16]: two FP4 (e2m1) codes per byte, the low nibble first
                 (value 2j of the block in the low 4 bits of byte j, value 2j + 1 in the high 4 bits)
  <name>_scales  uint8 [*prefix, out, in / 32]: E8M0 exponents, scale = 2 ** (s - 127)
  e2m1 code      bit 3 the sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6

so a value is `E2M1[code] * 2 ** (s - 127)`, exact in float32 and bfloat16 (a 2-bit mantissa times a power of
two). gpt-oss stores `mlp.experts.gate_up_proj` and `down_proj` this way, each as the transpose of the parameter
transformers computes with: the blocks of `gate_up_proj` are `[E, 2I, H/32, 16]` for the parameter `[E, H, 2I]`.
`dequantize` returns that parameter layout, as transformers' `integrations/mxfp4.py`
(`convert_moe_packed_tensors`) does, so `engine.model.moe.read_moe_weights` reads it under its usual names.

Here the experts then run unquantized in the model's dtype (bfloat16: 4x the bytes of MXFP4). A GPU engine
would keep the blocks and scales and run a Mixture-of-Experts kernel that dequantises inside the GEMM
(triton_kernels' `matmul_ogs` with an MXFP4 weight layout, as vLLM and transformers do on Hopper and later):
not built here.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 FP4 e2m1 codes' values (the code is the index)."""
BLOCK = 32
"""Values per scale."""
_ROWS_PER_CHUNK = 1 << 12


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`<name>_blocks` [*prefix, out, in/32, 16] and `<name>_scales` [*prefix, out, in/32] -> the parameter
    [*prefix, in, out] in `dtype` (float32 or bfloat16: every value is exact in both)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(expected blocks [..., {BLOCK // 2}] over the scales' shape)")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"MXFP4 dequantises to float32 or bfloat16, not {dtype}")
    *prefix, rows, groups, _ = blocks.shape
    table = torch.tensor(E2M1_VALUES, dtype=dtype)
    flat_blocks, flat_scales = blocks.reshape(-1, groups, BLOCK // 2), scales.reshape(-1, groups)
    out = torch.empty(flat_blocks.shape[0], groups * BLOCK, dtype=dtype)
    for start in range(0, out.shape[0], _ROWS_PER_CHUNK):  # bounds the int64 codes' memory
        part = slice(start, start + _ROWS_PER_CHUNK)
        codes = torch.stack([flat_blocks[part] & 0x0F, flat_blocks[part] >> 4], dim=-1).long()  # low nibble first
        exponents = (flat_scales[part].int() - 127).repeat_interleave(BLOCK, dim=-1)
        out[part] = torch.ldexp(table[codes].flatten(1), exponents.to(dtype))
    return out.view(*prefix, rows, groups * BLOCK).transpose(-1, -2).contiguous()


def dequantizing_reader(take: Callable[[str], torch.Tensor], has: Callable[[str], bool],
                        dtype: torch.dtype) -> Callable[[str], torch.Tensor]:
    """A `take(name)` for `read_moe_weights` that returns `name` dequantised from `name_blocks` / `name_scales`
    where the checkpoint stores it so, and `take(name)` itself otherwise. `dtype`: the model's; bfloat16 stays
    bfloat16, anything else is dequantised in float32 (and cast by the caller)."""
    work = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32

    def read(name: str) -> torch.Tensor:
        if has(name + "_blocks"):
            return dequantize(take(name + "_blocks"), take(name + "_scales"), work)
        return take(name)
    return read
