"""Keeping the KV index fed: one task per worker reading its KV event batches.

Two sources, one rule. Without Redis the router subscribes to each worker's
`SubscribeKvEvents` stream (a snapshot, then every batch). With Redis it reads
the worker's event stream there (`XREAD` after the last applied batch), so any
number of routers read the same batches in the same order. Either way a batch
that does not follow the last applied one (lost events, a restarted worker, a
Redis that restarted empty) makes the feed resync: load a snapshot (the
stream's first message, or `GetKvSnapshot`), then read on from its sequence
number. While a source is unreachable the index keeps its last view.

With the cluster secret, a batch read from Redis must carry its worker's signature
(common/cluster_auth/events.py): one without a valid one is dropped and the feed
resyncs from the worker's snapshot over authenticated gRPC, so whoever can write to
Redis cannot feed the index false events.
"""
from __future__ import annotations

import asyncio
import logging

import grpc

from common import redis_keys
from common.cluster_auth import events
from common.protocol import kv_events_from_proto, worker_pb2
from engine.kv_events import BlockStored
from router.kv_index import KvIndex
from router.worker_pool import WorkerClient

logger = logging.getLogger(__name__)
RETRY_S = 0.5
XREAD_BLOCK_MS = 1000
CLOSE_WAIT_S = 3.0


class KvFeeds:
    def __init__(self, index: KvIndex, redis=None, events_key: bytes | None = None) -> None:
        self.index = index
        self.redis = redis
        self.events_key = events_key
        self.num_forged = 0
        """Batches dropped from Redis for a missing or wrong signature."""
        self._tasks: dict[str, asyncio.Task] = {}
        self._closing = False

    def start(self, worker: WorkerClient) -> None:
        self.index.add_worker(worker.address)
        run = self._from_redis if self.redis is not None else self._from_grpc
        self._tasks[worker.address] = asyncio.get_running_loop().create_task(run(worker))

    def stop(self, worker: WorkerClient) -> None:
        task = self._tasks.pop(worker.address, None)
        if task is not None:
            task.cancel()
        self.index.remove_worker(worker.address)

    async def close(self) -> None:
        """Stop every feed. Bounded: redis-py can swallow the cancellation of a blocking read,
        so the loops also watch `_closing` and the wait gives up after CLOSE_WAIT_S."""
        self._closing = True
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)
        self._tasks.clear()

    def _load(self, snapshot: worker_pb2.KvEventBatch) -> None:
        blocks = [(e.block_hash, e.medium) for e in kv_events_from_proto(snapshot.events)
                  if isinstance(e, BlockStored)]
        self.index.load_snapshot(snapshot.worker or "", snapshot.seq, blocks, snapshot.epoch)

    def _apply(self, address: str, batch: worker_pb2.KvEventBatch) -> bool:
        ok = self.index.apply(address, batch.seq, kv_events_from_proto(batch.events), batch.epoch)
        if not ok:
            logger.info("KV events of %s: gap before batch %d; resyncing", address, batch.seq)
        return ok

    def _running(self, address: str) -> bool:
        return not self._closing and self._tasks.get(address) is asyncio.current_task()

    async def _from_grpc(self, worker: WorkerClient) -> None:
        while self._running(worker.address):
            call = worker.stub.SubscribeKvEvents(worker_pb2.KvEventsRequest())
            try:
                async for batch in call:
                    if batch.snapshot:
                        batch.worker = worker.address
                        self._load(batch)
                    elif not self._apply(worker.address, batch):
                        break  # resubscribe: the new stream starts with a snapshot
            except grpc.aio.AioRpcError as exc:
                logger.debug("KV events of %s: %s", worker.address, exc.code().name)
                await asyncio.sleep(RETRY_S)
            finally:
                call.cancel()

    async def _from_redis(self, worker: WorkerClient) -> None:
        from redis.exceptions import RedisError
        address = worker.address
        stream = last_id = None
        forged_seq = -1  # a false batch stays in the stream: read on after it, not into it again
        while self._running(address):
            try:
                if not self.index.is_synced(address):
                    snapshot = await worker.stub.GetKvSnapshot(worker_pb2.KvEventsRequest(), timeout=10)
                    snapshot.worker = address
                    self._load(snapshot)
                    new_stream = redis_keys.kv_events_key(address, snapshot.epoch)
                    if new_stream != stream:
                        stream, forged_seq = new_stream, -1  # a restarted worker writes a new stream
                    last_id = redis_keys.stream_id(max(snapshot.seq, forged_seq))
                reply = await self.redis.xread({stream: last_id}, block=XREAD_BLOCK_MS, count=1024)
                forged = self.num_forged
                for _, entries in reply or []:
                    for entry_id, fields in entries:
                        data = fields[redis_keys.BATCH_FIELD]
                        if self.events_key is not None and not events.verify(
                                self.events_key, stream, data, fields.get(redis_keys.SIGNATURE_FIELD)):
                            self.num_forged += 1
                            logger.warning("KV events of %s: a batch in Redis without a valid signature; "
                                           "resyncing from the worker", address)
                            self.index.mark_stale(address)
                            forged_seq = int(entry_id.split(b"-")[0])
                            break
                        if not self._apply(address, worker_pb2.KvEventBatch.FromString(data)):
                            break
                        last_id = entry_id
                if self.num_forged != forged:
                    await asyncio.sleep(RETRY_S)  # whoever writes false batches does not get a busy loop
            except grpc.aio.AioRpcError as exc:
                logger.debug("KV snapshot of %s: %s", address, exc.code().name)
                await asyncio.sleep(RETRY_S)
            except (RedisError, OSError) as exc:
                logger.debug("KV events of %s from redis: %s", address, exc)
                await asyncio.sleep(RETRY_S)
