"""Per-lease NIXL registrations: the sender's registry and the receiver's view of a sender's keys.

NIXL (1.x) keeps what it loaded of a peer's metadata until the peer is removed: a descriptor
equal to one already loaded is skipped (its keys are not refreshed) and one that partly overlaps
it breaks lookups. Hence, one descriptor per block on both sides, and:

- the sender registers each block of a lease on its own, sharing a block another live lease
  already registered (reference counted), so ending one lease never revokes another's keys and
  no two registrations overlap;
- the receiver remembers the sender blocks it holds keys for; a lease touching any of them first
  drops the sender's metadata and loads its connection info again (a reconnect), so every READ
  uses the keys its own lease issued, never stale ones.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

from .memory import KVRegion
from .nixl_agent import NixlAgent


class LeaseRegistry:
    """Sender side: blocks registered for live leases, reference counted."""

    def __init__(self, nixl: NixlAgent, region: KVRegion, mem: str) -> None:
        self.nixl = nixl
        self.region = region
        self.mem = mem
        self._refs: Counter[int] = Counter()
        self._lock = threading.Lock()

    def _descs(self, block_ids: list[int]) -> list[tuple[int, int, int, str]]:
        r = self.region
        return [(r.addr + b * r.block_nbytes, r.block_nbytes, r.device_id, "") for b in block_ids]

    def acquire(self, block_ids: list[int]) -> bytes:
        """Register the blocks not yet registered; returns the metadata (keys) of all of them."""
        ids = sorted(set(block_ids))
        with self._lock:
            new = [b for b in ids if not self._refs[b]]
            if new:
                self.nixl._bind()
                with self.nixl.lock:
                    self.nixl.agent.register_memory(self._descs(new), self.mem)
            self._refs.update(ids)
        with self.nixl.lock:
            descs = self.nixl.agent.get_reg_descs(self._descs(ids), self.mem)
            return self.nixl.agent.get_partial_agent_metadata(descs, False, list(self.nixl.agent.backends))

    def release(self, block_ids: list[int]) -> None:
        """End one lease of these blocks: deregister those no other lease holds."""
        ids = sorted(set(block_ids))
        with self._lock:
            self._refs.subtract(ids)
            done = [b for b in ids if self._refs[b] <= 0]
            for b in done:
                del self._refs[b]
            if done and self.nixl.agent is not None:
                with self.nixl.lock:
                    self.nixl.agent.deregister_memory(self.nixl.agent.get_reg_descs(self._descs(done), self.mem))

    def clear(self) -> None:
        """Deregister every block, whatever holds it (the sender closes)."""
        with self._lock:
            ids = sorted(self._refs)
            self._refs.clear()
            if ids and self.nixl.agent is not None:
                with self.nixl.lock:
                    self.nixl.agent.deregister_memory(self.nixl.agent.get_reg_descs(self._descs(ids), self.mem))

    @property
    def num_registered(self) -> int:
        with self._lock:
            return len(self._refs)


class SenderKeys:
    """Receiver side: what it holds of one sender's NIXL metadata."""

    def __init__(self, name: str, connection_md: bytes) -> None:
        self.name = name
        self.connection_md = connection_md
        self.loaded: set[int] = set()
        """Sender blocks whose keys (maybe stale: their lease ended) are loaded."""

    def load(self, nixl: NixlAgent, block_ids: list[int], lease_md: bytes) -> bool:
        """Load a lease's keys, first dropping the sender's metadata if any of its blocks has keys
        (returns whether it did: a reconnect)."""
        reset = bool(self.loaded.intersection(block_ids))
        if reset:
            nixl.remove_remote(self.name)
            if nixl.add_remote(self.connection_md) != self.name:
                raise ConnectionError("the sender's agent changed its name")
            _connect(nixl, self.name)
            self.loaded.clear()
        if nixl.add_remote(lease_md) != self.name:
            raise ConnectionError("the grant carries metadata of another NIXL agent")
        self.loaded.update(block_ids)
        return reset


def _connect(nixl: NixlAgent, name: str) -> Any:
    with nixl.lock:
        return nixl.agent.make_connection(name)
