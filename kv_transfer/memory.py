"""A view of an engine's KV memory as numbered, equally sized byte ranges.

Accepts a torch tensor (CPU or CUDA), a numpy array, or any writable buffer
(bytearray, mmap, ...) holding ``num_blocks * layout.block_nbytes`` bytes.
No data is copied: block ranges are memoryviews over the original memory.
"""

from __future__ import annotations

import ctypes
import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from .layout import KVLayout


@dataclasses.dataclass(frozen=True)
class KVRegion:
    """The KV pool of one engine: base address, block size and device."""

    owner: Any
    """The tensor/array/buffer; kept referenced so the memory stays alive."""
    layout: KVLayout
    addr: int
    nbytes: int
    num_blocks: int
    device: str
    """``"cpu"`` or ``"cuda"``."""
    device_id: int
    sharded: bool = False
    """True for a tensor-parallel worker's pool (:class:`~kv_transfer.sharded.ShardedKV`, made by
    :func:`~kv_transfer.sharded.region_of`): no single byte range, so its blocks only move through
    staging buffers."""

    @property
    def block_nbytes(self) -> int:
        """Bytes per block."""
        return self.layout.block_nbytes

    @property
    def is_cuda(self) -> bool:
        """True when the blocks live in GPU memory."""
        return self.device == "cuda"

    @property
    def is_host(self) -> bool:
        """True when the blocks are plain host memory (a memoryview can address them)."""
        return self.device == "cpu" and not self.sharded

    @classmethod
    def from_buffer(cls, buf: Any, layout: KVLayout) -> KVRegion:
        """Wrap ``buf`` (one buffer) after checking its shape, dtype, contiguity and device kind
        (any pool, a tensor-parallel one too: :func:`~kv_transfer.sharded.region_of`)."""
        device, device_id = device_of(buf)
        if device != layout.device:
            raise ValueError(f"kv_cache is on {device} but the layout says device {layout.device!r}")
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(buf, torch.Tensor):
            return cls._from_torch(buf, layout, device, device_id)
        if not isinstance(buf, np.ndarray):
            buf = np.frombuffer(buf, dtype=np.uint8)  # raises on non-buffers
            if buf.nbytes % layout.block_nbytes:
                raise ValueError(f"buffer of {buf.nbytes} bytes is not a whole number of "
                                 f"{layout.block_nbytes}-byte blocks")
            num_blocks = buf.nbytes // layout.block_nbytes
        else:
            if buf.ndim != 6 or tuple(buf.shape[1:]) != layout.shape(0)[1:]:
                raise ValueError(f"array shape {buf.shape} does not match layout "
                                 f"{layout.shape(buf.shape[0] if buf.ndim else 0)}")
            if buf.dtype.itemsize != layout.itemsize:
                raise ValueError(f"array itemsize {buf.dtype.itemsize} != layout dtype "
                                 f"{layout.dtype} ({layout.itemsize} bytes)")
            num_blocks = buf.shape[0]
        if not buf.flags["C_CONTIGUOUS"]:
            raise ValueError("KV buffer must be C-contiguous")
        return cls(buf, layout, int(buf.ctypes.data), int(buf.nbytes), int(num_blocks), device, device_id)

    @classmethod
    def _from_torch(cls, t: Any, layout: KVLayout, device: str, device_id: int) -> KVRegion:
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype != layout.dtype:
            raise ValueError(f"tensor dtype {dtype} != layout dtype {layout.dtype}")
        if t.dim() != 6 or tuple(t.shape[1:]) != layout.shape(0)[1:]:
            raise ValueError(f"tensor shape {tuple(t.shape)} does not match layout "
                             f"[num_blocks, {', '.join(map(str, layout.shape(0)[1:]))}]")
        if not t.is_contiguous():
            raise ValueError("kv_cache tensor must be contiguous")
        return cls(t, layout, int(t.data_ptr()), int(t.numel() * t.element_size()),
                   int(t.shape[0]), device, device_id)

    def block_addr(self, block_id: int) -> int:
        """Address of block ``block_id``."""
        return self.addr + block_id * self.block_nbytes

    def check_ids(self, block_ids: Sequence[int], what: str) -> list[int]:
        """Validate ids (ints in range, no duplicates) and return them as a list."""
        ids = [int(b) for b in block_ids]
        if len(set(ids)) != len(ids):
            raise ValueError(f"{what}: duplicate block ids")
        for b in ids:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"{what}: block id {b} out of range [0, {self.num_blocks})")
        return ids

    def memview(self) -> memoryview:
        """Writable byte view of the whole region (host memory only)."""
        if not self.is_host:
            raise ValueError(f"no host memoryview of {self.device} memory")
        arr = (ctypes.c_ubyte * self.nbytes).from_address(self.addr)
        return memoryview(arr).cast("B")

    def block_views(self, block_ids: Sequence[int]) -> list[memoryview]:
        """Memoryviews of the blocks in order, runs of consecutive ids merged."""
        mv = self.memview()
        bs = self.block_nbytes
        views: list[memoryview] = []
        start = prev = None
        for b in block_ids:
            if prev is not None and b == prev + 1:
                prev = b
                continue
            if start is not None:
                views.append(mv[start * bs:(prev + 1) * bs])
            start = prev = b
        if start is not None:
            views.append(mv[start * bs:(prev + 1) * bs])
        return views


def device_of(buf: Any) -> tuple[str, int]:
    """``(device kind, device index)`` of a KV buffer: ``("cuda", i)`` for a CUDA tensor,
    ``("cpu", 0)`` for host memory; raises ``ValueError`` on other devices."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buf, torch.Tensor):
        if buf.is_cuda:
            return "cuda", int(buf.device.index or 0)
        if buf.device.type != "cpu":
            raise ValueError(f"unsupported device {buf.device}")
    return "cpu", 0
