"""Prefill role on the engine thread: first tokens and KV leases.

A prompt runs (batched, chunked) to its first token. Unless that token ended
the request, its blocks stay allocated and are exposed to decode workers
through `sender.expect`: the lease. The lease ends DONE when a decode worker
has pulled the blocks, FAILED when it expires or is aborted; either way the
blocks are released here, on the engine thread, at the next poll.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from engine.llm_engine import LLMEngine
from engine.outputs import SampleDelta
from engine.sampling_params import SamplingParams
from kv_transfer import KVSender, Transfer, TransferState
from worker_runtime.engine_loop import EngineLoop


@dataclass
class PrefillResult:
    first: SampleDelta
    """The first token (finished=True when it already ended the request)."""
    peer_info: dict | None = None
    """The KV sender's `peer_info()` (the handle's `peer`)."""
    transfer_id: str = ""
    block_ids: list[int] | None = None
    capability: str = ""
    """The sender's secret for this transfer (goes into the KV handle)."""


class PrefillLoop(EngineLoop):
    def __init__(self, engine: LLMEngine, aio_loop: asyncio.AbstractEventLoop, sender: KVSender) -> None:
        super().__init__(engine, aio_loop)
        self.sender = sender
        self._peer_info = sender.peer_info()
        self._waiting: dict[str, tuple[asyncio.Future, float]] = {}
        self._leases: dict[str, Transfer] = {}
        """Request id -> the sender's transfer holding its blocks (its deadline is the lease's)."""
        self.leases_expired = 0
        self.transfers_failed = 0

    # ---- asyncio side ------------------------------------------------------
    def prefill(self, request_id: str, prompt: list[int], params: SamplingParams, lease_s: float,
                cache_salt: str = "") -> asyncio.Future:
        """Queue a prompt; the future resolves to a PrefillResult at its first token. (`cache_salt`:
        LLMEngine.add_request.)"""
        result = self.aio.create_future()

        def add() -> None:
            self.engine.add_request(request_id, prompt, params, prefill_only=True, cache_salt=cache_salt)
            self.count_request(len(prompt))
            self._waiting[request_id] = (result, lease_s)

        added = self.call(add)
        added.add_done_callback(lambda f: f.exception() is not None and not result.done()
                                and result.set_exception(f.exception()))
        return result

    def abort(self, request_id: str) -> asyncio.Future:
        """End the request wherever it is (queued, running or leased); True if found."""
        def run() -> bool:
            found = self.engine.abort_request(request_id)
            lease = self._leases.pop(request_id, None)
            if lease is not None:
                lease.abort("aborted by the router")
                self.engine.release_kv(request_id)
                found = True
            return found
        return self.call(run)

    # ---- engine thread -----------------------------------------------------
    def on_delta(self, delta: SampleDelta) -> None:
        waiting = self._waiting.pop(delta.request_id, None)
        if waiting is None:
            return
        future, lease_s = waiting
        result = PrefillResult(delta)
        if delta.kv_block_ids is not None:
            transfer_id = delta.request_id
            transfer = self.sender.expect(transfer_id, delta.kv_block_ids, timeout_s=lease_s)
            self._leases[delta.request_id] = transfer
            result = PrefillResult(delta, self._peer_info, transfer_id, delta.kv_block_ids,
                                   transfer.capability)
        self._resolve(future, result=result)

    def has_transfers(self) -> bool:
        return bool(self._leases)

    def poll(self) -> None:
        for request_id, lease in list(self._leases.items()):
            state = lease.poll()
            if not state.is_terminal:
                continue
            del self._leases[request_id]
            self.engine.release_kv(request_id)
            if state == TransferState.FAILED:
                self.transfers_failed += 1
                if time.monotonic() >= lease.deadline:
                    self.leases_expired += 1

    def num_requests(self) -> int:
        return super().num_requests() + len(self._leases)

    def extra_stats(self) -> dict[str, int]:
        return {"num_leases": len(self._leases), "leases_expired": self.leases_expired,
                "transfers_failed": self.transfers_failed,
                "kv_bytes_moved": int(self.sender.stats().get("bytes_moved", 0))}
