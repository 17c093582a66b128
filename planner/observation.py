"""What happened over the last window, per pool, from two router snapshots (no I/O).

The prefill pool is judged by TTFT and loaded by the prompt tokens it computes; the decode pool
by ITL and the tokens it generates. Requests waiting at the router for a worker with room are
load too: they count against the pool whose every worker is saturated.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from planner.router_metrics import RouterSnapshot
from planner.scaler import ROLES

QUANTILE = 0.9


@dataclasses.dataclass
class PoolObservation:
    role: str
    latency_s: float | None
    """TTFT p90 (prefill) or ITL p90 (decode) over the window; None without requests."""
    served_tokens_per_s: float
    """Prompt tokens computed by prefill workers, or tokens generated, per second."""
    offered_tokens_per_s: float
    """served, plus the backlog waiting at the router when this pool is what it waits for."""
    workers: float
    """Workers in rotation, averaged over the window."""
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
    failures: float
    mean_input_tokens: float
    mean_output_tokens: float


def observe(history: Sequence[RouterSnapshot]) -> Observation | None:
    """The window from the first snapshot to the last (None with fewer than two)."""
    if len(history) < 2:
        return None
    first, last = history[0], history[-1]
    span = last.time - first.time
    if span <= 0:
        return None

    def delta(key: str) -> float:
        now, then = last.counters.get(key, 0.0), first.counters.get(key, 0.0)
        return now - then if now >= then else now  # a restarted router counts from 0

    requests = delta("requests")
    prompt, generated = delta("prompt_tokens"), delta("generation_tokens")
    mean_in = prompt / requests if requests else 0.0
    latencies = {"prefill": last.ttft.since(first.ttft), "decode": last.itl.since(first.itl)}
    served = {"prefill": delta("prefill_tokens") / span, "decode": generated / span}
    backlog_tokens = {"prefill": last.queue_length * mean_in,
                      "decode": last.queue_length * (generated / requests if requests else 0.0)}
    pools = {}
    for role in ROLES:
        workers = [w for w in last.pool(role) if w.healthy > 0]
        saturated = bool(workers) and all(w.saturated > 0 for w in workers)
        total = sum(w.kv_blocks_total for w in workers)
        offered = served[role] + (backlog_tokens[role] / span if saturated else 0.0)
        pools[role] = PoolObservation(
            role=role, latency_s=latencies[role].quantile(QUANTILE), served_tokens_per_s=served[role],
            offered_tokens_per_s=offered,
            workers=sum(sum(w.healthy > 0 for w in s.pool(role)) for s in history) / len(history),
            requests=requests, kv_usage=sum(w.kv_blocks_used for w in workers) / total if total else 0.0,
            saturated=saturated, idle_first=[w.address for w in sorted(workers, key=lambda w: w.num_requests)])
    return Observation(time=last.time, window_s=span, pools=pools, queue_length=last.queue_length,
                       queue_time_p90_s=last.queue_time.since(first.queue_time).quantile(QUANTILE),
                       request_rate=requests / span, failures=delta("failures"), mean_input_tokens=mean_in,
                       mean_output_tokens=generated / requests if requests else 0.0)
