"""Decode role on the engine thread: KV pulls, then continuous batching.

A request arriving with a KV handle reserves blocks (reusing this engine's own
prefix-cached blocks), pulls only the blocks it lacks from the prefill worker,
and joins the running batch with its first token once the pull is DONE. When
blocks are short the request waits (in arrival order) until running requests
free some, up to `pull_timeout_s`. If the pull fails (prefill worker gone,
lease expired) or blocks stayed short, the request is not failed: it enters
the engine like a preempted one and its prompt is recomputed here (the prefill
worker is told to drop its copy). A request without a handle is prefilled here
(co-located mode).

A pull takes a few milliseconds while an engine step can take a hundred, so
after starting pulls the loop waits for them (up to `join_wait_s`) before
stepping: the request then decodes in this step instead of two steps later.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass

from engine.llm_engine import LLMEngine
from engine.sampling_params import InvalidParameter, SamplingParams
from kv_transfer import KVReceiver, KVSender, KVTransferError, Transfer, TransferState
from worker_runtime.engine_loop import EngineLoop, Sink
from worker_runtime.kv_handle import KVSource
from worker_runtime.kv_leases import KVLeases
from worker_runtime.prefix_pulls import PrefixPulls

logger = logging.getLogger(__name__)



LINK_SAMPLE_BYTES = 4 << 20
"""Pulls at least this large count in the link counters routers estimate bandwidth from (kv_pull_bytes,
kv_pull_seconds): in smaller ones the fixed per-pull cost (handshake, grant, thread wake-ups) outweighs
the wire time and would read as a slow link."""


@dataclass
class _Job:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    source: KVSource
    sink: Sink
    give_up_at: float
    cache_salt: str = ""
    transfer: Transfer | None = None
    pull_started: float = 0.0


class DecodeLoop(EngineLoop):
    join_wait_s = 0.02
    """How long a step may wait for pulls started just before it."""

    def __init__(self, engine: LLMEngine, aio_loop: asyncio.AbstractEventLoop, receiver: KVReceiver,
                 pull_timeout_s: float, sender: KVSender | None = None, peer_pull_timeout_s: float = 2.0) -> None:
        """`sender`: leases of this worker's cached prefixes to workers that pull them (None: none)."""
        super().__init__(engine, aio_loop)
        self.receiver = receiver
        self.leases = KVLeases(engine, sender) if sender is not None else None
        self.pulls = PrefixPulls(engine, receiver, peer_pull_timeout_s)
        """Peers' cached prefixes pulled before a prompt prefilled here (worker_runtime/prefix_pulls.py)."""
        self.pull_timeout_s = pull_timeout_s
        self._queued: deque[_Job] = deque()
        self._pulling: dict[str, _Job] = {}
        self.transfers_failed = 0
        self.num_recomputed = 0
        self.pull_bytes = 0
        self.pull_seconds = 0.0
        """Bytes and seconds of the completed pulls of LINK_SAMPLE_BYTES or more (routers' link estimate)."""

    # ---- asyncio side ------------------------------------------------------
    def decode(self, request_id: str, prompt: list[int], params: SamplingParams, source: KVSource | None,
               sink: Sink, cache_salt: str = "", resume_token_ids: list[int] | None = None,
               prefix: KVSource | None = None, prefix_tokens: int = 0) -> asyncio.Future:
        """Start a request; its deltas (or a terminal exception) go to `sink`. (`cache_salt`,
        `resume_token_ids` (a migrated request, recomputed here; never with `source`): LLMEngine.add_request.)
        With `prefix` (no `source`: the prompt is computed here), another worker's lease on the prompt's first
        `prefix_tokens` tokens: they are pulled first (worker_runtime/prefix_pulls.py).

        The returned future fails at once for a request the engine refuses."""
        def enter() -> None:
            try:
                self.engine.add_request(request_id, prompt, params, cache_salt=cache_salt,
                                        resume_token_ids=resume_token_ids)
            except Exception as exc:  # noqa: BLE001 - after a pull the caller is no longer waiting on `add`
                self.emit(request_id, exc, last=True)

        def add() -> None:
            if source is None and prefix is not None:
                if request_id in self._sinks:  # its prefix still being pulled, say: the engine cannot tell
                    raise InvalidParameter("request_id", f"{request_id!r} is already running")
                self.engine.validate_prompt(prompt)
                self.engine.validate_params(params)
                self.add_sink(request_id, sink)
                self.count_request(len(prompt))
                self.pulls.start(request_id, prompt[:prefix_tokens], cache_salt, prefix, enter)
                return
            if source is None:
                self.engine.add_request(request_id, prompt, params, cache_salt=cache_salt,
                                        resume_token_ids=resume_token_ids)
            else:
                self.engine.validate_prompt(prompt)
                self.engine.validate_params(params, source.first_token_id)
                self._queued.append(_Job(request_id, prompt, params, source, sink,
                                         time.monotonic() + self.pull_timeout_s, cache_salt))
            self.add_sink(request_id, sink)
            self.count_request(len(prompt))
        return self.call(add)

    def abort(self, request_id: str) -> asyncio.Future:
        def run() -> bool:
            job = self._pulling.pop(request_id, None)
            if job is not None:
                job.transfer.abort("aborted by the router")
                self.engine.release_kv(request_id)
            else:
                job = next((j for j in self._queued if j.request_id == request_id), None)
                if job is not None:
                    self._queued.remove(job)
            pulling = self.pulls.abort(request_id)
            found = self.engine.abort_request(request_id) or job is not None or pulling
            if job is not None or pulling:
                self.emit(request_id, asyncio.CancelledError(), last=True)
            if self.leases is not None and self.leases.release(request_id, "aborted by the router"):
                found = True
            return found
        return self.call(run)

    # ---- engine thread -----------------------------------------------------
    def end_all(self, exc: Exception) -> None:
        """End every request (queued, pulling, running) with `exc`, freeing what each holds."""
        for request_id in list(self._sinks):
            job = self._pulling.pop(request_id, None)
            if job is not None:
                job.transfer.abort("the worker is shutting down")
                self.engine.release_kv(request_id)
            self._queued = deque(j for j in self._queued if j.request_id != request_id)
            self.pulls.abort(request_id)
            self.engine.abort_request(request_id)
            self.emit(request_id, exc, last=True)

    def has_transfers(self) -> bool:
        return bool(self._pulling or self._queued or self.leases or self.pulls)

    def poll(self) -> None:
        if self.leases is not None:
            self.leases.poll()
        self.pulls.poll()
        if self._start_pulls() and self.engine.has_unfinished():
            deadline = time.monotonic() + self.join_wait_s
            while self._pulling and time.monotonic() < deadline and not self._finish_pulls():
                time.sleep(0.0005)
        self._finish_pulls()

    def _finish_pulls(self) -> bool:
        """Move finished pulls into the engine (or fail them); True once none is in flight."""
        for request_id, job in list(self._pulling.items()):
            try:
                self._finish_pull(job)
            except Exception as exc:  # noqa: BLE001 - one bad job fails its request, not the batch
                self._pulling.pop(request_id, None)
                self._fail_job(job, exc)
        return not self._pulling

    def _finish_pull(self, job: _Job) -> None:
        state = job.transfer.poll()
        if not state.is_terminal:
            return
        del self._pulling[job.request_id]
        if state == TransferState.DONE:
            self.observe_transfer_s(time.monotonic() - job.pull_started)
            if job.transfer.bytes_moved >= LINK_SAMPLE_BYTES and job.transfer.elapsed_s:
                self.pull_bytes += job.transfer.bytes_moved
                self.pull_seconds += job.transfer.elapsed_s
            self.engine.add_request(job.request_id, job.prompt, job.params,
                                    first_token_id=job.source.first_token_id, cache_salt=job.cache_salt)
        else:
            self.transfers_failed += 1
            self.engine.release_kv(job.request_id)
            self._recompute(job, f"KV pull failed ({job.transfer.error})")

    def _fail_job(self, job: _Job, exc: Exception) -> None:
        """End one request whose job raised: free what it holds, tell its caller, keep the rest going."""
        if isinstance(exc, InvalidParameter):
            logger.warning("%s: refused: %s", job.request_id, exc)
        else:
            logger.exception("%s: KV job failed", job.request_id, exc_info=exc)
            exc = RuntimeError(f"the KV pull failed: {exc!r}")
        if job.transfer is not None and not job.transfer.state.is_terminal:
            job.transfer.abort("request failed")
        self.engine.release_kv(job.request_id)
        self.engine.abort_request(job.request_id)
        self.emit(job.request_id, exc, last=True)

    def _start_pulls(self) -> int:
        """Start pulls for queued requests while blocks last; returns how many started."""
        started = 0
        while self._queued:
            job = self._queued[0]
            try:
                outcome = self._start_pull(job)
            except Exception as exc:  # noqa: BLE001 - one bad job fails its request, not the batch
                if self._queued and self._queued[0] is job:
                    self._queued.popleft()
                self._pulling.pop(job.request_id, None)
                self._fail_job(job, exc)
                continue
            if outcome is None:
                return started  # wait for running requests to free blocks
            started += outcome
        return started

    def _start_pull(self, job: _Job) -> int | None:
        """Reserve blocks and start the pull of the queue's first job: 1 when a pull started,
        0 when the job went on otherwise (recompute), None to wait for free blocks."""
        try:
            table, num_local = self.engine.reserve_kv(job.request_id, job.prompt, job.cache_salt)
        except MemoryError:
            if time.monotonic() < job.give_up_at:
                return None
            self._queued.popleft()
            self._release_remote(job)
            self._recompute(job, "no free KV blocks to pull into")
            return 0
        self._queued.popleft()
        remote = job.source.block_ids
        job.pull_started = time.monotonic()
        try:
            if len(remote) != len(table):
                raise ValueError(f"the KV handle has {len(remote)} blocks, the prompt needs {len(table)}")
            job.transfer = self.receiver.read(job.source.peer_info, job.source.transfer_id,
                                              remote[num_local:], table[num_local:],
                                              timeout_s=max(0.1, job.give_up_at - time.monotonic()),
                                              capability=job.source.capability)
        except (KVTransferError, OSError, ValueError) as exc:
            self.transfers_failed += 1
            self.engine.release_kv(job.request_id)
            self._recompute(job, f"KV pull could not start ({exc})")
            return 0
        self._pulling[job.request_id] = job
        return 1

    def _recompute(self, job: _Job, why: str) -> None:
        """Continue without the pulled KV: prompt and first token are recomputed here."""
        logger.info("%s: %s; recomputing the prompt locally", job.request_id, why)
        self.num_recomputed += 1
        self.engine.add_request(job.request_id, job.prompt, job.params, first_token_id=job.source.first_token_id,
                                recompute_prompt=True, cache_salt=job.cache_salt)

    def _release_remote(self, job: _Job) -> None:
        """Tell the prefill worker to free its copy now rather than at lease expiry (an empty read)."""
        try:
            self.receiver.read(job.source.peer_info, job.source.transfer_id, [], [], timeout_s=5.0,
                               capability=job.source.capability)
        except (KVTransferError, OSError, ValueError):
            pass  # the lease expires on its own

    def num_requests(self) -> int:
        return (super().num_requests() + len(self._pulling) + len(self._queued) + len(self.leases or ())
                + len(self.pulls))

    def extra_stats(self) -> dict[str, float]:
        moved = self.receiver.stats().get("bytes_moved", 0)
        leases = {}
        if self.leases is not None:
            moved += self.leases.sender.stats().get("bytes_moved", 0)
            leases = self.leases.stats()
        return {"num_pulls": len(self._pulling) + len(self._queued), "transfers_failed": self.transfers_failed,
                "num_kv_recomputed": self.num_recomputed, "kv_bytes_moved": int(moved),
                "kv_pull_bytes": self.pull_bytes, "kv_pull_seconds": self.pull_seconds, **leases,
                **self.pulls.stats.as_stats()}
