"""The one way pdserve opens and closes its asyncio Redis clients (router and workers).

The password never has to be on a command line: it is read from a file
(`--redis-password-file`, e.g. a mounted Kubernetes Secret), else from the
environment variable REDIS_PASSWORD (either only when the URL carries none: `redis://:PASS@host`
would put it back on the command line).
`rediss://` URLs speak TLS (redis-py's own handling of the scheme).
"""
from __future__ import annotations

import asyncio
import logging
import os

import redis.asyncio as aioredis

logger = logging.getLogger(__name__)
CLOSE_TIMEOUT_S = 2.0


PASSWORD_ENV = "REDIS_PASSWORD"


def password(password_file: str | None = None) -> str | None:
    """The Redis password from `password_file` (its first line), else $REDIS_PASSWORD; None: the URL's."""
    if password_file is not None:
        with open(password_file, encoding="utf-8") as f:
            return f.readline().rstrip("\r\n")
    return os.environ.get(PASSWORD_ENV) or None


def connect(url: str, timeout_s: float, password_file: str | None = None) -> aioredis.Redis:
    """A client whose calls give up after `timeout_s` (a blocked Redis must not block serving)."""
    extra = {}
    secret = password(password_file)
    if secret is not None:
        extra["password"] = secret
    return aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, **extra)


async def close(client: aioredis.Redis) -> None:
    """Close without hanging: redis-py can wait forever on a connection whose blocking read
    was cancelled (e.g. an XREAD of a stopped feed) after the server restarted."""
    try:
        await asyncio.wait_for(client.aclose(), CLOSE_TIMEOUT_S)
    except (asyncio.TimeoutError, OSError) as exc:
        logger.info("redis client close gave up: %r", exc)
