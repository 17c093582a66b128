"""Signatures of the registrations workers write to Redis (pure functions).

Whoever can write to Redis could otherwise register an address of their choosing as a worker: a
relay that routers would send prompts to. With a cluster secret a worker signs its registration
(role, address, epoch, KV event stream) with HMAC-SHA256, and a router ignores a registration whose
signature is missing, wrong, or whose key in Redis is not its own address's. A relay can copy a real
worker's signed registration only as it is, naming the real worker's address.
"""
from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

SIGNED_FIELDS = ("role", "address", "epoch", "events")
SIGNATURE_FIELD = "signature"


def sign(key: bytes, fields: Mapping[str, object]) -> str:
    """The signature of a registration's `fields` (all of SIGNED_FIELDS)."""
    message = "\n".join(f"{name}={fields[name]}" for name in SIGNED_FIELDS)
    return hmac.new(key, f"worker-registration\n{message}".encode(), hashlib.sha256).hexdigest()


def verify(key: bytes, fields: Mapping[str, bytes | None]) -> bool:
    """Do `fields` (the registration hash as read from Redis, bytes values) carry a valid signature?"""
    values = {name: fields.get(name) for name in (*SIGNED_FIELDS, SIGNATURE_FIELD)}
    if not all(isinstance(v, bytes) for v in values.values()):
        return False
    try:
        text = {name: v.decode() for name, v in values.items()}
    except UnicodeDecodeError:
        return False
    return hmac.compare_digest(sign(key, text), text[SIGNATURE_FIELD])
