"""Worker discovery through Redis: workers register with a TTL, routers scan.

Every `interval_s` the router reads all `pdserve:worker:*` hashes. A new
address joins the pool (connected, checked, its KV events fed); one whose key
has expired (missed heartbeats, or it left on drain) is removed. Workers given
on the command line are never removed here (the health poll handles them).

If Redis is unreachable the pool stays as it is (routers serve on their last
view). When it comes back — possibly restarted and empty — workers re-register
within a third of their TTL, so removals wait one TTL after a reconnect.
"""
from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import RedisError

from pdserve import redis_keys
from router.worker_pool import WorkerPool

logger = logging.getLogger(__name__)


class RedisRegistry:
    def __init__(self, redis, pool: WorkerPool, interval_s: float, ttl_s: float) -> None:
        self.redis = redis
        self.pool = pool
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.static = {w.address for w in pool.workers}
        self._up_since: float | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.scan()
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task], timeout=3.0)  # bounded, as in kv_feeds

    async def scan(self) -> None:
        try:
            registered = await self._read()
        except (RedisError, OSError) as exc:
            if self._up_since is not None:
                logger.warning("redis unreachable (%s): serving on the last view of the workers", exc)
            self._up_since = None
            return
        now = time.monotonic()
        if self._up_since is None:
            self._up_since = now
        for address, role in registered.items():
            if self.pool.get(address) is None:
                await self.pool.add(address, role)
        if now - self._up_since < self.ttl_s:
            return  # just (re)connected: give workers one TTL to re-register
        for worker in list(self.pool.workers):
            if worker.address not in registered and worker.address not in self.static:
                logger.warning("%s worker %s left the registry (heartbeats stopped)", worker.role, worker.address)
                await self.pool.remove(worker.address)

    async def _read(self) -> dict[str, str]:
        keys = [key async for key in self.redis.scan_iter(match=redis_keys.WORKER_PATTERN, count=1000)]
        if not keys:
            return {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hmget(key, "address", "role")
            rows = await pipe.execute()
        return {address.decode(): role.decode() for address, role in rows if address and role}

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.scan()
            except Exception:  # never let discovery die
                logger.exception("registry scan failed")
