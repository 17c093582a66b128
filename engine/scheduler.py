"""Continuous batching under a per-step token budget. No torch.

Each step: running requests first (oldest first), each given the tokens it
still lacks KV for, up to the budget (so long prompts are chunked). If blocks
run out, the newest running request is preempted (blocks freed, recomputed
later from the front of the waiting queue). Then waiting requests are admitted
while budget, sequence slots and blocks last, reusing prefix-cached blocks.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import FinishReason, Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    """Tokens computed this step, starting at request.num_computed_tokens."""

    @property
    def samples(self) -> bool:
        """True when this step computes the request's last token (so it samples)."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    """(src, dst) copy-on-write block copies to make before the step runs."""
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- admission -----------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_computed_tokens and not self.kv.block_table(request.request_id):
            raise ValueError(f"{request.request_id}: computed tokens given but no blocks allocated")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step ------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            copies = self._allocate_or_preempt(request, num_new, out)
            if copies is None:
                break
            out.scheduled.append(ScheduledRequest(request, num_new))
            out.block_copies.extend(copies)
            budget -= num_new
            index += 1
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            prefix = None
            if not self.kv.block_table(request.request_id):
                prefix = self.kv.find_prefix(request.request_id, request.all_token_ids, request.cache_salt)
            num_done = request.num_computed_tokens + (prefix.num_tokens if prefix else 0)
            num_new = min(request.num_tokens - num_done, budget)
            copies = self.kv.allocate_slots(request.request_id, request.num_computed_tokens, num_new, prefix)
            if copies is None:
                break
            self.waiting.popleft()
            if prefix and prefix.num_tokens:
                request.num_computed_tokens += prefix.num_tokens
                if request.num_preemptions == 0:
                    request.num_cached_tokens = min(prefix.num_tokens, request.num_prompt_tokens)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            out.block_copies.extend(copies)
            budget -= num_new
        return out

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput):
        while True:
            copies = self.kv.allocate_slots(request.request_id, request.num_computed_tokens, num_new)
            if copies is not None:
                return copies
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- after the step ------------------------------------------------
    def finish_step(self, out: SchedulerOutput) -> None:
        """Advance computed-token counts and register newly full blocks."""
        for item in out.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_new_tokens
            self.kv.cache_computed_blocks(request.request_id, request.all_token_ids,
                                          request.num_computed_tokens, request.cache_salt)

    def fork(self, parent: Request, child: Request) -> None:
        """Add a parallel sample sharing the parent's blocks (after its first token)."""
        self.kv.fork(parent.request_id, child.request_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = RequestStatus.RUNNING
        self.requests[child.request_id] = child
        self.running.append(child)

    def finish(self, request: Request, reason: FinishReason | None, keep_blocks: bool = False) -> None:
        """End a request (finished or aborted) and free its blocks, or keep them
        allocated under its id (`keep_blocks`, a prefill handing its KV off)."""
        if request.is_finished:
            return
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if not keep_blocks:
            self.kv.free(request.request_id)
        self.requests.pop(request.request_id, None)
