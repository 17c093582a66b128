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
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager, PrefixHit
from engine.request import FinishReason, Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    """Tokens computed this step, starting at request.num_computed_tokens (proposed tokens included)."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Proposed tokens computed after the request's last token, to be verified."""

    @property
    def samples(self) -> bool:
        """True when this step computes the request's last token (so it samples)."""
        req = self.request
        return req.num_computed_tokens + self.num_new_tokens == req.num_tokens + len(self.spec_token_ids)

    @property
    def num_logits(self) -> int:
        """Rows of logits this request needs: 1 + K when it verifies K proposals, 1 when it samples, else 0."""
        return 1 + len(self.spec_token_ids) if self.samples else 0

    def input_token_ids(self) -> list[int]:
        """The tokens this step computes: the request's own, then the proposals."""
        start = self.request.num_computed_tokens
        own = self.request.all_token_ids[start:start + self.num_new_tokens]
        return own + self.spec_token_ids if self.spec_token_ids else own


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
        self.offload = None
        """The KV tiers below the block pool (engine/kv_offload/KVOffloader), when configured."""
        self.loading: dict[str, tuple[Request, int]] = {}
        """Load key -> (request, device-hit blocks) of requests whose prefix blocks a lower tier is loading."""
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
        return bool(self.waiting or self.running or self.loading or self._orphan_loads)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step ------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.offload is not None:
            self._finish_loads()
        budget = self.config.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
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
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            prefix = None
            if not self.kv.block_table(request.request_id):
                prefix = self.kv.find_prefix(request.request_id, request.all_token_ids, request.cache_salt)
                if self.offload is not None:
                    started = self._start_load(request, prefix)
                    if started is None:
                        break
                    if started:
                        self.waiting.popleft()
                        continue
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
        if not out.scheduled and self.loading:
            self.offload.wait(0.005)  # nothing to run until a load ends: don't let the engine loop spin
        return out

    # ---- KV tiers ------------------------------------------------------
    def _start_load(self, request: Request, prefix: PrefixHit) -> bool | None:
        """Load the blocks after `prefix` that a lower tier holds: True (the request now waits in `loading`),
        False (none there), None (blocks or the load budget are short: try again later)."""
        bs = self.kv.block_size
        hashes = self.kv.block_hashes(request.request_id, request.all_token_ids, request.cache_salt)
        start = len(prefix.block_ids)
        found = self.offload.lookup(hashes, request.all_token_ids, start, (request.num_tokens - 1) // bs)
        if not found:
            return False
        if not self.offload.can_load(len(found)) or self.kv.allocate_slots(
                request.request_id, 0, len(found) * bs, prefix) is None:
            return None
        self._num_loads += 1
        key = f"{request.request_id}\x00load{self._num_loads}"
        self.offload.start_load(key, found, self.kv.block_table(request.request_id)[start:])
        request.status = RequestStatus.LOADING
        self.loading[key] = (request, start)
        self._load_keys[request.request_id] = key
        return True

    def _finish_loads(self) -> None:
        for key, num_loaded in self.offload.poll():
            if key in self._orphan_loads:
                self._orphan_loads.discard(key)
                self.kv.free(key)
                continue
            request, start = self.loading.pop(key)
            del self._load_keys[request.request_id]
            computed = (start + num_loaded) * self.kv.block_size
            self.kv.truncate(request.request_id, computed)  # blocks past a refused one are recomputed
            self.kv.cache_computed_blocks(request.request_id, request.all_token_ids, computed, request.cache_salt)
            request.num_computed_tokens = computed
            if request.num_preemptions == 0:
                request.num_cached_tokens = min(computed, request.num_prompt_tokens)
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)

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
            self.kv.cache_computed_blocks(request.request_id, request.all_token_ids,
                                          request.num_computed_tokens, request.cache_salt)
        if self.offload is not None:
            self.offload.after_step()

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
        key = self._load_keys.pop(request.request_id, None)
        if key is not None:  # its blocks are being filled: freed when the load ends
            del self.loading[key]
            self.kv.rename(request.request_id, key)
            self._orphan_loads.add(key)
        elif request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if not keep_blocks:
            self.kv.free(request.request_id)
        self.requests.pop(request.request_id, None)
