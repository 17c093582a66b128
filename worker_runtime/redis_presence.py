"""A worker's presence in Redis: registration with a TTL heartbeat, and its KV event stream.

Every `ttl_s / 3` the worker writes its registry hash (role, address, epoch,
event stream) and renews the key's TTL; when the process stops (or hangs) the
key expires and routers drop the worker. Each KV event batch is appended to
the worker's stream under id `<seq>-1`. If Redis is unreachable the worker
keeps serving: batches written meanwhile are lost, which routers notice as a
sequence gap and repair from a snapshot (GetKvSnapshot); the registration is
rewritten by the next heartbeat once Redis is back.
"""
from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError

from common import redis_client, redis_keys
from common.cluster_auth import events, registrations
from worker_runtime.kv_event_log import KvEventLog

logger = logging.getLogger(__name__)
STREAM_MAXLEN = 100_000


class RedisPresence:
    def __init__(self, url: str, address: str, role: str, log: KvEventLog, ttl_s: float,
                 password_file: str | None = None, events_key: bytes | None = None,
                 registry_key: bytes | None = None) -> None:
        self.address = address
        self.events_key = events_key
        """Signs each batch (routers with the cluster secret ignore unsigned ones); None: unsigned."""
        self.registry_key = registry_key
        """Signs the registration (routers with the cluster secret ignore unsigned ones); None: unsigned."""
        self.role = role
        self.log = log
        self.ttl_s = ttl_s
        self.redis = redis_client.connect(url, timeout_s=max(1.0, ttl_s / 3), password_file=password_file)
        self._tasks: list[asyncio.Task] = []
        self._redis_ok = True

    async def start(self) -> None:
        await self._register()  # fails loudly at start-up if Redis is unreachable
        queue = self.log.subscribe()
        self._tasks = [asyncio.create_task(self._heartbeat()), asyncio.create_task(self._publish(queue))]

    async def stop(self) -> None:
        """Leave the registry at once (routers stop routing here) and close the connection."""
        for task in self._tasks:
            task.cancel()
        if self._tasks:  # bounded: redis-py can swallow a cancellation mid-command
            await asyncio.wait(self._tasks, timeout=3.0)
        try:
            await self.redis.delete(redis_keys.worker_key(self.address))
        except RedisError:
            pass
        await redis_client.close(self.redis)

    async def _register(self) -> None:
        key = redis_keys.worker_key(self.address)
        async with self.redis.pipeline(transaction=True) as pipe:
            fields = {"role": self.role, "address": self.address, "epoch": self.log.epoch,
                      "events": redis_keys.kv_events_key(self.address, self.log.epoch)}
            if self.registry_key is not None:
                fields[registrations.SIGNATURE_FIELD] = registrations.sign(self.registry_key, fields)
            pipe.hset(key, mapping=fields)
            pipe.pexpire(key, int(self.ttl_s * 1000))
            await pipe.execute()

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                await self._register()
                self._up()
            except (RedisError, OSError) as exc:
                self._down(exc)

    async def _publish(self, queue: asyncio.Queue) -> None:
        stream = redis_keys.kv_events_key(self.address, self.log.epoch)
        while True:
            batch = await queue.get()
            if batch is None:  # fell behind: routers will see the gap and resync
                queue = self.log.subscribe()
                continue
            data = batch.SerializeToString()
            fields = {redis_keys.BATCH_FIELD: data}
            if self.events_key is not None:
                fields[redis_keys.SIGNATURE_FIELD] = events.sign(self.events_key, stream, data)
            try:
                await self.redis.xadd(stream, fields, id=redis_keys.stream_id(batch.seq), maxlen=STREAM_MAXLEN,
                                      approximate=True)
                self._up()
            except (RedisError, OSError) as exc:
                self._down(exc)

    def _up(self) -> None:
        if not self._redis_ok:
            logger.warning("redis reachable again")
        self._redis_ok = True

    def _down(self, exc: Exception) -> None:
        if self._redis_ok:
            logger.warning("redis unreachable (%s); serving on, routers resync when it returns", exc)
        self._redis_ok = False
