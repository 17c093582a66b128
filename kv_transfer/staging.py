"""Host staging buffers for the TCP data path (CUDA KV over sockets).

A socket reads and writes host memory only, so blocks in device memory go
device -> pinned host buffer -> socket on the sender and socket -> pinned host
buffer -> device on the receiver, one batch of blocks per buffer, with two
buffers per transfer so the copy of one batch overlaps the socket I/O of the
next (the pipeline itself is in :mod:`tcp_path`).

What differs between memory kinds is a *copier*, picked by ``region.device``
from :data:`COPIERS`:

- :class:`HostCopier` (``"cpu"``): synchronous memmoves into plain host
  buffers. Host memory needs no staging; it is used with
  ``KVTransferConfig(staging="always")`` so the very same pipeline runs (and is
  tested) on machines without a GPU.
- :class:`CudaCopier` (``"cuda"``): ``copy_(non_blocking=True)`` between the
  pool and pinned buffers on a side CUDA stream, one CUDA event per batch.

A :class:`Stager` is the copier plus its buffers; a side keeps a
:class:`StagingPool` of them (one per transfer in progress, reused).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from .memory import KVRegion
from .shm_buffer import SharedBuffer

#: Buffers per transfer in progress: batch k+1 is copied while batch k is on the socket.
NUM_BUFFERS = 2
#: Batches of at least this many runs of consecutive blocks are gathered on the device (one
#: kernel + one copy) instead of copied run by run (one call each).
GATHER_MIN_RUNS = 4
#: Shared buffers per transfer (receiver on this host): the sender copies up to three batches
#: ahead while the receiver copies out and acknowledges, so per-batch handoffs overlap copies.
NUM_SHARED_BUFFERS = 4


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


#: Copier class per ``KVRegion.device`` (a tensor-parallel pool: :class:`~kv_transfer.sharded.ShardedCopier`).
COPIERS: dict[str, type] = {"cpu": HostCopier, "cuda": CudaCopier}


def copier_class(region: KVRegion) -> type:
    """The copier that stages ``region``'s blocks."""
    if region.sharded:
        from .sharded import ShardedCopier
        return ShardedCopier
    return COPIERS[region.device]


class Stager:
    """A copier and :data:`NUM_BUFFERS` (shared: :data:`NUM_SHARED_BUFFERS`) buffers of
    ``batch_blocks`` blocks each,
    with the completion handle of the copy last issued on each buffer. With
    ``shared`` the buffers are memfd mappings a receiver on this host can map
    (:class:`~kv_transfer.shm_buffer.SharedBuffer`)."""

    def __init__(self, region: KVRegion, batch_blocks: int, shared: bool = False) -> None:
        self.batch_blocks = batch_blocks
        self.block_nbytes = region.block_nbytes
        self.copier = copier_class(region)(region)
        nbytes = batch_blocks * region.block_nbytes
        self.shared: list[SharedBuffer] = []
        try:
            for _ in range(NUM_SHARED_BUFFERS if shared else 0):
                self.shared.append(SharedBuffer(nbytes, pin=self.copier.pin))
        except BaseException:
            self.close()
            raise
        self.buffers = ([self.copier.native(b) for b in self.shared] if shared
                        else [self.copier.alloc(nbytes) for _ in range(NUM_BUFFERS)])
        self.views = [self.copier.view(b) for b in self.buffers]
        self._pending: list[Any] = [None] * len(self.buffers)

    def describe(self) -> list[dict]:
        """How a receiver on this host maps the buffers (shared stagers only)."""
        return [b.describe() for b in self.shared]

    def close(self) -> None:
        """Free shared buffers (plain ones go with the object)."""
        self.buffers = self.views = []
        for b in self.shared:
            b.close()
        self.shared = []

    def batches(self, block_ids: Sequence[int]) -> list[Batch]:
        """The transfer's block ids in buffer-sized batches."""
        return split_batches(list(block_ids), self.batch_blocks, self.block_nbytes)

    def start(self) -> None:
        """Begin a transfer: order its copies after the device work already queued."""
        self.copier.start()

    def to_host(self, i: int, batch: Batch) -> None:
        """Start copying ``batch`` from the pool into buffer ``i``."""
        self._pending[i] = self.copier.to_host(self.buffers[i], batch)

    def to_device(self, i: int, batch: Batch) -> None:
        """Start copying buffer ``i`` into ``batch``'s blocks of the pool."""
        self._pending[i] = self.copier.to_device(self.buffers[i], batch)

    def wait(self, i: int) -> None:
        """Block until the copy last issued on buffer ``i`` finished."""
        handle, self._pending[i] = self._pending[i], None
        self.copier.wait(handle)

    def settle(self) -> None:
        """Wait for every copy issued (the pool's blocks are no longer touched)."""
        for i in range(len(self._pending)):
            self.wait(i)


class StagingPool:
    """The stagers of one side: created on first use, reused, one per transfer in progress."""

    def __init__(self, region: KVRegion, chunk_bytes: int, shared: bool = False) -> None:
        self.region = region
        self.shared = shared
        #: Mappings of a peer's shared buffers must be page-locked too (CUDA pools).
        self.copier_pins = region.is_cuda if region.sharded else COPIERS[region.device].pin
        self.batch_blocks = max(1, chunk_bytes // region.block_nbytes)
        self._free: list[Stager] = []
        self._lock = threading.Lock()
        self._num_sets = 0
        self._in_use = 0
        self._closed = False

    def acquire(self) -> Stager:
        """A stager for one transfer; give it back with :meth:`release`."""
        with self._lock:
            if self._closed:
                raise RuntimeError("staging pool is closed")
            self._in_use += 1
            if self._free:
                return self._free.pop()
            self._num_sets += 1
        try:
            return Stager(self.region, self.batch_blocks, self.shared)
        except BaseException:
            with self._lock:
                self._in_use -= 1
                self._num_sets -= 1
            raise

    def release(self, stager: Stager) -> None:
        """Return a stager whose copies have settled."""
        with self._lock:
            self._in_use -= 1
            if self._closed:
                self._num_sets -= 1
            else:
                self._free.append(stager)
                return
        stager.close()

    def stats(self) -> dict[str, int]:
        """``staging_sets`` (allocated buffer sets) and ``staging_in_use`` (held by transfers)."""
        with self._lock:
            return {"staging_sets": self._num_sets, "staging_in_use": self._in_use}

    def close(self) -> None:
        """Free the idle buffer sets; sets still in use are freed when released."""
        with self._lock:
            self._closed = True
            self._num_sets -= len(self._free)
            idle, self._free = self._free, []
        for stager in idle:
            stager.close()


def needs_staging(region: KVRegion, staging: str) -> bool:
    """Whether the TCP data path must (or, with ``"always"``, should) stage ``region``."""
    return staging == "always" or not region.is_host  # device memory, or a tensor-parallel pool


def make_staging(region: KVRegion, staging: str, chunk_bytes: int, shared: bool = False) -> StagingPool | None:
    """The side's staging pool (``shared``: buffers a receiver on this host can map), or
    None when its blocks go to the socket directly."""
    return StagingPool(region, chunk_bytes, shared) if needs_staging(region, staging) else None
