"""Continuous batching under a per-step token budget. No torch.

Each step: running requests first (oldest first), each given the tokens it
still lacks KV for, up to the budget (so long prompts are chunked). If blocks
run out, the newest running request is preempted (blocks freed, recomputed
later from the front of the waiting queue). Then waiting requests are admitted
while budget, sequence slots and blocks last, reusing prefix-cached blocks.

Speculative decoding: a decoding request (one token lacking KV) that carries
proposed tokens (`request.spec_token_ids`) computes them too, 1 + K tokens,
if budget and blocks allow (else it decodes one token as usual). Only the
request's real tokens count as computed after the step; `accept_spec` adds the
accepted proposals and frees blocks that hold nothing but rejected KV.

KV tiers (`offload`, engine/kv_offload/): a waiting request whose prefix goes on
in host memory or on disk past its device hit gets blocks for those blocks and
waits in `loading` while they are copied back; then it rejoins the front of the
queue with them computed. Blocks registered in a step are copied down after it.
A decode reservation (`load_reserved`) loads the same way while the rest of the
prompt is pulled; its request waits in `loading` if it comes before the load ends.

Sliding window (a KV cache manager with `sliding_window`: every layer slides): each step
first releases, for every running request, the blocks behind the window of its next query
(`num_computed_tokens`, which never counts unverified proposals, so a rollback never reaches
them), so the free-block checks and preemption below see what windowed requests really hold;
a request getting its first blocks (admission, a load from a lower tier) takes none behind its
first query's window. Prefill-role requests (`prefill_only`) release nothing: their whole
table is shipped to a decode worker.

Pipeline micro-batches (the engine with pipeline_parallel_size K keeps several steps in flight): a step skips
the requests still in flight (their next token is not sampled yet) and never preempts one, and takes at most
`max_requests` of the others, so consecutive steps hold different requests.

Async scheduling (the engine schedules step N+1 before collecting step N): a request in flight that is
`continuing` decodes its pending token (`num_pending_tokens`: sampled by step N, known only on the device)
in step N+1, if a slot is free for it without preempting; its input is patched in on the device. Blocks are
registered for the prefix cache only once their tokens are known.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Container
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager, PrefixHit
from engine.request import FinishReason, Request, RequestStatus
from engine.scheduler_loads import PendingLoad, SchedulerLoads


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    """Tokens computed this step, starting at request.num_computed_tokens (proposed tokens included)."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Proposed tokens computed after the request's last token, to be verified."""
    samples: bool = field(init=False)
    """True when this step computes the request's last token (so it samples)."""
    num_logits: int = field(init=False)
    """Rows of logits this request needs (its last positions'): 1 + K when it verifies K proposals, 1 when it
    samples, else 0; a prompt chunk of a request wanting prompt logprobs: one per position."""

    def __post_init__(self) -> None:  # fixed at scheduling: read many times before `finish_step` moves the request
        req = self.request
        num_spec = len(self.spec_token_ids)
        end = req.num_computed_tokens + self.num_new_tokens
        self.samples = end == req.num_tokens + req.num_pending_tokens + num_spec
        if req.prompt_logprobs_pending and req.num_computed_tokens < req.num_prompt_tokens:
            self.num_logits = self.num_new_tokens
        else:
            self.num_logits = 1 + num_spec if self.samples else 0

    def input_token_ids(self) -> list[int]:
        """The tokens this step computes: the request's own (PENDING_TOKEN for a pending one), then the proposals."""
        start = self.request.num_computed_tokens
        num_own = self.num_new_tokens - len(self.spec_token_ids)
        own = self.request.all_token_ids[start:start + num_own]
        own += [PENDING_TOKEN] * (num_own - len(own))
        return own + self.spec_token_ids if self.spec_token_ids else own


PENDING_TOKEN = 0
"""Input id placed for a pending token (async scheduling); the engine writes the sampled one over it on the device."""


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    """(src, dst) copy-on-write block copies to make before the step runs."""
    preempted: list[Request] = field(default_factory=list)


class Scheduler(SchedulerLoads):
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._in_flight: Container[str] = ()
        self.offload = None
        """The KV tiers below the block pool (engine/kv_offload/KVOffloader), when configured."""
        self.loading: dict[str, PendingLoad] = {}
        """Load key -> the load of a request's prefix blocks from a lower tier."""
        self._load_keys: dict[str, str] = {}
        self._orphan_loads: set[str] = set()
        self._num_loads = 0
        """Load keys of aborted requests: their blocks are freed once the load ends."""

    # ---- admission -----------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_computed_tokens and not self.kv.block_table(request.request_id):
            raise ValueError(f"{request.request_id}: computed tokens given but no blocks allocated")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or (self.offload is not None and self.offload.busy))

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step ------------------------------------------------------
    def schedule(self, in_flight: Container[str] = (), max_requests: int | None = None,
                 continuing: Container[str] = ()) -> SchedulerOutput:
        """The next step. `in_flight`: requests whose last step is still computed (pipeline micro-batches, async
        scheduling): skipped, and never preempted, except those `continuing` (async scheduling), which decode
        their pending token when a slot is free; `max_requests`: at most that many requests in the step."""
        out = SchedulerOutput()
        self._in_flight = in_flight
        cap = max_requests or math.inf
        if self.offload is not None:
            self._finish_loads()
        if self.kv.sliding_window is not None:
            for request in self.running:
                self._release_outside_window(request)
        budget = self.config.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0 and len(out.scheduled) < cap:
            request = self.running[index]
            if request.request_id in in_flight:
                if request.request_id in continuing:
                    copies = self.kv.allocate_slots(request.request_id, request.num_computed_tokens, 1)
                    if copies is not None:  # else it waits for its step: nothing is preempted for it
                        out.scheduled.append(ScheduledRequest(request, 1))
                        out.block_copies.extend(copies)
                        budget -= 1
                index += 1
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            spec, request.spec_token_ids = request.spec_token_ids[:budget - 1], []
            copies = None
            if spec and num_new == 1:
                copies = self.kv.allocate_slots(request.request_id, request.num_computed_tokens, 1 + len(spec))
            if copies is None:  # no proposals, or no blocks for them: an ordinary step
                spec = []
                copies = self._allocate_or_preempt(request, num_new, out)
                if copies is None:
                    break
            out.scheduled.append(ScheduledRequest(request, num_new + len(spec), spec))
            out.block_copies.extend(copies)
            budget -= num_new + len(spec)
            index += 1
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and len(out.scheduled) < cap:
            request = self.waiting[0]
            prefix = first_query = None
            if not self.kv.block_table(request.request_id):
                prefix = PrefixHit() if request.prompt_logprobs_pending else \
                    self.kv.find_prefix(request.request_id, request.all_token_ids, request.cache_salt)
                if self.offload is not None:
                    started = self._start_load(request, prefix)
                    if started is None:
                        break
                    if started:
                        self.waiting.popleft()
                        continue
                first_query = self._first_query(request, request.num_computed_tokens + prefix.num_tokens)
            else:
                self._release_outside_window(request)
            num_done = request.num_computed_tokens + (prefix.num_tokens if prefix else 0)
            num_new = min(request.num_tokens - num_done, budget)
            copies = self.kv.allocate_slots(request.request_id, request.num_computed_tokens, num_new, prefix,
                                            first_query)
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
        if not out.scheduled and self.offload is not None and self.offload.busy:
            self.offload.after_step()  # blocks still waiting for a host slot
            self.offload.wait(0.005)  # nothing to run until the tiers' I/O ends: don't let the engine loop spin
        return out

    # ---- sliding window --------------------------------------------------
    def _release_outside_window(self, request: Request) -> None:
        """Release the request's blocks no later query reads (none for a prefill whose blocks are shipped)."""
        if not request.prefill_only:
            self.kv.release_outside_window(request.request_id, request.num_computed_tokens)

    @staticmethod
    def _first_query(request: Request, position: int) -> int | None:
        """What `allocate_slots` gets as `first_query` for a request's first blocks: its next query's position,
        None (every block taken) for a prefill whose blocks are shipped."""
        return None if request.prefill_only else position

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput):
        while True:
            copies = self.kv.allocate_slots(request.request_id, request.num_computed_tokens, num_new)
            if copies is not None:
                return copies
            victim = next(r for r in reversed(self.running) if r.request_id not in self._in_flight)  # or request
            self.running.remove(victim)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- after the step ------------------------------------------------
    def finish_step(self, out: SchedulerOutput) -> None:
        """Advance computed-token counts and register newly full blocks."""
        for item in out.scheduled:
            request = item.request
            request.num_computed_tokens += item.num_new_tokens - len(item.spec_token_ids)
            self.cache_known_blocks(request)  # every full block not yet registered (pulled ones too)
        if self.offload is not None:
            self.offload.after_step()

    def cache_known_blocks(self, request: Request) -> None:
        """Register the request's full computed blocks whose tokens are all known (a pending one is not)."""
        self.kv.cache_computed_blocks(request.request_id, request.all_token_ids,
                                      min(request.num_computed_tokens, request.num_tokens), request.cache_salt)

    def accept_spec(self, request: Request, num_accepted: int) -> None:
        """After verification: `num_accepted` proposals (now appended to the request's tokens) keep their KV;
        register blocks they filled and free blocks holding only rejected KV (never hashed)."""
        if request.is_finished:
            return
        request.num_computed_tokens += num_accepted
        self.kv.cache_computed_blocks(request.request_id, request.all_token_ids, request.num_computed_tokens,
                                      request.cache_salt)
        self.kv.truncate(request.request_id, request.num_tokens)

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
        self.drop_load(request.request_id)  # blocks a load still fills are freed when it ends
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if not keep_blocks:
            self.kv.free(request.request_id)
        self.requests.pop(request.request_id, None)
