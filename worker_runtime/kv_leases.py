"""Blocks a worker holds for another worker to pull: its KV leases (engine thread only).

A lease is the KV sender's `expect` on a set of blocks the engine keeps referenced: a prefill worker's
prompt waiting for its decode worker (`hold`), or the leading cached blocks of a prefix any worker holds
for a peer's pull (`lease_prefix`, router/README.md "Peer prefix pulls"; blocks of it in a lower KV tier are
loaded back first, and the lease is answered once they are). It ends DONE when the reader
has pulled the blocks, FAILED when it expires or is aborted; either way `poll` releases the blocks.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
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


@dataclass
class _LoadingLease:
    token_ids: list[int]
    cache_salt: str
    lease_s: float
    answer: Callable[[PrefixLease | None], None]


class KVLeases:
    def __init__(self, engine: LLMEngine, sender: KVSender) -> None:
        self.engine = engine
        self.sender = sender
        self.peer_info = sender.peer_info()
        self._leases: dict[str, Transfer] = {}
        """Lease id (a request id) -> the sender's transfer holding its blocks (its deadline is the lease's)."""
        self._loading: dict[str, _LoadingLease] = {}
        """Leases whose blocks a lower KV tier is loading back, answered when it ends."""
        self.expired = 0
        self.failed = 0

    def __len__(self) -> int:
        return len(self._leases) + len(self._loading)

    def hold(self, lease_id: str, block_ids: list[int], lease_s: float) -> Transfer:
        """Expose blocks the engine keeps for `lease_id` (until `release_kv(lease_id)`) to one reader."""
        transfer = self.sender.expect(lease_id, block_ids, timeout_s=lease_s)
        self._leases[lease_id] = transfer
        return transfer

    def lease_prefix(self, lease_id: str, token_ids: list[int], cache_salt: str, lease_s: float,
                     answer: Callable[[PrefixLease | None], None]) -> None:
        """Hold the leading blocks of `token_ids` cached here under `cache_salt` (on the device, or in a lower
        tier: loaded back first) and `answer` with them, at once or when the load ends; None when none is."""
        block_ids, loading = self.engine.lease_cached_prefix(lease_id, token_ids, cache_salt)
        if loading:
            self._loading[lease_id] = _LoadingLease(token_ids, cache_salt, lease_s, answer)
        else:
            answer(self._expose(lease_id, block_ids, lease_s) if block_ids else None)

    def _expose(self, lease_id: str, block_ids: list[int], lease_s: float) -> PrefixLease:
        transfer = self.hold(lease_id, block_ids, lease_s)
        return PrefixLease(self.peer_info, lease_id, block_ids, transfer.capability)

    def release(self, lease_id: str, why: str) -> bool:
        """End the lease now (aborted by the router); True if there was one."""
        loading = self._loading.pop(lease_id, None)
        if loading is not None:
            self.engine.release_kv(lease_id)
            loading.answer(None)
            return True
        transfer = self._leases.pop(lease_id, None)
        if transfer is None:
            return False
        transfer.abort(why)
        self.engine.release_kv(lease_id)
        return True

    def poll(self) -> None:
        """Answer the leases whose blocks finished loading; release the blocks of the leases that ended."""
        for lease_id, loading in list(self._loading.items()):
            block_ids = self.engine.leased_prefix_loaded(lease_id, loading.token_ids, loading.cache_salt)
            if block_ids is None:
                continue
            del self._loading[lease_id]
            if block_ids:
                loading.answer(self._expose(lease_id, block_ids, loading.lease_s))
            else:
                self.engine.release_kv(lease_id)
                loading.answer(None)
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
