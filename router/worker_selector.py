"""Choosing the workers of one sample: admission, the decode slot, remote prefill or not, prefill.

`route` runs admission control: it waits (bounded queue) for a decode worker
with room and reserves it, counting the sample on that worker until
`release`. The decode choice also settles whether remote prefill is worth it:
when the decode worker already holds all but `skip_prefill_tokens` of the
prompt (its own prefix cache on any medium, as its KV events say: a block in
its host memory or on its disk is loaded there, not pulled), it prefills the rest
itself; so it does when the link into it moves KV slower than the prefill pool
computes it (router/link_estimate.py, with `link_aware_prefill`).
A decode worker computing the prompt itself (no prefill pool, or a slow link) pulls the prefix a peer
holds first when the policy's plan says that beats computing it (`Route.pull`); with no prefill pool the
decode choice sees those copies too (`RoutingPolicy.decode_cost`).
`pick_prefill` then chooses the prefill worker by the routing policy's cost (uncached prompt blocks, plus load),
and whether it pulls a prefix another worker (prefill or decode) holds rather than compute it
(`PrefillPick.pull`; router/README.md, "Peer prefix pulls").
The costs see cached blocks weighted by the best medium holding them (`KvIndex.weighted_overlap` with
`RoutingWeights.kv_tier_weights`); the skip decision and the hit counts see blocks held on any medium.

A prefill worker's cached blocks are what the KV index says it holds, or —
when more — the prefix the prompt shares with a prompt this router is having
it prefill right now: those blocks will be cached by the time this prompt's
turn comes (its queue is FIFO), but no event can say so yet. Without this a
burst of requests sharing a new system prompt would be sprayed over every
worker before the first event arrives.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from engine.block_hash import hash_full_blocks
from router.admission import AdmissionQueue, AdmissionRejected
from router.kv_index import KvIndex
from router.link_estimate import remote_prefill_pays
from router.routing_policy import Candidate, PullOption, RoutingPolicy, routing_key
from router.worker_pool import WorkerClient, WorkerPool

DEFAULT_BLOCK_SIZE = 16


@dataclass
class Route:
    decode: WorkerClient
    """Reserved for the sample until `release`."""
    remote_prefill: bool
    skip_reason: str = ""
    """Why the decode worker prefills itself: "cached" (all but a few tokens held there) or "slow_link"."""
    prefill: WorkerClient | None = None
    """Set once a prefill worker is chosen (the last one tried)."""
    pull: PullOption | None = None
    """Without remote prefill: the decode worker pulls `pull.blocks` leading blocks from `pull.holder` first."""


@dataclass
class PrefillPick:
    worker: WorkerClient
    held: int
    """Leading prompt blocks it holds on any medium, or is computing."""
    predicted_s: float
    """The policy's expected seconds to the first token there (0 for policies without a cost)."""
    pull: PullOption | None = None
    """Set when it should pull `pull.blocks` leading blocks from `pull.holder` first."""


class NoHealthyWorker(Exception):
    """No worker of a needed role is in rotation (as opposed to all being busy)."""


class WorkerSelector:
    def __init__(self, pool: WorkerPool, index: KvIndex, policy: RoutingPolicy, admission: AdmissionQueue,
                 skip_prefill_tokens: int = 0, metrics=None, link_aware: bool = True,
                 peer_pulls: bool = True) -> None:
        self.pool = pool
        self.index = index
        self.policy = policy
        self.admission = admission
        self.skip_prefill_tokens = skip_prefill_tokens
        self.link_aware = link_aware
        self.peer_pulls = peer_pulls
        self.metrics = metrics
        pool.on_change.append(admission.poke)

    @property
    def block_size(self) -> int:
        for w in self.pool.workers:
            if w.stats is not None and w.stats.block_size:
                return w.stats.block_size
        return DEFAULT_BLOCK_SIZE

    def block_hashes(self, prompt: list[int], cache_salt: str = "") -> list[int]:
        return hash_full_blocks(prompt, self.block_size, salt=cache_salt)

    async def route(self, prompt: list[int], block_hashes: list[int],
                    exclude: tuple[WorkerClient, ...] = ()) -> Route:
        """Admit the sample and reserve its decode worker (never one in `exclude`: those a migrating
        sample left); raises AdmissionRejected, or NoHealthyWorker at once when there is no decode
        worker to wait for."""
        if not [w for w in self.pool.healthy("decode") if w not in exclude]:
            raise NoHealthyWorker("no healthy decode worker" + (" left" if exclude else ""))
        try:
            route, waited = await self.admission.admit(lambda: self._reserve(prompt, block_hashes, exclude),
                                                       self.release)
        except AdmissionRejected as exc:
            if self.metrics is not None:
                self.metrics.observe_rejection(exc.reason)
            raise
        if self.metrics is not None:
            self.metrics.observe_route(route, waited)
        return route

    def release(self, route: Route) -> None:
        route.decode.end_decode()
        self.admission.poke()

    def pick_prefill(self, prompt_len: int, block_hashes: list[int],
                     exclude: tuple[WorkerClient, ...] = ()) -> PrefillPick | None:
        """The prefill worker (and whether it pulls a prefix from a peer), or None when none is healthy."""
        workers = [w for w in self.pool.healthy("prefill") if w not in exclude]
        if not workers:
            return None
        roomy = [w for w in workers if w.has_room] or workers  # the worker itself refuses if really full
        candidates = self._candidates(roomy, block_hashes, in_progress=True)
        if self.peer_pulls and self.policy.uses_prefix:
            self._add_pull_options(candidates, self._pullable(prompt_len, block_hashes))
        chosen = self.policy.pick_prefill(candidates, len(block_hashes), routing_key(block_hashes), self.block_size)
        plan = self.policy.prefill_plan(chosen, len(block_hashes), self.block_size)
        pick = PrefillPick(self.pool.get(chosen.address), chosen.held, plan.seconds if self.policy.uses_prefix else 0.0)
        pulled = plan.pull_blocks
        if pulled:
            pick.pull = PullOption(chosen.pull.holder, int(chosen.cached_blocks) + pulled, chosen.pull.lease_s)
        if self.metrics is not None:
            media = self.index.best_media(block_hashes[:chosen.held], chosen.address)
            self.metrics.observe_prefill(pick.worker, len(block_hashes), chosen.held, media,
                                         self._peer_media(pick.pull, block_hashes, int(chosen.cached_blocks)))
        return pick

    def _peer_media(self, pull: PullOption | None, block_hashes: list[int], own: int) -> dict[str, int]:
        """The blocks a planned pull brings, by the best medium holding them on the holder."""
        return self.index.best_media(block_hashes[own:pull.blocks], pull.holder) if pull is not None else {}

    def _add_pull_options(self, candidates: list[Candidate], block_hashes: list[int]) -> None:
        """Give each candidate the deepest copy of the prompt's prefix on another worker: a prefill worker's, or
        a decode worker's (the context of a conversation it served, its answers included); on any medium: the
        holder loads what its host memory or disk holds back onto its device before the lease is answered."""
        if not block_hashes:
            return
        holders = self.pool.healthy("prefill") + self.pool.healthy("decode")
        depths = self.index.overlap(block_hashes, [w.address for w in holders])
        for c in candidates:
            worker = self.pool.get(c.address)
            holder, blocks = max(((a, d) for a, d in depths.items() if a != c.address), key=lambda t: t[1],
                                 default=(None, 0))
            if holder is None or blocks <= c.cached_blocks or worker.stats is None:
                continue
            c.pull = PullOption(holder, blocks, self.pool.get(holder).lease_s)
            c.block_bytes = worker.stats.kv_block_bytes
            if worker.link.bytes_per_s:
                c.block_s = c.block_bytes / worker.link.bytes_per_s

    # ---- internals ------------------------------------------------------
    def _reserve(self, prompt: list[int], block_hashes: list[int],
                 exclude: tuple[WorkerClient, ...] = ()) -> Route | None:
        decode = [w for w in self.pool.healthy("decode") if w.has_room and w not in exclude]
        if not decode:
            return None
        prefill = self.pool.healthy("prefill")
        if prefill and not any(w.has_room for w in prefill):
            return None  # (none healthy at all: the prefill pick reports UNAVAILABLE)
        candidates = self._candidates(decode, block_hashes)
        local = not self.pool.has_role("prefill")
        if local and self.peer_pulls and self.policy.uses_prefix:  # the chosen one computes the prompt: peers'
            self._add_pull_options(candidates, self._pullable(len(prompt), block_hashes))  # copies count as held
        chosen = self.policy.pick_decode(candidates, len(block_hashes), routing_key(block_hashes), self.block_size)
        worker = self.pool.get(chosen.address)
        worker.begin_decode()
        # Blocks it holds on any medium: it loads its own host or disk copies rather than pull them.
        uncached = len(prompt) - chosen.held * self.block_size
        if local:
            return self._local(Route(worker, False), chosen, prompt, block_hashes)
        if uncached < self.skip_prefill_tokens:
            return Route(worker, False, "cached")
        if self.link_aware and not self._link_pays(worker, prefill) and worker.link.skip_or_probe():
            return self._local(Route(worker, False, "slow_link"), chosen, prompt, block_hashes)
        return Route(worker, True)

    def _local(self, route: Route, chosen: Candidate, prompt: list[int], block_hashes: list[int]) -> Route:
        """A decode worker computing the prompt itself: whether it pulls a prefix a peer holds first (the
        policy's plan on it, as for a prefill worker)."""
        if not (self.peer_pulls and self.policy.uses_prefix):
            return route
        if chosen.pull is None:
            self._add_pull_options([chosen], self._pullable(len(prompt), block_hashes))
        pulled = self.policy.prefill_plan(chosen, len(block_hashes), self.block_size).pull_blocks
        if pulled:
            route.pull = PullOption(chosen.pull.holder, int(chosen.cached_blocks) + pulled, chosen.pull.lease_s)
            if self.metrics is not None:
                self.metrics.observe_hits("peer", self._peer_media(route.pull, block_hashes, int(chosen.cached_blocks)))
        return route

    def _pullable(self, prompt_len: int, block_hashes: list[int]) -> list[int]:
        """The blocks of a prompt a pull may bring: never its last token's (computed for its logits)."""
        return block_hashes[:(prompt_len - 1) // self.block_size]

    def _link_pays(self, decode: WorkerClient, prefill: list[WorkerClient]) -> bool:
        """Whether KV moves into `decode` at least as fast as the prefill pool computes it (per token)."""
        stats = decode.stats
        if stats is None or not stats.kv_block_bytes or not stats.block_size or not prefill:
            return True
        timed = [w.speed.estimate()[0] for w in prefill if w.speed.knows_token_s]
        token_s = min(timed) if timed else None
        return remote_prefill_pays(stats.kv_block_bytes / stats.block_size, decode.link.bytes_per_s, token_s)

    def _candidates(self, workers: list[WorkerClient], block_hashes: list[int],
                    in_progress: bool = False) -> list[Candidate]:
        addresses = [w.address for w in workers]
        if self.policy.uses_prefix or self.skip_prefill_tokens:
            depth = self.index.overlap(block_hashes, addresses)
            weighted = self.index.weighted_overlap(block_hashes, addresses, self.policy.weights.kv_tier_weights,
                                                   depth)
        else:
            depth, weighted = {}, {}
        out = []
        block_size = self.block_size
        speeds = self._speeds()
        for w in workers:
            s = w.stats
            queued, running = _load_now(w)
            held, cached = depth.get(w.address, 0), weighted.get(w.address, 0.0)
            if in_progress and self.policy.uses_prefix:
                # A prefix being computed there will be on its device: counts as device blocks.
                computing = max((_common_prefix(block_hashes, p) for p in w.pending_prompts.values()), default=0)
                held, cached = max(held, computing), max(cached, float(computing))
            token_s, request_s = speeds(w) if w.role == "prefill" else (None, None)
            out.append(Candidate(w.address, queued_blocks=queued / block_size,
                                 running=running, kv_blocks_used=s.kv_blocks_used if s else 0,
                                 kv_blocks_total=s.kv_blocks_total if s else 0, cached_blocks=cached,
                                 held_blocks=held, kv_blocks_cached=self.index.num_blocks(w.address),
                                 token_s=token_s, request_s=request_s))
        return out


    def _speeds(self):
        """A prefill worker's (token_s, request_s): its own learnt figures, and until it has them its learnt
        peers' mean (the same model on the same kind of machine), else None for the policy's default. A
        prior far from the truth would otherwise make an unmeasured worker look slower than its measured
        peers, so they would take its prefixes (pulled or computed) and it would never be measured."""
        known = [w.speed for w in self.pool.healthy("prefill")]
        token = [s.token_s for s in known if s.knows_token_s]
        request = [s.request_s for s in known if s.knows_request_s]
        token_s = sum(token) / len(token) if token else None
        request_s = sum(request) / len(request) if request else None

        def speeds(w: WorkerClient) -> tuple[float | None, float | None]:
            return (w.speed.token_s if w.speed.knows_token_s else token_s,
                    w.speed.request_s if w.speed.knows_request_s else request_s)
        return speeds


def _load_now(w: WorkerClient) -> tuple[float, int]:
    """(prompt tokens waiting, requests at work) on the worker now. This router's own calls are known
    exactly; others' work only from polls up to a health interval old, so for a prefill worker what the
    last poll saw is taken as drained at its learnt speed since (queued tokens, then requests): taken at
    face value, work long finished would send a returning prompt away from its holder."""
    s = w.stats
    queued = float(s.num_waiting_tokens) if s is not None else 0.0
    others = w.working - w.in_flight
    if w.role == "prefill" and s is not None and w.answered_at != float("-inf") and (queued or others):
        try:
            elapsed = max(0.0, asyncio.get_running_loop().time() - w.answered_at)
        except RuntimeError:  # no event loop (a pure-Python caller): the stats as they are
            elapsed = 0.0
        token_s, request_s = w.speed.estimate()
        drained = min(queued, elapsed / token_s)
        queued -= drained
        others = max(0, others - int((elapsed - drained * token_s) / request_s))
    return max(float(w.pending_tokens), queued), w.in_flight + others


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
