"""Peer prefix pulls on a worker's engine thread: fetch a cached prefix from another worker, then compute the rest.

A Prefill call, or a Decode call the decode worker prefills itself, may carry `prefix_kv`: another worker
holds the prompt's leading blocks (its `LeasePrefix` answer, relayed by the router). Before the prompt
enters the engine, this worker reserves
blocks for that prefix (reusing any it has cached itself), pulls the rest over kv_transfer — the same
receiver, capability and layout checks as a decode worker's pull — and enters them into its prefix cache
as if it had computed them; the prompt then prefills only what follows. Every other outcome (no free
blocks, the pull refused or failed, the holder gone or its lease expired, `timeout_s` passed) drops the
reservation and prefills the whole prompt: a fallback, never an error. The holder is released either way
(the pull ends its lease, or an empty read, or its expiry).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.llm_engine import LLMEngine
from kv_transfer import KVReceiver, KVTransferError, Transfer, TransferState
from worker_runtime.kv_handle import KVSource

logger = logging.getLogger(__name__)


@dataclass
class PeerPullStats:
    """Cumulative figures of one worker's peer pulls (its WorkerStats `peer_pull_*`)."""

    pulls: int = 0
    """Pulls that completed."""
    fallbacks: int = 0
    """Prefixes asked for that were recomputed instead (no room, refused, failed, timed out)."""
    bytes: int = 0
    seconds: float = 0.0
    """Bytes moved by the completed pulls, and their time from start to last byte."""
    tokens: int = 0
    """Prefix tokens those pulls brought (not computed here)."""

    def as_stats(self) -> dict[str, float]:
        return {"peer_pulls": self.pulls, "peer_pull_fallbacks": self.fallbacks, "peer_pull_bytes": self.bytes,
                "peer_pull_seconds": self.seconds, "peer_pull_tokens": self.tokens}


@dataclass
class _Pull:
    request_id: str
    prefix: list[int]
    cache_salt: str
    source: KVSource
    then: Callable[[], None]
    """Enters the prompt into the engine (after the pull, or instead of it)."""
    transfer: Transfer | None = None
    started: float = field(default_factory=time.monotonic)
    tokens: int = 0


class PrefixPulls:
    """The peer pulls in flight on one worker (engine thread only)."""

    def __init__(self, engine: LLMEngine, receiver: KVReceiver, timeout_s: float) -> None:
        self.engine = engine
        self.receiver = receiver
        self.timeout_s = timeout_s
        self.stats = PeerPullStats()
        self._pulls: dict[str, _Pull] = {}

    def __len__(self) -> int:
        return len(self._pulls)

    def start(self, request_id: str, prefix: list[int], cache_salt: str, source: KVSource,
              then: Callable[[], None]) -> None:
        """Pull `prefix`'s blocks from `source`, then call `then`; `then` runs at once when no pull starts."""
        pull = _Pull(request_id, prefix, cache_salt, source, then)
        try:
            table, num_local = self.engine.reserve_prefix(request_id, prefix, cache_salt)
        except MemoryError:
            self._release_remote(source)
            return self._fall_back(pull, "no free KV blocks to pull into", reserved=False)
        if num_local == len(table):  # cached here meanwhile: nothing to move
            self._release_remote(source)
            self.engine.finish_prefix(request_id, pulled=True)
            return then()
        try:
            if len(source.block_ids) < len(table):
                raise ValueError(f"prefix_kv has {len(source.block_ids)} blocks, the prefix needs {len(table)}")
            pull.transfer = self.receiver.read(source.peer_info, source.transfer_id,
                                               source.block_ids[num_local:len(table)], table[num_local:],
                                               timeout_s=self.timeout_s, capability=source.capability)
        except (KVTransferError, OSError, ValueError) as exc:
            return self._fall_back(pull, f"the pull could not start ({exc})")
        pull.tokens = (len(table) - num_local) * self.engine.kv.block_size
        self._pulls[request_id] = pull

    def poll(self) -> None:
        """Finish the pulls that ended: their prompts enter the engine."""
        for request_id, pull in list(self._pulls.items()):
            state = pull.transfer.poll()
            if not state.is_terminal:
                continue
            del self._pulls[request_id]
            if state != TransferState.DONE:
                self._fall_back(pull, f"the pull failed ({pull.transfer.error})")
                continue
            self.stats.pulls += 1
            self.stats.bytes += pull.transfer.bytes_moved
            self.stats.seconds += pull.transfer.elapsed_s or (time.monotonic() - pull.started)
            self.stats.tokens += pull.tokens
            self.engine.finish_prefix(request_id, pulled=True)
            pull.then()

    def abort(self, request_id: str) -> bool:
        """Drop the pull of `request_id` (its prompt never enters); True if there was one."""
        pull = self._pulls.pop(request_id, None)
        if pull is None:
            return False
        pull.transfer.abort("aborted by the router")
        self.engine.finish_prefix(request_id, pulled=False)
        return True

    def _fall_back(self, pull: _Pull, why: str, reserved: bool = True) -> None:
        logger.info("%s: peer prefix pull from %s: %s; computing the prefix here", pull.request_id,
                    pull.source.peer_info.get("host"), why)
        self.stats.fallbacks += 1
        if reserved:
            self.engine.finish_prefix(pull.request_id, pulled=False)
        pull.then()

    def _release_remote(self, source: KVSource) -> None:
        """Tell the holder to drop its lease now rather than at expiry (an empty read)."""
        try:
            self.receiver.read(source.peer_info, source.transfer_id, [], [], timeout_s=5.0,
                               capability=source.capability)
        except (KVTransferError, OSError, ValueError):
            pass  # the lease expires on its own
