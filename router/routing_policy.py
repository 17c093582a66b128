"""How a worker is chosen: one cost per role, in predicted time, and a deterministic pick. No I/O.

Prefill (policy `prefix`), in seconds of expected time to first token:

    cost = wait + compute + pollution
    wait      = queued_tokens * token_s + running * request_s       (work ahead of the prompt)
    compute   = overlap_weight * uncached_tokens * token_s + request_s
    pollution = pollution_weight * evicted_blocks * block_size * token_s

`token_s` (seconds per uncached prompt token) and `request_s` (fixed cost of one
request: attention over its cached context, the LM head, scheduling) are learnt
online per worker by `PrefillSpeed` from the router's own prefill calls; until
then they default to the SmolLM2/CPU measurement (0.9 ms per token, 8 blocks'
worth per request). `uncached_tokens` is the prompt less its cached blocks
weighted by tier (`RoutingWeights.kv_tier_weights`, by the best medium holding
each): a leading block on the worker's device counts 1, in its host memory 0.8,
on its local disk 0.5 by default; a lower-tier hit must be loaded first, so it
is worth less than a device hit and more than a miss. `evicted_blocks` is how
many cached blocks the prompt's uncached ones (the same weighted count) would
push out (the worker's pool is full of others' prefixes):
each will cost about its own compute again when its owner returns. That term is
the hysteresis under cache pressure: moving a prefix to an idle worker pays for
the miss *and* for what the copy evicts there, so a prefix stays on its holder
until the holder's queue costs more than both. Without pressure a copy is cheap
and the prefix spreads to wherever it is served soonest.

The pick is deterministic, and partitions the pool's caches: candidates whose
cost is within `tie_ratio` of the best are near-ties; among them a holder of the
prompt's key blocks (on any medium) wins, else the one ranked first by rendezvous hashing of the
prompt's key (the hash of its first `KEY_BLOCKS` blocks, a chained hash) over
the addresses. So new prefixes spread evenly over an idle pool, a prefix
evicted everywhere returns to the same home, and a worker joining or leaving
moves only the prefixes homed on it. Every router with the same view makes the
same choice. Without a key (a prompt shorter than a block) exact ties go to
the smallest address. `least_loaded` is the same cost without the cache terms.

Decode, in running requests:

    cost = running + kv_weight * kv_usage + hold_weight * uncached_fraction

where `uncached_fraction` is the part of the prompt the worker does not hold
(tier-weighted as above; it would pull it from prefill, or skip remote prefill when it holds nearly
all of it): a returning conversation goes back to where its context lives. When the decode worker
computes the prompt itself (no prefill pool), blocks it could pull from a peer count as held, each by
the part of its compute the pull saves (`pull_worth`: 1 - block_s / (block_size * token_s)): where pulls
are cheap a conversation is no longer tied to one busy worker.
Near-ties (within `decode_tie`) are broken the same way as prefill.

Peer pulls (`prefix` with `PullOption`s): a candidate lacking blocks another prefill worker holds on its
device may pull them instead of computing them (router/README.md, "Peer prefix pulls"):

    pull cost = wait + pull_s + pulled_blocks * block_s + overlap_weight * rest * block_size * token_s
                + request_s + pollution

`pulled_blocks` the holder's device depth less what the candidate holds, `rest` the prompt blocks past the
holder's depth, `block_s` the learnt seconds per block on the link into the candidate (`LinkEstimate`, a
default until learnt) and `pull_s` the fixed cost of a pull: the transfer's handshake, plus the holder's
learnt lease latency (it answers between two of its engine steps, so a busy holder answers later).
A candidate's cost is the cheaper of computing and pulling; so the argmin over candidates is the choice
among *compute here*, *pull then compute here*, and *wait for the holder* (the holder's own cost, its
queue included). Nothing is tuned: the point where a hot prefix spreads from a busy holder (replicated
by a pull) is where the holder's queue costs more than a pull, from the learnt speeds.

`round_robin` cycles through the candidates sorted by address; `random` draws.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import xxhash

from common.config_flags import float_mapping
from engine.kv_events import MEDIA

POLICIES = ("prefix", "least_loaded", "round_robin", "random")
KEY_BLOCKS = 4
"""The prompt's routing key is the chained hash of its first (up to) 4 blocks: 64 tokens covers a chat
template's header and the start of the system prompt, where the first block alone often does not."""
DEFAULT_TOKEN_S = 0.0009
DEFAULT_BLOCK_SIZE = 16
DEFAULT_TIER_WEIGHTS = {"device": 1.0, "cpu": 0.8, "disk": 0.5}
DEFAULT_LINK_BYTES_PER_S = 1e9
"""KV bandwidth between prefill workers until a pull into the candidate has been timed (loopback TCP moves
several GB/s, a 10 GbE link about 1)."""
DEFAULT_PULL_S = 0.005
"""Fixed cost of one peer pull: the LeasePrefix call, the transfer's handshake and grant."""


@dataclass
class PullOption:
    """Another prefill worker holds a longer prefix of the prompt on its device."""

    holder: str
    """Its address."""
    blocks: int
    """Leading prompt blocks it holds on its device."""
    lease_s: float = 0.0
    """How long its LeasePrefix calls take (learnt: the holder answers between two of its engine steps)."""


@dataclass
class PrefillPlan:
    """The policy's plan for one prompt on one prefill candidate."""

    seconds: float
    """Expected seconds to the first token there."""
    pollution: float = 0.0
    """What its copy evicts there, in seconds of recompute (part of the cost, not of the wait)."""
    pull_blocks: int = 0
    """Blocks to pull from the candidate's `pull.holder` first (0: compute them)."""


@dataclass
class Candidate:
    address: str
    queued_blocks: float = 0.0
    """Prompt blocks (tokens / block size) waiting for prefill on the worker."""
    running: int = 0
    """Requests the worker holds."""
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    cached_blocks: float = 0.0
    """Leading prompt blocks the worker already holds (from the KV index), each weighted by the best
    medium holding it (RoutingWeights.kv_tier_weights): device blocks count 1, host or disk ones less."""
    held_blocks: int | None = None
    """Leading prompt blocks held on any medium, unweighted; None: `cached_blocks` (all on device)."""
    kv_blocks_cached: int = 0
    """Blocks the worker's prefix cache holds (KV index), in use or not: how full its pool is."""
    token_s: float | None = None
    """Learnt seconds per uncached prompt token; None: the policy's default."""
    request_s: float | None = None
    """Learnt fixed seconds per request; None: the policy's default."""
    pull: PullOption | None = None
    """Prefill: the deepest device copy of the prompt's prefix on another prefill worker (None: none deeper)."""
    block_s: float | None = None
    """Prefill: learnt seconds to pull one block into this worker; None: from DEFAULT_LINK_BYTES_PER_S."""
    block_bytes: int = 0
    """Bytes of one KV block (0: unknown, no pull considered)."""

    @property
    def held(self) -> int:
        return self.held_blocks if self.held_blocks is not None else int(self.cached_blocks)

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass
class RoutingWeights:
    overlap_weight: float = field(default=1.0, metadata={
        "help": "prefix policy: cost of an uncached prompt block relative to a block of queued work"})
    """Prefill: cost of one uncached prompt block relative to one block of queued work."""
    kv_weight: float = field(default=4.0, metadata={
        "help": "decode choice: cost of a full KV pool, in running requests"})
    """Decode: cost of a full KV pool, in running requests."""
    request_weight: float = field(default=8.0, metadata={
        "flag": "--prefill-request-weight", "help": "prefill choice: fixed cost of one request, in blocks of prompt"})
    """Prefill: default fixed cost of one request, in blocks of prompt (until learnt)."""
    pollution_weight: float = field(default=1.0, metadata={
        "help": "prefix policy: cost of evicting a cached block relative to computing one"})
    """Prefill: cost of evicting one cached block, relative to computing one block."""
    tie_ratio: float = field(default=0.2, metadata={
        "help": "prefix policy: costs within this fraction of the best are near-ties (holder, then rendezvous-hash "
                "home)"})
    """Costs within this fraction of the best are near-ties, broken by holder then rendezvous hash."""
    hold_weight: float = field(default=2.0, metadata={
        "flag": "--decode-hold-weight",
        "help": "prefix policy, decode choice: cost of not holding the prompt, in running requests"})
    """Decode: cost of not holding the prompt at all, in running requests."""
    decode_tie: float = 0.5
    """Decode: costs within this many running requests of the best are near-ties."""

    kv_tier_weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS), metadata={
        "type": float_mapping("MEDIUM=WEIGHT", "cpu=0.8,disk=0.5"), "metavar": "MEDIUM=W,...",
        "help": "prefix policy: worth of a prompt block a worker holds in host memory (cpu) or on local disk "
                "(disk), relative to one on its device (1.0); default cpu=0.8,disk=0.5"})
    """Worth of a cached prompt block by the best medium holding it, in device blocks: a block a worker
    holds in host memory or on disk saves less than one in its KV pool (it must be loaded), more than a
    miss. Media left out keep their default; device is the unit (1.0), and a lower tier may not be worth
    more than a better one (engine/kv_events.py MEDIA order), each in [0, 1]."""

    def __post_init__(self) -> None:
        for name in ("overlap_weight", "kv_weight", "request_weight", "pollution_weight", "tie_ratio",
                     "hold_weight", "decode_tie"):
            if getattr(self, name) < 0:
                raise ValueError(f"routing weights must be >= 0 ({name})")
        unknown = sorted(set(self.kv_tier_weights) - set(MEDIA))
        if unknown:
            raise ValueError(f"kv_tier_weights: unknown medium {unknown[0]!r} (known: {', '.join(MEDIA)})")
        self.kv_tier_weights = {m: float(self.kv_tier_weights.get(m, DEFAULT_TIER_WEIGHTS[m])) for m in MEDIA}
        if self.kv_tier_weights["device"] != 1.0:
            raise ValueError("kv_tier_weights: device must be 1.0 (the unit the others are measured in)")
        for better, worse in zip(MEDIA, MEDIA[1:], strict=False):
            if not 0 <= self.kv_tier_weights[worse] <= self.kv_tier_weights[better]:
                raise ValueError(f"kv_tier_weights: {worse} must be in [0, {better}'s weight], "
                                 f"got {self.kv_tier_weights[worse]}")


def routing_key(block_hashes: list[int]) -> int | None:
    """The prompt's partition key: its chained hash after KEY_BLOCKS blocks (or fewer); None without one."""
    return block_hashes[min(len(block_hashes), KEY_BLOCKS) - 1] if block_hashes else None


def rendezvous_rank(key: int, address: str) -> int:
    """Highest random weight: the candidate with the largest rank is the key's home."""
    return xxhash.xxh64_intdigest(address.encode(), seed=key & 0xFFFFFFFFFFFFFFFF)


class PrefillSpeed:
    """A worker's prefill speed, learnt from calls that found it idle: duration = request_s + tokens * token_s.

    Two exponentially weighted averages (weight `alpha` on the newest call), so it follows a worker
    that slows down (outside load, a bigger batch) and needs no configuration: calls computing at least
    LONG_TOKENS update `token_s` (their duration less `request_s`, per token), shorter ones (cache hits)
    update `request_s` (their duration less their tokens' share). The first call of each kind replaces
    the prior. Unlike a least-squares fit of both terms, a noisy pair of calls can never make the
    slope negative or tiny.
    """

    LONG_TOKENS = 64

    def __init__(self, alpha: float = 0.2, prior_token_s: float = DEFAULT_TOKEN_S, prior_request_s: float = 0.1152):
        self.alpha = alpha
        self.prior_token_s = prior_token_s
        self.prior_request_s = prior_request_s
        self.token_s = prior_token_s
        self.request_s = prior_request_s
        self.count = 0
        self._seen_long = self._seen_short = False

    def observe(self, tokens: int, seconds: float) -> None:
        if seconds <= 0 or tokens < 0:
            return
        self.count += 1
        if tokens >= self.LONG_TOKENS:
            value = max(seconds - self.request_s, 0.5 * seconds) / tokens
            a = self.alpha if self._seen_long else 1.0
            self.token_s += a * (value - self.token_s)
            self._seen_long = True
        else:
            value = max(seconds - tokens * self.token_s, 0.0)
            a = self.alpha if self._seen_short else 1.0
            self.request_s += a * (value - self.request_s)
            self._seen_short = True

    @property
    def knows_token_s(self) -> bool:
        """Whether `token_s` was measured (a long call seen), not the prior."""
        return self._seen_long

    @property
    def knows_request_s(self) -> bool:
        """Whether `request_s` was measured (a short call seen), not the prior."""
        return self._seen_short

    def estimate(self) -> tuple[float, float]:
        """(token_s, request_s)."""
        return self.token_s, self.request_s


class RoutingPolicy:
    def __init__(self, name: str, weights: RoutingWeights | None = None, seed: int | None = None) -> None:
        if name not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {name!r}")
        self.name = name
        self.weights = weights or RoutingWeights()
        self._turns = {"prefill": 0, "decode": 0}
        self._random = random.Random(seed)

    @property
    def uses_prefix(self) -> bool:
        return self.name == "prefix"

    def speeds(self, c: Candidate, block_size: int = DEFAULT_BLOCK_SIZE) -> tuple[float, float]:
        token_s = c.token_s if c.token_s is not None else DEFAULT_TOKEN_S
        request_s = c.request_s if c.request_s is not None else self.weights.request_weight * block_size * token_s
        return token_s, request_s

    def prefill_cost(self, c: Candidate, prompt_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> float:
        """Expected seconds to the prompt's first token on `c` (plus, for `prefix`, what its copy evicts),
        by the cheaper of computing its uncached blocks and pulling those a peer holds."""
        plan = self.prefill_plan(c, prompt_blocks, block_size)
        return plan.seconds + plan.pollution

    def prefill_plan(self, c: Candidate, prompt_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> PrefillPlan:
        token_s, request_s = self.speeds(c, block_size)
        wait = c.queued_blocks * block_size * token_s + c.running * request_s
        if not self.uses_prefix:
            return PrefillPlan(wait)
        uncached = max(0, prompt_blocks - c.cached_blocks)
        block_compute_s = self.weights.overlap_weight * block_size * token_s
        seconds = wait + uncached * block_compute_s + request_s
        pollution = 0.0
        if c.kv_blocks_total and self.weights.pollution_weight:
            free = c.kv_blocks_total - max(c.kv_blocks_cached, c.kv_blocks_used)
            evicted = max(0, uncached - free)  # pulled or computed, the blocks are taken either way
            pollution = self.weights.pollution_weight * evicted * block_size * token_s
        pulled = self.pull_blocks(c, prompt_blocks)
        if pulled:
            block_s = c.block_s if c.block_s is not None else c.block_bytes / DEFAULT_LINK_BYTES_PER_S
            with_pull = seconds - pulled * block_compute_s + DEFAULT_PULL_S + c.pull.lease_s + pulled * block_s
            if with_pull < seconds:
                return PrefillPlan(with_pull, pollution, pulled)
        return PrefillPlan(seconds, pollution)

    @staticmethod
    def pull_blocks(c: Candidate, prompt_blocks: int) -> int:
        """Blocks `c` could pull from its `pull` holder: those the holder has past `c`'s own."""
        if c.pull is None or not c.block_bytes:
            return 0
        return max(0, min(c.pull.blocks, prompt_blocks) - int(c.cached_blocks))

    def decode_cost(self, c: Candidate, prompt_blocks: int = 0, block_size: int = DEFAULT_BLOCK_SIZE) -> float:
        cost = c.running + self.weights.kv_weight * c.kv_usage
        if self.uses_prefix and prompt_blocks:
            held = c.cached_blocks + self.pull_worth(c, prompt_blocks, block_size)
            cost += self.weights.hold_weight * max(0.0, prompt_blocks - held) / prompt_blocks
        return cost

    def pull_worth(self, c: Candidate, prompt_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> float:
        """The blocks `c` could pull from its `pull` holder, in blocks held: each saves its compute less its
        move, so over a link that moves a block slower than it is computed a peer's copy is worth nothing."""
        pulled = self.pull_blocks(c, prompt_blocks)
        if not pulled:
            return 0.0
        token_s, _ = self.speeds(c, block_size)
        block_compute_s = self.weights.overlap_weight * block_size * token_s
        block_s = c.block_s if c.block_s is not None else c.block_bytes / DEFAULT_LINK_BYTES_PER_S
        return pulled * max(0.0, 1.0 - block_s / block_compute_s) if block_compute_s else 0.0

    def pick_prefill(self, candidates: list[Candidate], prompt_blocks: int, key: int | None = None,
                     block_size: int = DEFAULT_BLOCK_SIZE) -> Candidate | None:
        # With a pull on offer the margin is at least one request's fixed cost (the largest learnt): others' work
        # is seen in polls up to a health interval old, so a holder may look one request busier than it is, and
        # each worker's learnt fixed cost is noisy under load; a pull (cheap, a few ms) would then move the
        # prefix away from an idle holder on a phantom.
        pulls = [c for c in candidates if self.pull_blocks(c, prompt_blocks)]
        noise = max((self.speeds(c, block_size)[1] for c in candidates), default=0.0) if pulls else 0.0
        return self._pick("prefill", candidates, lambda c: self.prefill_cost(c, prompt_blocks, block_size),
                          key, lambda best: max(self.weights.tie_ratio * best, noise), min(prompt_blocks, KEY_BLOCKS))

    def pick_decode(self, candidates: list[Candidate], prompt_blocks: int = 0,
                    key: int | None = None, block_size: int = DEFAULT_BLOCK_SIZE) -> Candidate | None:
        return self._pick("decode", candidates, lambda c: self.decode_cost(c, prompt_blocks, block_size),
                          key, lambda best: self.weights.decode_tie, min(prompt_blocks, KEY_BLOCKS))

    def _pick(self, role: str, candidates: list[Candidate], cost, key, tolerance,
              key_blocks: int = KEY_BLOCKS) -> Candidate | None:
        if not candidates:
            return None
        if self.name == "round_robin":
            ordered = sorted(candidates, key=lambda c: c.address)
            turn = self._turns[role]
            self._turns[role] = turn + 1
            return ordered[turn % len(ordered)]
        if self.name == "random":
            return self._random.choice(candidates)
        costs = [(cost(c), c) for c in candidates]
        if key is None:
            return min(costs, key=lambda t: (t[0], t[1].address))[1]
        best = min(t[0] for t in costs)
        bound = best + tolerance(best) + 1e-12
        near = [c for value, c in costs if value <= bound]
        # A holder is one with the key blocks themselves: holding only a header every prompt shares
        # (a chat template, a common system preamble) must not pull every new prefix to one worker.
        holds = self.uses_prefix and key_blocks > 0
        return max(near, key=lambda c: (holds and c.held >= key_blocks, rendezvous_rank(key, c.address)))
