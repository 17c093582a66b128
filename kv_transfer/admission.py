"""Which connections a sender serves: limits that strangers on the KV port cannot fill.

Two pools, counted apart:

- *pre-auth*: every accepted connection starts here and has ``pre_auth_timeout_s`` to prove it holds
  the cluster key (TLS handshake, ``auth``, ``hello``). At most ``max_pre_auth_connections`` are kept;
  a newcomer to a full pool is always admitted and the oldest connection of the address holding the
  most of the pool is dropped for it. Strangers only ever displace strangers: a real peer proves
  itself in a round trip, so however many idle connections came before it, it gets its turn (and a
  peer cut anyway reconnects, see :mod:`kv_transfer.peer_link`).
- *proven*: a connection whose proof checked out moves here; ``max_connections`` (and
  ``max_connections_per_peer`` from one address) count only these. A proven peer over them is
  refused with ``refuse{busy: true}``, which tells a receiver to try again shortly.

Pure bookkeeping: the sender's threads do the I/O; a dropped connection is only shut down here
(its thread sees the hang-up and cleans up).
"""

from __future__ import annotations

import collections
import dataclasses
import socket
import threading

from .config import KVTransferConfig
from .wire import shutdown_quietly


@dataclasses.dataclass(eq=False)
class Conn:
    """One accepted connection."""

    sock: socket.socket
    """Its socket (the TLS one once wrapped)."""
    peer: str
    """The peer's IP address."""
    dropped: bool = False
    """Evicted from the pre-auth pool for a newer connection (its socket is shut down)."""


class Admission:
    """The pre-auth and proven pools of one sender (thread-safe)."""

    def __init__(self, config: KVTransferConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._pre_auth: dict[Conn, None] = {}  # oldest first
        self._proven: set[Conn] = set()
        self._live: set[Conn] = set()  # both pools + connections being refused or closed
        self.num_refused = 0
        self.num_evicted = 0

    def admit(self, sock: socket.socket, peer: str) -> Conn:
        """Put a new connection in the pre-auth pool, dropping another for it when the pool is full."""
        conn = Conn(sock, peer)
        with self._lock:
            victim = self._victim() if len(self._pre_auth) >= self.config.max_pre_auth_connections else None
            if victim is not None:
                del self._pre_auth[victim]
                victim.dropped = True
                self.num_evicted += 1
                shutdown_quietly(victim.sock)  # under the lock: its thread cannot close the socket meanwhile
            self._pre_auth[conn] = None
            self._live.add(conn)
        return conn

    def replace_sock(self, conn: Conn, sock: socket.socket) -> None:
        """``conn`` now speaks through ``sock`` (its TLS wrapper), which eviction must shut down."""
        with self._lock:
            conn.sock = sock

    def promote(self, conn: Conn) -> str | None:
        """``conn`` proved the key: move it to the proven pool. Returns None, or why it cannot stay."""
        with self._lock:
            if conn not in self._pre_auth:  # evicted meanwhile (its socket is shut)
                return "dropped for a newer connection before it proved the key"
            del self._pre_auth[conn]
            from_peer = sum(1 for c in self._proven if c.peer == conn.peer)
            if len(self._proven) >= self.config.max_connections:
                why = f"too many connections (the sender serves {self.config.max_connections})"
            elif from_peer >= self.config.max_connections_per_peer:
                why = f"too many connections (the sender serves {self.config.max_connections_per_peer} per peer)"
            else:
                self._proven.add(conn)
                return None
            self.num_refused += 1
            return why

    def is_proven(self, conn: Conn) -> bool:
        with self._lock:
            return conn in self._proven

    def remove(self, conn: Conn) -> None:
        """``conn``'s thread is done with it (call before closing its socket)."""
        with self._lock:
            self._pre_auth.pop(conn, None)
            self._proven.discard(conn)
            self._live.discard(conn)

    def live(self) -> list[Conn]:
        """Every connection not yet removed."""
        with self._lock:
            return list(self._live)

    def counts(self) -> tuple[int, int]:
        """(connections open, of which not yet proven)."""
        with self._lock:
            return len(self._live), len(self._pre_auth)

    def _victim(self) -> Conn:
        """The oldest pre-auth connection of the address holding the most of the pool."""
        per_peer = collections.Counter(c.peer for c in self._pre_auth)
        most = max(per_peer.values())
        return next(c for c in self._pre_auth if per_peer[c.peer] == most)
