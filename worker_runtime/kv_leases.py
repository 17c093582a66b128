"""Blocks a worker holds for another worker to pull: its KV leases (engine thread only).

A lease is the KV sender's `expect` on a set of blocks the engine keeps referenced: a prefill worker's
prompt waiting for its decode worker (`hold`), or the leading cached blocks of a prefix any worker holds
for a peer's pull (`lease_prefix`, router/README.md "Peer prefix pulls"). It ends DONE when the reader
has pulled the blocks, FAILED when it expires or is aborted; either way `poll` releases the blocks.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from engine.llm_engine import LLMEngine
from engine.sampling_params import InvalidParameter
from kv_transfer import KVSender, Transfer, TransferState


def lease_seconds(requested: float, cap: float) -> float:
    """A caller's lease length, checked: 0 is the worker's default `cap`, which also bounds it."""
    if not math.isfinite(requested) or requested < 0:
        raise InvalidParameter("lease_s", "must be a finite number >= 0")
    return min(requested or cap, cap)


@dataclass
class PrefixLease:
    """Leading blocks of a cached prefix held for a peer's pull (the handle of a LeasePrefix answer)."""

    peer_info: dict
    transfer_id: str
    block_ids: list[int]
    capability: str


class KVLeases:
    def __init__(self, engine: LLMEngine, sender: KVSender) -> None:
        self.engine = engine
        self.sender = sender
        self.peer_info = sender.peer_info()
        self._leases: dict[str, Transfer] = {}
        """Lease id (a request id) -> the sender's transfer holding its blocks (its deadline is the lease's)."""
        self.expired = 0
        self.failed = 0

    def __len__(self) -> int:
        return len(self._leases)

    def hold(self, lease_id: str, block_ids: list[int], lease_s: float) -> Transfer:
        """Expose blocks the engine keeps for `lease_id` (until `release_kv(lease_id)`) to one reader."""
        transfer = self.sender.expect(lease_id, block_ids, timeout_s=lease_s)
        self._leases[lease_id] = transfer
        return transfer

    def lease_prefix(self, lease_id: str, token_ids: list[int], cache_salt: str, lease_s: float) -> PrefixLease | None:
        """Hold the leading blocks of `token_ids` cached on the device under `cache_salt`; None when none is."""
        block_ids = self.engine.lease_cached_prefix(lease_id, token_ids, cache_salt)
        if not block_ids:
            return None
        transfer = self.hold(lease_id, block_ids, lease_s)
        return PrefixLease(self.peer_info, lease_id, block_ids, transfer.capability)

    def release(self, lease_id: str, why: str) -> bool:
        """End the lease now (aborted by the router); True if there was one."""
        transfer = self._leases.pop(lease_id, None)
        if transfer is None:
            return False
        transfer.abort(why)
        self.engine.release_kv(lease_id)
        return True

    def poll(self) -> None:
        """Release the blocks of the leases that ended."""
        for lease_id, transfer in list(self._leases.items()):
            state = transfer.poll()
            if not state.is_terminal:
                continue
            del self._leases[lease_id]
            self.engine.release_kv(lease_id)
            if state == TransferState.FAILED:
                self.failed += 1
                if time.monotonic() >= transfer.deadline:
                    self.expired += 1

    def stats(self) -> dict[str, int]:
        return {"num_leases": len(self._leases), "leases_expired": self.expired}
