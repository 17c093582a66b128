"""Per-call HMAC tokens for internal gRPC (router -> worker), and the worker's proof back, pure functions.

``v1.<unix seconds>.<nonce>.<hex HMAC-SHA256(key, method | seconds | nonce)>``: bound to the RPC
method and valid for ``MAX_SKEW_S`` around the worker's clock. Without TLS a token seen on the wire
could be replayed within that window for the same method (see docs/architecture.md, Security);
without the key none can be made.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import time

VERSION = "v1"
MAX_SKEW_S = 60.0
MAX_TOKEN_CHARS = 256


def mint(key: bytes, method: str, now: float | None = None) -> str:
    """A token for one call of `method` (e.g. "/pdserve.v1.Worker/Prefill")."""
    ts = str(int(time.time() if now is None else now))
    nonce = secrets.token_hex(8)
    return f"{VERSION}.{ts}.{nonce}.{_mac(key, method, ts, nonce)}"


def check(key: bytes, method: str, token: object, now: float | None = None,
          max_skew_s: float = MAX_SKEW_S) -> bool:
    """Is `token` a valid token for `method` under `key`, minted within `max_skew_s` of `now`?"""
    if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS:
        return False
    parts = token.split(".")
    if len(parts) != 4 or parts[0] != VERSION or not parts[1].isdigit():
        return False
    _, ts, nonce, mac = parts
    now = time.time() if now is None else now
    if abs(now - int(ts)) > max_skew_s:
        return False
    return hmac.compare_digest(_mac(key, method, ts, nonce), mac)


def worker_proof(key: bytes, challenge: str) -> str:
    """A worker's answer to a router's challenge (sent with GetStats): proves the worker holds the
    secret, so a stranger's address (e.g. registered in Redis) is never put in rotation."""
    return hmac.new(key, f"worker-proof\n{challenge}".encode(), hashlib.sha256).hexdigest()


def worker_proof_ok(key: bytes, challenge: str, given: object) -> bool:
    return isinstance(given, str) and hmac.compare_digest(worker_proof(key, challenge), given)


def _mac(key: bytes, method: str, ts: str, nonce: str) -> str:
    return hmac.new(key, f"{method}\n{ts}\n{nonce}".encode(), hashlib.sha256).hexdigest()
