"""Per-call HMAC tokens for internal gRPC (router -> worker), and the worker's proof back, pure functions.

``v1.<unix seconds>.<nonce>.<hex HMAC-SHA256(key, method | seconds | nonce)>``: bound to the RPC
method and valid for ``MAX_SKEW_S`` around the worker's clock, and accepted once: a worker remembers
the nonces of the tokens it accepted until they expire (:class:`ReplayGuard`), so a token seen on the
wire (plaintext gRPC) cannot be replayed. Without the key none can be made.
"""
from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import secrets
import time

logger = logging.getLogger(__name__)

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


class ReplayGuard:
    """The nonces of accepted tokens, each until its token expires: a token is good for one call.

    Check the token's MAC first (only valid tokens are remembered, so strangers cannot fill it).
    Bounded by ``max_entries``: past it the oldest nonces are forgotten early (logged), which
    reopens replay for those only; 500k nonces cover ~4k calls/s over the 121 s a token can live."""

    def __init__(self, max_skew_s: float = MAX_SKEW_S, max_entries: int = 500_000) -> None:
        self.max_skew_s = max_skew_s
        self.max_entries = max_entries
        self._expiry: dict[str, float] = {}
        self._order: collections.deque[tuple[float, str]] = collections.deque()
        self.num_replays = 0
        self._warned_full = False

    def first_use(self, token: str, now: float | None = None) -> bool:
        """True the first time a (valid) token is seen, False on any later use."""
        now = time.time() if now is None else now
        while self._order and (self._order[0][0] < now or len(self._order) >= self.max_entries):
            expires, nonce = self._order.popleft()
            if expires >= now and not self._warned_full:
                self._warned_full = True
                logger.warning("token replay guard full (%d nonces): forgetting the oldest early", self.max_entries)
            if self._expiry.get(nonce) == expires:
                del self._expiry[nonce]
        _, ts, nonce, _ = token.split(".")
        if nonce in self._expiry:
            self.num_replays += 1
            return False
        expires = int(ts) + self.max_skew_s + 1
        self._expiry[nonce] = expires
        self._order.append((expires, nonce))
        return True

    def __len__(self) -> int:
        return len(self._expiry)


def worker_proof(key: bytes, challenge: str) -> str:
    """A worker's answer to a router's challenge (sent with GetStats): proves the worker holds the
    secret, so a stranger's address (e.g. registered in Redis) is never put in rotation."""
    return hmac.new(key, f"worker-proof\n{challenge}".encode(), hashlib.sha256).hexdigest()


def worker_proof_ok(key: bytes, challenge: str, given: object) -> bool:
    return isinstance(given, str) and hmac.compare_digest(worker_proof(key, challenge), given)


def _mac(key: bytes, method: str, ts: str, nonce: str) -> str:
    return hmac.new(key, f"{method}\n{ts}\n{nonce}".encode(), hashlib.sha256).hexdigest()
