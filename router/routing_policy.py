"""How a worker is chosen: one cost formula per role, deterministic tie-breaks. No I/O.

Prefill (policy `prefix`), in KV blocks of work:

    cost = overlap_weight * uncached_prompt_blocks + queued_blocks + request_weight * running

where `uncached_prompt_blocks` is what the worker would have to compute (its
prefix cache, as the KV index knows it, covers the rest), `queued_blocks` the
uncached prompt blocks already waiting there and `running` the requests it
holds. `request_weight` is the fixed cost of one request in blocks of prefill
(attention over its cached context, the LM head, scheduling): measured here
(SmolLM2, CPU) a 1,032-token miss takes 1.05 s and a 32-token suffix over a
cached 1,000-token prefix 0.15 s, i.e. ~0.9 ms per new token plus ~0.12 s per
request = 8 blocks. Without it, a worker holding popular prefixes would pile
up cheap-looking hits until it is the slowest place to send anything. Lowest cost wins;
ties go to the lexicographically smallest address, so every router with the
same view makes the same choice. `least_loaded` is the same formula without
the cache term.

Decode, in requests:

    cost = running + kv_weight * kv_usage_fraction

(decode allocates its own blocks and reuses its own prefix cache, so free KV
and running sequences are what matter).

`round_robin` cycles through the candidates sorted by address; `random` draws.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

POLICIES = ("prefix", "least_loaded", "round_robin", "random")


@dataclass
class Candidate:
    address: str
    queued_blocks: float = 0.0
    """Prompt blocks (tokens / block size) waiting for prefill on the worker."""
    running: int = 0
    """Requests the worker holds."""
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    cached_blocks: int = 0
    """Leading prompt blocks the worker already holds (from the KV index)."""

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass
class RoutingWeights:
    overlap_weight: float = 1.0
    """Prefill: cost of one uncached prompt block relative to one block of queued work."""
    kv_weight: float = 4.0
    """Decode: cost of a full KV pool, in running requests."""
    request_weight: float = 8.0
    """Prefill: fixed cost of one request, in blocks of prompt."""

    def __post_init__(self) -> None:
        if self.overlap_weight < 0 or self.kv_weight < 0 or self.request_weight < 0:
            raise ValueError("routing weights must be >= 0")


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

    def prefill_cost(self, c: Candidate, prompt_blocks: int) -> float:
        load = c.queued_blocks + self.weights.request_weight * c.running
        if not self.uses_prefix:
            return load
        return self.weights.overlap_weight * (prompt_blocks - c.cached_blocks) + load

    def decode_cost(self, c: Candidate) -> float:
        return c.running + self.weights.kv_weight * c.kv_usage

    def pick_prefill(self, candidates: list[Candidate], prompt_blocks: int) -> Candidate | None:
        return self._pick("prefill", candidates, lambda c: self.prefill_cost(c, prompt_blocks))

    def pick_decode(self, candidates: list[Candidate]) -> Candidate | None:
        return self._pick("decode", candidates, self.decode_cost)

    def _pick(self, role: str, candidates: list[Candidate], cost) -> Candidate | None:
        if not candidates:
            return None
        if self.name == "round_robin":
            ordered = sorted(candidates, key=lambda c: c.address)
            turn = self._turns[role]
            self._turns[role] = turn + 1
            return ordered[turn % len(ordered)]
        if self.name == "random":
            return self._random.choice(candidates)
        return min(candidates, key=lambda c: (cost(c), c.address))
