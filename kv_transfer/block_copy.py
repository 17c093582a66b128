"""Copy listed blocks from one paged pool into listed blocks of another, in one kernel.

``copy_blocks(dst, src, dst_ids, src_ids)`` with both pools seen as
``[num_blocks, block_elems]`` tensors on one device: block ``src_ids[i]`` of
``src`` lands in block ``dst_ids[i]`` of ``dst``. On CUDA it is one Triton
launch (one program per block and 16 KiB slice), so a thousand scattered
512 KiB blocks move at device-memory speed instead of paying a copy call per
block. Without Triton (or on CPU, where no transfer uses it) it falls back to
``index_select`` + ``index_copy_``, which reads the blocks twice.

The same kernel runs on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``), which is how CI checks it on machines without a GPU.
"""

from __future__ import annotations

from typing import Any

try:
    import triton
    import triton.language as tl
except ImportError:  # the fallback below needs only torch
    triton = None

#: Elements (of the pool's copy dtype) one program moves.
SLICE_ELEMS = 2048

if triton is not None:

    @triton.jit
    def _copy_blocks_kernel(src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr, block_elems,
                            SLICE: tl.constexpr):
        pair = tl.program_id(0)
        offs = tl.program_id(1) * SLICE + tl.arange(0, SLICE)
        mask = offs < block_elems
        s = tl.load(src_ids_ptr + pair).to(tl.int64)
        d = tl.load(dst_ids_ptr + pair).to(tl.int64)
        vals = tl.load(src_ptr + s * block_elems + offs, mask=mask)
        tl.store(dst_ptr + d * block_elems + offs, vals, mask=mask)


def as_block_rows(flat_bytes: Any, block_nbytes: int) -> Any:
    """A pool's bytes as ``[num_blocks, block_elems]`` of the widest integer type that
    divides a block (8, 4, 2 or 1 bytes): fewer, wider loads per copy."""
    import torch
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if block_nbytes % size == 0 and flat_bytes.data_ptr() % size == 0:
            return flat_bytes.view(dtype).view(-1, block_nbytes // size)
    return flat_bytes.view(-1, block_nbytes)


def copy_blocks(dst: Any, src: Any, dst_ids: Any, src_ids: Any, use_triton: bool = True) -> None:
    """``dst[dst_ids[i]] = src[src_ids[i]]`` for every i; rows are whole blocks.

    ``dst``/``src``: 2-D tensors of one dtype and row length on one device; the ids: int32/int64
    tensors on that device, equally long (ids within range: the caller checked them)."""
    if dst.shape[1] != src.shape[1] or dst.dtype != src.dtype:
        raise ValueError(f"block rows differ: {tuple(dst.shape)} {dst.dtype} vs {tuple(src.shape)} {src.dtype}")
    if dst_ids.numel() != src_ids.numel():
        raise ValueError(f"{dst_ids.numel()} destination ids for {src_ids.numel()} source blocks")
    n = int(src_ids.numel())
    if n == 0:
        return
    if triton is None or not use_triton:
        dst.index_copy_(0, dst_ids.long(), src.index_select(0, src_ids.long()))
        return
    block_elems = int(src.shape[1])
    grid = (n, triton.cdiv(block_elems, SLICE_ELEMS))
    _copy_blocks_kernel[grid](src, dst, src_ids, dst_ids, block_elems, SLICE=SLICE_ELEMS)
