"""Copiers: how a batch of blocks moves between a KV pool and a staging buffer.

A socket reads and writes host memory only, so the TCP data path stages device
memory through host buffers (:mod:`staging`). What differs between memory kinds
is the copier:

- :class:`HostCopier` (``"cpu"``): synchronous memmoves into plain host
  buffers. Host memory needs no staging; it is used with
  ``KVTransferConfig(staging="always")`` so the very same pipeline runs (and is
  tested) on machines without a GPU.
- :class:`CudaCopier` (``"cuda"``): ``copy_(non_blocking=True)`` between the
  pool and pinned buffers on a side CUDA stream, one CUDA event per batch.
- a tensor-parallel pool's :class:`~kv_transfer.sharded.ShardedCopier` (built on
  :class:`StreamCopier`).

A :class:`Batch` is what one copy moves: runs of consecutive blocks packed in
transfer order.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from .memory import KVRegion

#: Batches of at least this many runs of consecutive blocks are gathered on the device (one
#: kernel + one copy) instead of copied run by run (one call each).
GATHER_MIN_RUNS = 4


class Batch:
    """Consecutive block ids of one transfer that fit one staging buffer.

    ``runs`` are ``(first block id, count, byte offset in the buffer)``: runs of
    consecutive ids merged, packed in transfer order (the byte order on the wire).
    """

    __slots__ = ("runs", "nbytes")

    def __init__(self, block_ids: Sequence[int], block_nbytes: int) -> None:
        self.runs: list[tuple[int, int, int]] = []
        start = prev = None
        offset = 0
        for b in block_ids:
            if prev is not None and b == prev + 1:
                prev = b
                continue
            if start is not None:
                self.runs.append((start, prev - start + 1, offset))
                offset += (prev - start + 1) * block_nbytes
            start = prev = b
        if start is not None:
            self.runs.append((start, prev - start + 1, offset))
            offset += (prev - start + 1) * block_nbytes
        self.nbytes = offset


def split_batches(block_ids: Sequence[int], batch_blocks: int, block_nbytes: int) -> list[Batch]:
    """``block_ids`` cut into batches of at most ``batch_blocks`` blocks, order kept."""
    return [Batch(block_ids[i:i + batch_blocks], block_nbytes)
            for i in range(0, len(block_ids), batch_blocks)]


class HostCopier:
    """Host memory: copies are synchronous memmoves; buffers are plain (unpinned) memory."""

    pin = False

    def __init__(self, region: KVRegion) -> None:
        self.base = region.addr
        self.block_nbytes = region.block_nbytes

    def alloc(self, nbytes: int) -> Any:
        """A staging buffer of ``nbytes``."""
        return np.empty(nbytes, dtype=np.uint8)

    def native(self, mapping: Any) -> Any:
        """The buffer type copies take, over a shared mapping (:mod:`shm_buffer`)."""
        return mapping.array

    def view(self, buf: Any) -> memoryview:
        """Writable byte view of a staging buffer (what the socket reads/writes)."""
        return memoryview(buf)

    def start(self) -> None:
        """Order the copies after work already queued on the pool (nothing to do on host)."""

    def to_host(self, buf: Any, batch: Batch) -> None:
        """Copy the batch's blocks from the pool into ``buf``; returns a completion handle."""
        dst, bs = int(buf.ctypes.data), self.block_nbytes
        for block, count, offset in batch.runs:
            ctypes.memmove(dst + offset, self.base + block * bs, count * bs)

    def to_device(self, buf: Any, batch: Batch) -> None:
        """Copy ``buf`` into the batch's blocks of the pool; returns a completion handle."""
        src, bs = int(buf.ctypes.data), self.block_nbytes
        for block, count, offset in batch.runs:
            ctypes.memmove(self.base + block * bs, src + offset, count * bs)

    def wait(self, handle: Any) -> None:
        """Block until the copy behind ``handle`` finished."""


class StreamCopier:
    """Copiers whose copies return a completion handle (a CUDA event, or None when done at once):
    `to_host` / `to_device` are `_copy` one way or the other."""

    def _copy(self, buf: Any, batch: Batch, to_host: bool) -> Any:
        raise NotImplementedError

    def to_host(self, buf: Any, batch: Batch) -> Any:
        return self._copy(buf, batch, to_host=True)

    def to_device(self, buf: Any, batch: Batch) -> Any:
        return self._copy(buf, batch, to_host=False)

    def wait(self, handle: Any) -> None:
        if handle is not None:
            handle.synchronize()


class CudaCopier(StreamCopier):
    """A torch CUDA pool: async copies on a side stream into pinned buffers."""

    def __init__(self, region: KVRegion) -> None:
        import torch
        self.torch = torch
        pool = region.owner
        self.device = pool.device
        self.flat = pool.reshape(-1).view(torch.uint8)  # bytes of the pool, no copy
        self.block_nbytes = region.block_nbytes
        self.stream = torch.cuda.Stream(device=self.device)
        self._rows = self._scratch = self._slots = None  # the gather path's, made on first use

    pin = True

    def alloc(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=True)

    def native(self, mapping: Any) -> Any:
        return mapping.tensor()

    def view(self, buf: Any) -> memoryview:
        return memoryview(buf.numpy())

    def start(self) -> None:
        # The engine queues its kernels on the default stream: copies start after what is
        # queued there now (e.g. the prefill that wrote these blocks, or reads of the blocks
        # the decode engine just reallocated).
        self.stream.wait_stream(self.torch.cuda.default_stream(self.device))

    def _copy(self, buf: Any, batch: Batch, to_host: bool) -> Any:
        torch = self.torch
        with torch.cuda.stream(self.stream):
            if len(batch.runs) >= GATHER_MIN_RUNS and self._gather_ready():
                self._copy_gathered(buf, batch, to_host)
            else:
                self._copy_runs(buf, batch, to_host)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def _copy_runs(self, buf: Any, batch: Batch, to_host: bool) -> None:
        """One async copy per run of consecutive blocks."""
        bs = self.block_nbytes
        for block, count, offset in batch.runs:
            dev = self.flat[block * bs:(block + count) * bs]
            host = buf[offset:offset + count * bs]
            if to_host:
                host.copy_(dev, non_blocking=True)
            else:
                dev.copy_(host, non_blocking=True)

    def _gather_ready(self) -> bool:
        if self._rows is None:
            try:
                from .block_copy import as_block_rows, triton
                if triton is None:
                    return False
                self._rows = as_block_rows(self.flat, self.block_nbytes)
            except Exception:  # noqa: BLE001 - no Triton here: per-run copies
                return False
        return True

    def _copy_gathered(self, buf: Any, batch: Batch, to_host: bool) -> None:
        """Scattered blocks: one kernel gathers them into a device scratch buffer and one copy
        moves it (or the reverse), instead of one copy call per run. The scratch buffer is
        reused by every batch: the side stream orders its uses."""
        from .block_copy import as_block_rows, copy_blocks
        torch, bs = self.torch, self.block_nbytes
        nbytes = batch.nbytes
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._slots = torch.arange(nbytes // bs, dtype=torch.int32, device=self.device)
        scratch = self._scratch[:nbytes]
        rows = as_block_rows(scratch, bs)
        ids = [b for block, count, _ in batch.runs for b in range(block, block + count)]
        n = len(ids)
        width = -(-n // 4) * 4  # 16-byte aligned ids: one compiled kernel for every count
        padded = torch.zeros(width, dtype=torch.int32)
        padded[:n] = torch.tensor(ids, dtype=torch.int32)
        dev_ids = padded.to(self.device, non_blocking=True)[:n]
        if to_host:
            copy_blocks(rows, self._rows, self._slots[:n], dev_ids)
            buf[:nbytes].copy_(scratch, non_blocking=True)
        else:
            scratch.copy_(buf[:nbytes], non_blocking=True)
            copy_blocks(self._rows, rows, dev_ids, self._slots[:n])
