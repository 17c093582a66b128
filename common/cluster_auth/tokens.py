"""Per-call HMAC tokens for internal gRPC (router -> worker), and the worker's proof back, pure functions.

``v2.<unix seconds>.<nonce>.<hex SHA-256 of the request body>.<hex HMAC-SHA256(key, method | audience |
seconds | nonce | body digest)>``. A token is bound to

- its RPC method;
- its **audience**, the worker address the router dialled (``host:port``): a worker accepts only tokens
  addressed to one of its own names, so a relay registered under another address holds tokens that no
  real worker takes;
- the **request body**: the digest it carries is checked against the bytes received, so a captured
  token cannot carry another request;
- a time window (``MAX_SKEW_S`` around the worker's clock), and one use: a worker remembers the nonces
  of the tokens it accepted until they expire (:class:`ReplayGuard`).

Everything but the body digest is checked from the call's metadata alone, before the body is read.
Without the key none can be made.
"""
from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

VERSION = "v2"
MAX_SKEW_S = 60.0
MAX_TOKEN_CHARS = 256
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Claim:
    """What a token that checked says: the worker name it was addressed to and the body it covers."""

    audience: str
    body_digest: str
    nonce: str
    expires: float


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def mint(key: bytes, method: str, audience: str, body: bytes, now: float | None = None) -> str:
    """A token for one call of `method` (e.g. "/pdserve.v1.Worker/Prefill") to the worker dialled as
    `audience`, carrying the serialized request `body`."""
    ts = str(int(time.time() if now is None else now))
    nonce = secrets.token_hex(8)
    digest = body_digest(body)
    return f"{VERSION}.{ts}.{nonce}.{digest}.{_mac(key, method, audience, ts, nonce, digest)}"


def check(key: bytes, method: str, audiences: Iterable[str], token: object, now: float | None = None,
          max_skew_s: float = MAX_SKEW_S) -> Claim | None:
    """The claim of `token` if it is a valid token for `method`, addressed to one of `audiences`, under
    `key`, minted within `max_skew_s` of `now`; else None. The body digest is the caller's to check."""
    if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS:
        return None
    parts = token.split(".")
    if len(parts) != 5 or parts[0] != VERSION or not parts[1].isdigit():
        return None
    _, ts, nonce, digest, mac = parts
    if len(digest) != 64 or not _HEX.issuperset(digest):
        return None
    now = time.time() if now is None else now
    if abs(now - int(ts)) > max_skew_s:
        return None
    for audience in audiences:
        if hmac.compare_digest(_mac(key, method, audience, ts, nonce, digest), mac):
            return Claim(audience, digest, nonce, int(ts) + max_skew_s + 1)
    return None


class ReplayGuard:
    """The nonces of accepted tokens, each until its token expires: a token is good for one call.

    Check the token's MAC first (only valid tokens are remembered, so strangers cannot fill it).
    Bounded by ``max_entries``: past it the oldest nonces are forgotten early (logged), which
    reopens replay for those only; 500k nonces cover ~4k calls/s over the 121 s a token can live."""

    def __init__(self, max_entries: int = 500_000) -> None:
        self.max_entries = max_entries
        self._expiry: dict[str, float] = {}
        self._order: collections.deque[tuple[float, str]] = collections.deque()
        self.num_replays = 0
        self._warned_full = False

    def first_use(self, claim: Claim, now: float | None = None) -> bool:
        """True the first time a (valid) token's claim is seen, False on any later use."""
        now = time.time() if now is None else now
        while self._order and (self._order[0][0] < now or len(self._order) >= self.max_entries):
            expires, nonce = self._order.popleft()
            if expires >= now and not self._warned_full:
                self._warned_full = True
                logger.warning("token replay guard full (%d nonces): forgetting the oldest early", self.max_entries)
            if self._expiry.get(nonce) == expires:
                del self._expiry[nonce]
        if claim.nonce in self._expiry:
            self.num_replays += 1
            return False
        self._expiry[claim.nonce] = claim.expires
        self._order.append((claim.expires, claim.nonce))
        return True

    def __len__(self) -> int:
        return len(self._expiry)


def worker_proof(key: bytes, challenge: str, address: str) -> str:
    """A worker's answer to a router's challenge (sent with GetStats) for the address it was dialled
    as: proves the worker holds the secret *and* answers to that address, so neither a stranger's
    address nor a relay forwarding to a real worker (e.g. registered in Redis) is put in rotation."""
    return hmac.new(key, f"worker-proof\n{challenge}\n{address}".encode(), hashlib.sha256).hexdigest()


def worker_proof_ok(key: bytes, challenge: str, address: str, given: object) -> bool:
    return isinstance(given, str) and hmac.compare_digest(worker_proof(key, challenge, address), given)


def _mac(key: bytes, method: str, audience: str, ts: str, nonce: str, digest: str) -> str:
    return hmac.new(key, f"{method}\n{audience}\n{ts}\n{nonce}\n{digest}".encode(), hashlib.sha256).hexdigest()
