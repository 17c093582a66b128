"""The engine thread: the only thread that touches the engine.

The gRPC server runs on an asyncio loop; the engine is synchronous torch code.
Handlers hand work to this thread as closures (`call`), which run between
engine steps; results and per-step deltas hop back onto the asyncio loop with
`call_soon_threadsafe`. Role subclasses add their transfer bookkeeping by
overriding `poll` (called every iteration) and `on_delta`.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from engine.llm_engine import LLMEngine
from engine.outputs import SampleDelta
from worker_runtime.errors import EngineBroken
from worker_runtime.moe_metrics import MoeRoutingReader

if TYPE_CHECKING:
    from worker_runtime.kv_leases import KVLeases

logger = logging.getLogger(__name__)
BROKEN_CHECK_S = 1.0
"""How often an idle loop looks for a lost rank or pipeline stage (`LLMEngine.broken`)."""

Sink = Callable[[Any], None]
"""Receives a request's SampleDeltas, or an exception that ends it (called on the asyncio loop)."""


class EngineLoop(threading.Thread):
    idle_wait_s = 0.5
    """Longest sleep while nothing runs (commands wake the thread at once)."""
    transfer_poll_s = 0.001
    """Sleep between transfer polls while only transfers are in flight."""

    def __init__(self, engine: LLMEngine, aio_loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(name="engine-loop", daemon=True)
        self.engine = engine
        self.aio = aio_loop
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._held: list[tuple[Sink, Any]] | None = None
        """During a step: what it emitted, sent once the step's stats are published."""
        self._stopping = threading.Event()
        self.requests_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.observe_transfer_s: Callable[[float], None] = lambda seconds: None
        self.on_broken: Callable[[str], None] = lambda reason: None
        """Called (on the engine thread, which then ends) when the engine can never step again."""
        """Called with the duration of every finished KV transfer (metrics hook; engine thread)."""
        self.stats: dict[str, Any] = {}
        """Snapshot refreshed after every iteration; safe to read from any thread."""
        self.kv_events = None
        """A KvEventLog, flushed after every iteration, when routers index this worker."""
        self.moe_routing = MoeRoutingReader(engine.runner.model)
        """Per-expert token counts of an MoE model, copied into the stats every few seconds (moe_metrics.py)."""
        self.leases: KVLeases | None = None
        """Blocks held for other workers to pull (a role with a KV sender sets it; worker_runtime/kv_leases.py)."""

    # ---- called from the asyncio side -----------------------------------
    def call(self, fn: Callable[[], Any]) -> asyncio.Future:
        """Run `fn()` on the engine thread; the future gets its result or exception."""
        future = self.aio.create_future()

        def run() -> None:
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                self._resolve(future, exc=exc)
            else:
                self._resolve(future, result=result)

        self._commands.put(run)
        return future

    def lease_prefix(self, lease_id: str, token_ids: list[int], cache_salt: str, lease_s: float) -> asyncio.Future:
        """Hold the leading cached blocks of `token_ids` for a peer's pull; the future resolves to a PrefixLease,
        or None when none is cached here (or this worker has no KV sender)."""
        answered = self.aio.create_future()

        def run() -> None:
            if self.leases is None:
                return self._resolve(answered, result=None)
            self.leases.lease_prefix(lease_id, token_ids, cache_salt, lease_s,
                                     lambda lease: self._resolve(answered, result=lease))
        started = self.call(run)
        started.add_done_callback(lambda f: f.exception() is not None and not answered.done()
                                  and answered.set_exception(f.exception()))
        return answered

    def stop(self) -> None:
        self._stopping.set()
        self._commands.put(None)

    # ---- engine thread --------------------------------------------------
    def run(self) -> None:
        checked = time.monotonic()
        while not self._stopping.is_set():
            try:
                self._run_commands()
                if not self.engine.has_unfinished() and time.monotonic() - checked > BROKEN_CHECK_S:
                    checked = time.monotonic()
                    if reason := self.engine.broken():  # idle, yet a rank or stage is gone: leave now
                        self.on_broken(reason)
                        return
                self.poll()
                if self.engine.has_unfinished():
                    # What the step emits reaches callers only once its stats are published (below): a
                    # router told a request ended never finds this worker still counting it, at its limit.
                    self._held = []
                    for delta in self.engine.step():
                        self.generation_tokens_total += len(delta.token_ids)
                        self.on_delta(delta)
                self._snapshot()
                self._release_held()
                if self.kv_events is not None:
                    self.kv_events.flush()
            except Exception:  # keep serving: one bad step must not kill the worker silently
                logger.exception("engine loop iteration failed")
                self._release_held()
                reason = self.engine.broken()
                self._fail_all(EngineBroken(f"the worker's engine is broken: {reason}") if reason
                               else RuntimeError("engine step failed; see the worker log"))
                if reason:  # a rank or stage is gone for good: this worker must be replaced
                    self.on_broken(reason)
                    return

    def _run_commands(self) -> None:
        block = not self.engine.has_unfinished()
        timeout = self.transfer_poll_s if self.has_transfers() else self.idle_wait_s
        while True:
            try:
                command = self._commands.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return
            if command is None:
                return
            command()
            block = False

    def has_transfers(self) -> bool:
        return False

    def poll(self) -> None:
        """Role hook: advance transfers."""

    def on_delta(self, delta: SampleDelta) -> None:
        self.emit(delta.request_id, delta, last=delta.finished)

    def emit(self, request_id: str, item: Any, last: bool) -> None:
        sink = self._sinks.pop(request_id, None) if last else self._sinks.get(request_id)
        if sink is None:
            return
        if self._held is not None:
            self._held.append((sink, item))
        else:
            self.aio.call_soon_threadsafe(sink, item)

    def _release_held(self) -> None:
        held, self._held = self._held, None
        for sink, item in held or ():
            self.aio.call_soon_threadsafe(sink, item)

    def add_sink(self, request_id: str, sink: Sink) -> None:
        self._sinks[request_id] = sink

    def count_request(self, num_prompt_tokens: int) -> None:
        self.requests_total += 1
        self.prompt_tokens_total += num_prompt_tokens

    def num_requests(self) -> int:
        """Requests this worker holds anything for (engine queue, running batch, transfers)."""
        return len(self.engine.scheduler.requests)

    def extra_stats(self) -> dict[str, int]:
        return {}

    def _snapshot(self) -> None:
        scheduler = self.engine.scheduler
        stats = {"kv_blocks_total": self.engine.num_kv_blocks_total,
                 "kv_blocks_used": self.engine.num_kv_blocks_used,
                 "num_requests": self.num_requests(),
                 "num_running": scheduler.num_running, "num_waiting": scheduler.num_waiting,
                 "num_waiting_tokens": sum(r.num_tokens - r.num_computed_tokens for r in scheduler.waiting),
                 "num_preemptions": scheduler.num_preemptions, "requests_total": self.requests_total,
                 "prompt_tokens_total": self.prompt_tokens_total,
                 "generation_tokens_total": self.generation_tokens_total,
                 "prefix_cache_queries": self.engine.kv.num_prefix_queries,
                 "prefix_cache_hits": self.engine.kv.num_prefix_hits,
                 "spec_decode_num_draft_tokens": self.engine.num_spec_draft_tokens,
                 "spec_decode_num_accepted_tokens": self.engine.num_spec_accepted_tokens,
                 "kv_tiers": self.engine.kv_tier_stats(), "moe": self.moe_routing.read()}
        stats.update(self.extra_stats())
        self.stats = stats

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self._sinks):
            self.engine.abort_request(request_id)
            self.emit(request_id, exc, last=True)

    def _resolve(self, future: asyncio.Future, result: Any = None, exc: BaseException | None = None) -> None:
        def settle() -> None:
            if future.done():
                return
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(result)
        self.aio.call_soon_threadsafe(settle)
