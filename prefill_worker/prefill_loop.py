"""Prefill role on the engine thread: first tokens and KV leases.

A prompt runs (batched, chunked) to its first token. Unless that token ended
the request, its blocks stay allocated and are exposed to decode workers
through `sender.expect`: the lease. The lease ends DONE when a decode worker
has pulled the blocks, FAILED when it expires or is aborted; either way the
blocks are released here, on the engine thread, at the next poll.

Peer prefix pulls (router/README.md, "Peer prefix pulls"): `lease_prefix` leases the leading cached
blocks of a prefix to another prefill worker the same way (a `prefix_lease` with no request behind it),
and a prompt that arrives with another worker's lease pulls those blocks first (prefix_pull.py).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc

from engine.llm_engine import LLMEngine
from engine.outputs import SampleDelta
from engine.sampling_params import SamplingParams
from kv_transfer import KVReceiver, KVSender, Transfer, TransferState
from prefill_worker.prefix_pull import PrefixPulls
from worker_runtime.engine_loop import EngineLoop
from worker_runtime.errors import WorkerError
from worker_runtime.kv_handle import KVSource


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


@dataclass
class PrefixLease:
    """Leading blocks of a cached prefix held for a peer's pull (the handle of a LeasePrefix answer)."""

    peer_info: dict
    transfer_id: str
    block_ids: list[int]
    capability: str


class PullAborted(WorkerError):
    """The request was aborted while its prefix was being pulled."""

    code = grpc.StatusCode.CANCELLED


class PrefillLoop(EngineLoop):
    def __init__(self, engine: LLMEngine, aio_loop: asyncio.AbstractEventLoop, sender: KVSender,
                 receiver: KVReceiver | None = None, pull_timeout_s: float = 5.0) -> None:
        """`receiver` (pulls of cached prefixes from peers; None: such requests compute their prefix)."""
        super().__init__(engine, aio_loop)
        self.sender = sender
        self.pulls = PrefixPulls(engine, receiver, pull_timeout_s) if receiver is not None else None
        self._peer_info = sender.peer_info()
        self._waiting: dict[str, tuple[asyncio.Future, float]] = {}
        self._leases: dict[str, Transfer] = {}
        """Request id -> the sender's transfer holding its blocks (its deadline is the lease's)."""
        self.leases_expired = 0
        self.transfers_failed = 0

    # ---- asyncio side ------------------------------------------------------
    def prefill(self, request_id: str, prompt: list[int], params: SamplingParams, lease_s: float,
                cache_salt: str = "", prefix: KVSource | None = None, prefix_tokens: int = 0) -> asyncio.Future:
        """Queue a prompt; the future resolves to a PrefillResult at its first token. (`cache_salt`:
        LLMEngine.add_request.) With `prefix`, another worker's lease on the prompt's first `prefix_tokens`
        tokens: they are pulled first (prefix_pull.py)."""
        result = self.aio.create_future()

        def enter() -> None:
            try:
                self.engine.add_request(request_id, prompt, params, prefill_only=True, cache_salt=cache_salt)
            except Exception as exc:  # noqa: BLE001 - after a pull the caller is no longer waiting on `add`
                self._waiting.pop(request_id, None)
                self._resolve(result, exc=exc)
                return
            self.count_request(len(prompt))

        def add() -> None:
            if prefix is None or self.pulls is None:
                self.engine.add_request(request_id, prompt, params, prefill_only=True, cache_salt=cache_salt)
                self.count_request(len(prompt))
                self._waiting[request_id] = (result, lease_s)
                return
            self.engine.validate_prompt(prompt)
            self.engine.validate_params(params)
            self._waiting[request_id] = (result, lease_s)
            self.pulls.start(request_id, prompt[:prefix_tokens], cache_salt, prefix, enter)

        added = self.call(add)
        added.add_done_callback(lambda f: f.exception() is not None and not result.done()
                                and result.set_exception(f.exception()))
        return result

    def abort(self, request_id: str) -> asyncio.Future:
        """End the request wherever it is (queued, running or leased); True if found."""
        def run() -> bool:
            found = self.engine.abort_request(request_id)
            if self.pulls is not None and self.pulls.abort(request_id):
                waiting = self._waiting.pop(request_id, None)
                if waiting is not None:
                    self._resolve(waiting[0], exc=PullAborted("aborted while pulling its prefix"))
                found = True
            lease = self._leases.pop(request_id, None)
            if lease is not None:
                lease.abort("aborted by the router")
                self.engine.release_kv(request_id)
                found = True
            return found
        return self.call(run)

    def lease_prefix(self, lease_id: str, token_ids: list[int], cache_salt: str, lease_s: float) -> asyncio.Future:
        """Hold the leading cached blocks of `token_ids` for a peer's pull; the future resolves to a
        PrefixLease, or None when none is cached here. The lease ends like a decode worker's (pulled,
        expired, or aborted by `lease_id`)."""
        def run() -> PrefixLease | None:
            block_ids = self.engine.lease_cached_prefix(lease_id, token_ids, cache_salt)
            if not block_ids:
                return None
            transfer = self.sender.expect(lease_id, block_ids, timeout_s=lease_s)
            self._leases[lease_id] = transfer
            return PrefixLease(self._peer_info, lease_id, block_ids, transfer.capability)
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
        return bool(self._leases) or bool(self.pulls)

    def poll(self) -> None:
        if self.pulls is not None:
            self.pulls.poll()
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
        return super().num_requests() + len(self._leases) + len(self.pulls or ())

    def extra_stats(self) -> dict[str, int]:
        moved = self.sender.stats().get("bytes_moved", 0)
        stats = {"num_leases": len(self._leases), "leases_expired": self.leases_expired,
                 "transfers_failed": self.transfers_failed}
        if self.pulls is not None:
            moved += self.pulls.receiver.stats().get("bytes_moved", 0)
            stats.update(self.pulls.stats.as_stats(), num_pulls=len(self.pulls))
        return {**stats, "kv_bytes_moved": int(moved)}
