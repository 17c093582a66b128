"""Host staging buffers for the TCP data path (CUDA KV over sockets).

A socket reads and writes host memory only, so blocks in device memory go
device -> pinned host buffer -> socket on the sender and socket -> pinned host
buffer -> device on the receiver, one batch of blocks per buffer, with two
buffers per transfer so the copy of one batch overlaps the socket I/O of the
next (the pipeline itself is in :mod:`tcp_path`).

What differs between memory kinds is a *copier* (:mod:`copiers`), picked by
``region.device`` from :data:`COPIERS` (a tensor-parallel pool:
:class:`~kv_transfer.sharded.ShardedCopier`).

A :class:`Stager` is the copier plus its buffers; a side keeps a
:class:`StagingPool` of them (one per transfer in progress, reused).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from .copiers import Batch, CudaCopier, HostCopier, split_batches
from .memory import KVRegion
from .sharded import ShardedCopier
from .shm_buffer import SharedBuffer

#: Buffers per transfer in progress: batch k+1 is copied while batch k is on the socket.
NUM_BUFFERS = 2
#: Shared buffers per transfer (receiver on this host): the sender copies up to three batches
#: ahead while the receiver copies out and acknowledges, so per-batch handoffs overlap copies.
NUM_SHARED_BUFFERS = 4


#: Copier class per ``KVRegion.device`` (a tensor-parallel pool: :class:`~kv_transfer.sharded.ShardedCopier`).
COPIERS: dict[str, type] = {"cpu": HostCopier, "cuda": CudaCopier}


def copier_class(region: KVRegion) -> type:
    """The copier that stages ``region``'s blocks."""
    if region.sharded:
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
