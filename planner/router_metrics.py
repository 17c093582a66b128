"""The routers' Prometheus text, summed into one cumulative snapshot (no I/O).

The planner reads what every router exports (router/metrics.py, router/routing_metrics.py):
counters and histogram buckets add up across routers; a worker's gauges are taken once (every
router polls the same workers, so the first router listing a worker is kept).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families

TTFT = "pdserve:time_to_first_token_seconds"
ITL = "pdserve:decode_inter_token_latency_seconds"
"""Decode steps only: the first gap after the first token is the hand-off from prefill, not decode's."""
QUEUE_TIME = "pdserve:request_queue_time_seconds"
COUNTERS = {
    "requests": "pdserve:request_success",
    "arrivals": "pdserve:request_arrivals",
    "prompt_tokens": "pdserve:prompt_tokens",
    "generation_tokens": "pdserve:generation_tokens",
    "prefill_tokens": "pdserve:router_prefill_tokens",
    "prefix_query_blocks": "pdserve:router_prefix_query_blocks",
    "prefix_hit_blocks": "pdserve:router_prefix_hit_blocks",
}
WORKER_GAUGES = {
    "healthy": "pdserve:worker_healthy",
    "kv_blocks_used": "pdserve:worker_kv_blocks_used",
    "kv_blocks_total": "pdserve:worker_kv_blocks_total",
    "num_requests": "pdserve:worker_num_requests",
    "saturated": "pdserve:worker_saturated",
}


@dataclasses.dataclass
class Histogram:
    """Cumulative bucket counts by upper bound (the last is +Inf)."""

    bounds: tuple[float, ...] = ()
    counts: tuple[float, ...] = ()

    def add(self, other: Histogram) -> Histogram:
        if not self.bounds:
            return other
        if other.bounds and other.bounds != self.bounds:
            raise ValueError("routers export different histogram buckets")
        return Histogram(self.bounds, tuple(a + b for a, b in zip(self.counts, other.counts, strict=True)))

    def since(self, earlier: Histogram) -> Histogram:
        """The observations made after `earlier` (a counter reset, e.g. a restarted router, counts from 0)."""
        if not earlier.bounds or earlier.bounds != self.bounds or earlier.counts[-1] > self.counts[-1]:
            return self
        return Histogram(self.bounds, tuple(a - b for a, b in zip(self.counts, earlier.counts, strict=True)))

    @property
    def count(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear within the bucket; None without observations."""
        total = self.count
        if total <= 0:
            return None
        rank = q * total
        lower_bound, lower_count = 0.0, 0.0
        for bound, count in zip(self.bounds, self.counts, strict=True):
            if count >= rank:
                if bound == float("inf"):
                    return lower_bound  # beyond the last finite bucket: its bound is all we know
                share = (rank - lower_count) / (count - lower_count) if count > lower_count else 1.0
                return lower_bound + (bound - lower_bound) * share
            lower_bound, lower_count = bound, count
        return lower_bound


@dataclasses.dataclass
class WorkerGauges:
    address: str
    role: str
    healthy: float = 0.0
    kv_blocks_used: float = 0.0
    kv_blocks_total: float = 0.0
    num_requests: float = 0.0
    saturated: float = 0.0


@dataclasses.dataclass
class RouterSnapshot:
    """Every router's figures at one moment, summed."""

    time: float
    ttft: Histogram = dataclasses.field(default_factory=Histogram)
    itl: Histogram = dataclasses.field(default_factory=Histogram)
    queue_time: Histogram = dataclasses.field(default_factory=Histogram)
    counters: dict[str, float] = dataclasses.field(default_factory=dict)
    queue_length: float = 0.0
    workers: dict[str, WorkerGauges] = dataclasses.field(default_factory=dict)

    def pool(self, role: str) -> list[WorkerGauges]:
        return [w for w in self.workers.values() if w.role == role]


def parse_router_metrics(texts: Iterable[str], time: float) -> RouterSnapshot:
    """One snapshot from the /metrics text of each router."""
    snap = RouterSnapshot(time)
    for text in texts:
        _add_router(snap, text)
    return snap


def _add_router(snap: RouterSnapshot, text: str) -> None:
    histograms = {TTFT: "ttft", ITL: "itl", QUEUE_TIME: "queue_time"}
    counter_keys = {name: key for key, name in COUNTERS.items()}
    gauge_keys = {name: key for key, name in WORKER_GAUGES.items()}
    seen: dict[str, WorkerGauges] = {}
    for family in text_string_to_metric_families(text):
        name = family.name
        if name in histograms:
            buckets = sorted((float(s.labels["le"]), s.value) for s in family.samples if s.name.endswith("_bucket"))
            hist = Histogram(tuple(b for b, _ in buckets), tuple(c for _, c in buckets))
            attr = histograms[name]
            setattr(snap, attr, getattr(snap, attr).add(hist))
        elif name in counter_keys:  # the parser drops the `_total` suffix from counter family names
            total = sum(s.value for s in family.samples if s.name.endswith("_total"))
            key = counter_keys[name]
            snap.counters[key] = snap.counters.get(key, 0.0) + total
        elif name == "pdserve:router_queue_length":
            snap.queue_length += sum(s.value for s in family.samples)
        elif name in gauge_keys:
            for s in family.samples:
                address, role = s.labels.get("worker", ""), s.labels.get("role", "")
                worker = seen.setdefault(address, WorkerGauges(address, role))
                setattr(worker, gauge_keys[name], s.value)
    for address, worker in seen.items():
        snap.workers.setdefault(address, worker)
