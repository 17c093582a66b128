"""The worker's feed of prefix-cache events, in numbered batches.

The engine thread calls `flush()` after every iteration: whatever the engine
recorded since (engine/kv_events.py) becomes batch `seq + 1`. Batches hop onto
the asyncio loop and go to every subscriber queue (a router's gRPC stream, the
Redis publisher). `snapshot_now()` answers "everything cached, on every medium,
as of batch S" from the engine thread, so a reader that applies batches after S misses nothing.
A subscriber that falls too far behind gets None and must resubscribe (its
router resyncs from a snapshot).
"""
from __future__ import annotations

import asyncio
import time

from common.protocol import kv_events_to_proto, worker_pb2

MAX_QUEUED_BATCHES = 10_000


class KvEventLog:
    def __init__(self, engine, aio: asyncio.AbstractEventLoop, worker: str = "") -> None:
        self.engine = engine
        self.aio = aio
        self.worker = worker
        self.epoch = time.time_ns() // 1000
        """Identifies this process's sequence (a restarted worker starts again at 1)."""
        self.seq = 0
        self._subscribers: set[asyncio.Queue] = set()
        engine.enable_kv_events()

    # ---- engine thread --------------------------------------------------
    def flush(self) -> None:
        events = self.engine.take_kv_events()
        if events:
            self.seq += 1
            self.aio.call_soon_threadsafe(self._deliver, self.seq, events)

    def snapshot_now(self) -> worker_pb2.KvEventBatch:
        """Run on the engine thread: the whole prefix cache as of the current batch, one BlockStored per
        block and medium holding it (the device pool's blocks, then each lower tier's)."""
        self.flush()
        stored = [worker_pb2.KvEvent(stored=worker_pb2.BlockStored(block_hash=h))
                  for h in self.engine.cached_block_hashes()]
        for medium, hashes in self.engine.offloaded_block_hashes().items():
            stored.extend(worker_pb2.KvEvent(stored=worker_pb2.BlockStored(block_hash=h, medium=medium))
                          for h in hashes)
        return worker_pb2.KvEventBatch(worker=self.worker, seq=self.seq, epoch=self.epoch, snapshot=True,
                                       events=stored)

    # ---- asyncio loop ---------------------------------------------------
    def subscribe(self) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._subscribers.discard(queue)

    def _deliver(self, seq: int, events) -> None:
        batch = worker_pb2.KvEventBatch(worker=self.worker, seq=seq, epoch=self.epoch,
                                        events=kv_events_to_proto(events))
        for queue in list(self._subscribers):
            if queue.qsize() >= MAX_QUEUED_BATCHES:
                self._subscribers.discard(queue)
                queue.put_nowait(None)
            else:
                queue.put_nowait(batch)
