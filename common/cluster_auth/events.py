"""Signatures of the KV event batches workers write to Redis (pure functions).

Redis is shared state, and whoever can write to it (a leaked password, a neighbour on a
passwordless Redis) could feed routers false KV events: steer prompts to the wrong worker or
poison the prefix index. With a cluster secret a worker signs each batch with HMAC-SHA256 over the
stream's name (its address and epoch) and the batch's bytes (which hold its sequence number), so a
batch cannot be forged, altered or moved to another worker's stream; a router that reads a batch
without a valid signature ignores it and reloads the worker's index from ``GetKvSnapshot`` (gRPC,
authenticated).
"""
from __future__ import annotations

import hashlib
import hmac


def sign(key: bytes, stream: str, batch: bytes) -> bytes:
    """The signature of ``batch`` written to ``stream``."""
    return hmac.new(key, stream.encode() + b"\n" + batch, hashlib.sha256).hexdigest().encode()


def verify(key: bytes, stream: str, batch: bytes, signature: object) -> bool:
    """Does ``signature`` (bytes from Redis) sign ``batch`` on ``stream`` under ``key``?"""
    return isinstance(signature, bytes) and hmac.compare_digest(sign(key, stream, batch), signature)
