"""The one way pdserve opens and closes its asyncio Redis clients (router and workers)."""
from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis

logger = logging.getLogger(__name__)
CLOSE_TIMEOUT_S = 2.0


def connect(url: str, timeout_s: float) -> aioredis.Redis:
    """A client whose calls give up after `timeout_s` (a blocked Redis must not block serving)."""
    return aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


async def close(client: aioredis.Redis) -> None:
    """Close without hanging: redis-py can wait forever on a connection whose blocking read
    was cancelled (e.g. an XREAD of a stopped feed) after the server restarted."""
    try:
        await asyncio.wait_for(client.aclose(), CLOSE_TIMEOUT_S)
    except (asyncio.TimeoutError, OSError) as exc:
        logger.info("redis client close gave up: %r", exc)
