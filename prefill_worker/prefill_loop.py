"""Prefill role on the engine thread: first tokens and KV leases.

A prompt runs (batched, chunked) to its first token. Unless that token ended
the request, its blocks stay allocated and are exposed to decode workers
through `sender.expect`: the lease. The lease ends DONE when a decode worker
has pulled the blocks, FAILED when it expires or is aborted; either way the
blocks are released here, on the engine thread, at the next poll.

Peer prefix pulls (router/README.md, "Peer prefix pulls"): `lease_prefix` leases the leading cached
blocks of a prefix to another prefill worker the same way (a lease with no request behind it),
and a prompt that arrives with another worker's lease pulls those blocks first (worker_runtime/prefix_pulls.py). The
leases themselves: worker_runtime/kv_leases.py.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import grpc

from engine.llm_engine import LLMEngine
from engine.outputs import SampleDelta
from engine.sampling_params import InvalidParameter, SamplingParams
from kv_transfer import KVReceiver, KVSender
from worker_runtime.engine_loop import EngineLoop
from worker_runtime.errors import WorkerError
from worker_runtime.kv_handle import KVSource
from worker_runtime.kv_leases import KVLeases
from worker_runtime.prefix_pulls import PrefixPulls


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
        self.leases = KVLeases(engine, sender)
        self._waiting: dict[str, tuple[asyncio.Future, float]] = {}

    # ---- asyncio side ------------------------------------------------------
    def prefill(self, request_id: str, prompt: list[int], params: SamplingParams, lease_s: float,
                cache_salt: str = "", prefix: KVSource | None = None, prefix_tokens: int = 0) -> asyncio.Future:
        """Queue a prompt; the future resolves to a PrefillResult at its first token. (`cache_salt`:
        LLMEngine.add_request.) With `prefix`, another worker's lease on the prompt's first `prefix_tokens`
        tokens: they are pulled first (worker_runtime/prefix_pulls.py)."""
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
            if request_id in self._waiting:  # its prefix still being pulled, say: the engine cannot tell
                raise InvalidParameter("request_id", f"{request_id!r} is already running")
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
            return self.leases.release(request_id, "aborted by the router") or found
        return self.call(run)

    # ---- engine thread -----------------------------------------------------
    def on_delta(self, delta: SampleDelta) -> None:
        waiting = self._waiting.pop(delta.request_id, None)
        if waiting is None:
            return
        future, lease_s = waiting
        result = PrefillResult(delta)
        if delta.kv_block_ids is not None:
            transfer = self.leases.hold(delta.request_id, delta.kv_block_ids, lease_s)
            result = PrefillResult(delta, self.leases.peer_info, delta.request_id, delta.kv_block_ids,
                                   transfer.capability)
        self._resolve(future, result=result)

    def has_transfers(self) -> bool:
        return bool(self.leases) or bool(self.pulls)

    def poll(self) -> None:
        if self.pulls is not None:
            self.pulls.poll()
        self.leases.poll()

    def num_requests(self) -> int:
        return super().num_requests() + len(self.leases) + len(self.pulls or ())

    def extra_stats(self) -> dict[str, Any]:
        sent = self.sender.stats()
        moved = sent.get("bytes_moved", 0)
        stats = {**self.leases.stats(), "transfers_failed": self.leases.failed}
        if "stage_bytes_moved" in sent:  # pipeline stages on other nodes, each its own link
            stats["kv_stage_bytes"] = sent["stage_bytes_moved"]
        if self.pulls is not None:
            moved += self.pulls.receiver.stats().get("bytes_moved", 0)
            stats.update(self.pulls.stats.as_stats(), num_pulls=len(self.pulls))
        return {**stats, "kv_bytes_moved": int(moved)}
