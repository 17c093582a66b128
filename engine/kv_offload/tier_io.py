"""The tiers' I/O thread: moves block bytes between the device pool, host memory and the disk file.

The engine thread decides everything (which slot, which block, what is pinned)
and hands the thread jobs; the thread only copies bytes and checks checksums,
so no index is ever shared. Loads go before stores (a request waits on them).
On CUDA the copies run on a side stream that first waits for the compute
stream's work queued when the job was made (the step that computes a stored
block, or a step still writing a block a load is about to fill), and the job
is done when that side stream is; the engine thread never waits for it.
A job that raises is reported failed; the thread goes on.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from engine.kv_offload.pool_view import PoolView

logger = logging.getLogger(__name__)


@dataclass
class StoreJob:
    """Device blocks -> host slots."""
    items: list[tuple[int, int, int]]
    """(device block id, block hash, host slot)."""
    ready_event: object = None
    ok: bool = False

    def run(self, io: TierIO) -> None:
        for block_id, _, slot in self.items:
            io.pool.copy_out(block_id, io.host.row(slot))
        self.ok = True


@dataclass
class DiskWriteJob:
    """Host slots -> disk slots (with their records)."""
    items: list[tuple[int, int, int, int, tuple[int, ...], int]]
    """(host slot, disk slot, block hash, parent hash, token ids, write sequence)."""
    ready_event: object = None
    ok: bool = False

    def run(self, io: TierIO) -> None:
        for host_slot, disk_slot, block_hash, parent, tokens, seq in self.items:
            io.disk.write(disk_slot, block_hash, parent, tokens, seq, io.host.row(host_slot))
        self.ok = True


@dataclass
class LoadJob:
    """Host or disk slots -> device blocks, in prefix order; stops at the first block that fails its check."""
    key: str
    sources: list[tuple[object, int, int]]
    """(tier, block hash, slot) per block."""
    block_ids: list[int]
    ready_event: object = None
    num_loaded: int = 0
    started: float = field(default_factory=time.monotonic)
    seconds: float = 0.0

    def run(self, io: TierIO) -> None:
        for (tier, block_hash, slot), block_id in zip(self.sources, self.block_ids, strict=True):
            if tier.medium == "disk" and not tier.verify(slot, block_hash):
                break
            io.pool.copy_in(tier.row(slot), block_id)
            self.num_loaded += 1


class TierIO:
    def __init__(self, pool: PoolView, host, disk) -> None:
        self.pool, self.host, self.disk = pool, host, disk
        self._stream = torch.cuda.Stream(pool.device) if pool.device.type == "cuda" else None
        self._urgent: deque = deque()
        self._jobs: deque = deque()
        self._wake = threading.Condition()
        self.done: deque = deque()
        self.done_event = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="kv-tier-io", daemon=True)
        self._thread.start()

    def ready_event(self):
        """Marks the compute stream's work queued so far (CUDA); the job's copies wait for it."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.pool.device))
        return event

    def submit(self, job, urgent: bool = False) -> None:
        with self._wake:
            (self._urgent if urgent else self._jobs).append(job)
            self._wake.notify()

    @property
    def busy(self) -> bool:
        return bool(self._urgent or self._jobs)

    def stop(self) -> None:
        """Finish the jobs given so far, then end the thread."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._urgent or self._jobs or self._stopped):
                    self._wake.wait()
                if not (self._urgent or self._jobs):
                    return  # stopped, with every job given done
                job = (self._urgent or self._jobs).popleft()
            try:
                self._execute(job)
            except Exception:  # one job fails, the tiers go on
                logger.exception("KV tier job %s failed", type(job).__name__)
            if isinstance(job, LoadJob):
                job.seconds = time.monotonic() - job.started
            self.done.append(job)
            self.done_event.set()

    def _execute(self, job) -> None:
        if self._stream is None:
            job.run(self)
            return
        with torch.cuda.stream(self._stream):
            if job.ready_event is not None:
                self._stream.wait_event(job.ready_event)
            job.run(self)
        self._stream.synchronize()
