"""HMAC challenge-response of the control channel and per-transfer capabilities (pure functions).

Both sides hold a key derived from the cluster secret. The handshake authenticates both ends
before anything about the sender (layout, pool size, NIXL agent metadata, addresses) leaves it:

    receiver -> sender   auth{version, nonce_r}                          (<= PRE_AUTH_MAX_BYTES)
    sender   -> receiver challenge{nonce_s, proof_s}   proof_s = HMAC(key, "sender" | nonce_r | nonce_s)
    receiver -> sender   hello{..., proof_r}           proof_r = HMAC(key, "receiver" | nonce_r | nonce_s)
    sender   -> receiver hello_ok{...} | refuse{"authentication failed"}

Fresh nonces on both sides make a recorded exchange useless to replay. Without a key (a
loopback-only cluster started without a secret) the proofs are empty and either side refuses
a peer that does authenticate while it does not, and vice versa.

A capability is a 128-bit random value the sender issues per transfer (``Transfer.capability``);
the receiver must name it in ``read``/``abort``; compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

PRE_AUTH_MAX_BYTES = 4096
"""Largest message either side reads before the peer has proven it holds the key."""
NONCE_BYTES = 16
CAPABILITY_BYTES = 16


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def new_capability() -> str:
    """An unguessable 128-bit transfer capability (hex)."""
    return secrets.token_hex(CAPABILITY_BYTES)


def proof(key: bytes | None, role: str, nonce_r: str, nonce_s: str) -> str:
    """HMAC-SHA256 proof that ``role`` ("sender" or "receiver") holds ``key``; "" without a key."""
    if key is None:
        return ""
    msg = f"pdserve-kv-{role}\n{nonce_r}\n{nonce_s}".encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def proof_ok(key: bytes | None, role: str, nonce_r: str, nonce_s: str, given: object) -> bool:
    """Does ``given`` prove ``role`` holds ``key``? Without a key only an empty proof is accepted
    (both sides must agree on whether the link is authenticated)."""
    if not isinstance(given, str) or not _valid_nonce(nonce_r) or not _valid_nonce(nonce_s):
        return False
    if key is None:
        return given == ""
    return hmac.compare_digest(proof(key, role, nonce_r, nonce_s), given)


def capability_ok(expected: str, given: object) -> bool:
    """Constant-time comparison of a transfer capability."""
    return isinstance(given, str) and bool(expected) and hmac.compare_digest(expected.encode(), given.encode())


def _valid_nonce(nonce: object) -> bool:
    return isinstance(nonce, str) and len(nonce) == 2 * NONCE_BYTES and all(c in "0123456789abcdef" for c in nonce)
