"""What happened over the last window, per pool, from two router snapshots (no I/O).

The prefill pool is judged by TTFT and loaded by the prompt tokens it computes; the decode pool
by ITL and the tokens it generates. What a pool served (its throughput, which the capacity is
learnt from) differs from what it is asked (the demand it must be sized for) while it is
overloaded or draining a backlog: the demand is the arrival rate times the tokens a request
brings (mean prompt tokens not found in a prefix cache; mean tokens generated).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from planner.router_metrics import RouterSnapshot
from planner.scaler import ROLES

QUANTILE = 0.9
RECENT_MIN_ARRIVALS = 5
"""The last interval's arrival rate counts only with at least this many arrivals in it."""


@dataclasses.dataclass
class PoolObservation:
    role: str
    latency_s: float | None
    """TTFT p90 (prefill) or decode ITL p90 (decode: without the hand-off gap) over the window; None
    without requests."""
    served_tokens_per_s: float
    """Prompt tokens computed by prefill workers, or tokens generated, per second."""
    offered_tokens_per_s: float
    """The demand: arrivals/s times the tokens each brings to this pool (served, without finished requests),
    at the higher of the window's and the last interval's arrival rate (what a scale-up answers)."""
    window_tokens_per_s: float
    """The same at the window's arrival rate only (steadier: what a scale-down is judged on)."""
    workers: float
    """Workers in rotation, averaged over the window."""
    steady: bool
    """The same number of workers in rotation all through the window."""
    requests: float
    """Requests finished in the window."""
    kv_usage: float
    """KV blocks held / blocks, over the pool's workers in rotation, now."""
    saturated: bool
    """Every worker in rotation is at its request limit, now."""
    idle_first: list[str]
    """Its workers in rotation, fewest requests first."""

    @property
    def per_worker_tokens_per_s(self) -> float:
        return self.served_tokens_per_s / self.workers if self.workers > 0 else 0.0


@dataclasses.dataclass
class Observation:
    time: float
    window_s: float
    pools: dict[str, PoolObservation]
    queue_length: float
    queue_time_p90_s: float | None
    request_rate: float
    """Arrivals/s the demand is computed from."""


def _delta(first: RouterSnapshot, last: RouterSnapshot, key: str) -> float:
    now, then = last.counters.get(key, 0.0), first.counters.get(key, 0.0)
    return now - then if now >= then else now  # a restarted router counts from 0


def observe(history: Sequence[RouterSnapshot]) -> Observation | None:
    """The window from the first snapshot to the last (None with fewer than two). Latencies, the
    served rates and the mean lengths are the window's; the arrival rate is the higher of the
    window's and the last interval's (between the last two snapshots), so a rise counts at once."""
    if len(history) < 2:
        return None
    first, last = history[0], history[-1]
    span = last.time - first.time
    if span <= 0:
        return None

    def delta(key: str) -> float:
        return _delta(first, last, key)

    requests = delta("requests")
    recent, recent_arrivals = last.time - history[-2].time, _delta(history[-2], last, "arrivals")
    window_rate = delta("arrivals") / span
    arrival_rate = window_rate
    if recent > 0 and recent_arrivals >= RECENT_MIN_ARRIVALS:  # fewer: too few to tell a rise from noise
        arrival_rate = max(window_rate, recent_arrivals / recent)
    prompt, generated, prefilled = delta("prompt_tokens"), delta("generation_tokens"), delta("prefill_tokens")
    mean_in = prompt / requests if requests else 0.0
    mean_out = generated / requests if requests else 0.0
    # The share of prompt tokens prefill computes, from the routing decisions (counted on arrival at
    # prefill, so a backlog does not skew it as a ratio of tokens served to tokens finished would).
    queried = delta("prefix_query_blocks")
    uncached = 1.0 - min(1.0, delta("prefix_hit_blocks") / queried) if queried else 1.0
    latencies = {"prefill": last.ttft.since(first.ttft), "decode": last.itl.since(first.itl)}
    served = {"prefill": prefilled / span, "decode": generated / span}
    tokens = {"prefill": mean_in * uncached, "decode": mean_out}
    counts = {role: [sum(w.healthy > 0 for w in s.pool(role)) for s in history] for role in ROLES}
    pools = {}
    for role in ROLES:
        workers = [w for w in last.pool(role) if w.healthy > 0]
        saturated = bool(workers) and all(w.saturated > 0 for w in workers)
        total = sum(w.kv_blocks_total for w in workers)
        known = requests and window_rate
        pools[role] = PoolObservation(
            role=role, latency_s=latencies[role].quantile(QUANTILE), served_tokens_per_s=served[role],
            offered_tokens_per_s=arrival_rate * tokens[role] if known else served[role],
            window_tokens_per_s=window_rate * tokens[role] if known else served[role],
            workers=sum(counts[role]) / len(history), steady=min(counts[role]) == max(counts[role]),
            requests=requests, kv_usage=sum(w.kv_blocks_used for w in workers) / total if total else 0.0,
            saturated=saturated, idle_first=[w.address for w in sorted(workers, key=lambda w: w.num_requests)])
    return Observation(time=last.time, window_s=span, pools=pools, queue_length=last.queue_length,
                       queue_time_p90_s=last.queue_time.since(first.queue_time).quantile(QUANTILE),
                       request_rate=arrival_rate)
