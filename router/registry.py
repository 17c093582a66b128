"""Worker discovery through Redis: workers register with a TTL, routers scan.

Every `interval_s` the router reads all `pdserve:worker:*` hashes. A new
address joins the pool (connected, checked, its KV events fed); one whose key
has expired (missed heartbeats, or it left on drain) is removed. Workers given
on the command line are never removed here (the health poll handles them).

With a cluster secret only registrations signed by a worker holding it count
(`common.cluster_auth.registrations`): an address anyone else wrote is ignored
(logged once), never dialled.

If Redis is unreachable the pool stays as it is (routers serve on their last
view). When it comes back — possibly restarted and empty — workers re-register
within a third of their TTL, so removals wait one TTL after a reconnect.
"""
from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import RedisError

from common import redis_keys
from common.cluster_auth import registrations
from router.worker_pool import WorkerPool

logger = logging.getLogger(__name__)


class RedisRegistry:
    def __init__(self, redis, pool: WorkerPool, interval_s: float, ttl_s: float, key: bytes | None = None) -> None:
        self.redis = redis
        self.key = key
        """Registrations must be signed with it (None: no cluster secret, any registration counts)."""
        self._refused: set[bytes] = set()
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
                pipe.hgetall(key)
            rows = await pipe.execute()
        registered = {}
        for key, fields in zip(keys, rows, strict=True):
            fields = {name.decode(errors="replace"): value for name, value in fields.items()}
            address, role = fields.get("address"), fields.get("role")
            if not address or not role:
                continue
            if self.key is not None and not self._trusted(key, fields):
                continue
            registered[address.decode()] = role.decode()
        return registered

    def _trusted(self, key: bytes, fields: dict[str, bytes]) -> bool:
        """Is this registration signed with the cluster secret, under its own address's key?"""
        address = fields["address"].decode(errors="replace")
        if registrations.verify(self.key, fields) and key.decode(errors="replace") == redis_keys.worker_key(address):
            self._refused.discard(key)
            return True
        if key not in self._refused:
            self._refused.add(key)
            logger.warning("ignoring the worker registration %s: not signed with the cluster secret",
                           key.decode(errors="replace"))
        return False

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.scan()
            except Exception:  # never let discovery die
                logger.exception("registry scan failed")
