"""The router's routing and admission metrics (registered in the router's registry).

Router-side prefix hit rate = rate(pdserve:router_prefix_hit_blocks_total)
/ rate(pdserve:router_prefix_query_blocks_total): of the full prompt blocks sent
to prefill, how many the chosen worker already held (on any medium), per the KV index.
`pdserve:kv_index_blocks{worker, medium}` is how many blocks the router believes each
worker holds on each medium (device, cpu, disk).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from router.kv_index import KvIndex

QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
REJECT_REASONS = ("queue_full", "queue_timeout")
SKIP_REASONS = ("cached", "slow_link")


class RoutingMetrics:
    def __init__(self, registry: CollectorRegistry, index: KvIndex, queue_length) -> None:
        self.query_blocks = Counter("pdserve:router_prefix_query_blocks",
                                    "Full prompt blocks routed to prefill workers", registry=registry)
        self.hit_blocks = Counter("pdserve:router_prefix_hit_blocks",
                                  "Of those, blocks the chosen worker held (KV index) or was computing for another "
                                  "request",
                                  registry=registry)
        self.prefill_tokens = Counter("pdserve:router_prefill_tokens",
                                      "Prompt tokens prefill workers computed (not found in their prefix cache)",
                                      registry=registry)
        self.decisions = Counter("pdserve:routing_decisions", "Workers chosen, by role", ["role", "worker"],
                                 registry=registry)
        self.skipped_prefill = Counter("pdserve:remote_prefill_skipped",
                                       "Samples the decode worker prefilled itself, by reason: cached (all but a "
                                       "few prompt tokens held there), slow_link (KV would move slower than it "
                                       "is computed)", ["reason"], registry=registry)
        for reason in SKIP_REASONS:
            self.skipped_prefill.labels(reason)
        self.rejected = Counter("pdserve:request_rejected", "Samples refused by admission control, by reason",
                                ["reason"], registry=registry)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        self.queue_time = Histogram("pdserve:request_queue_time_seconds",
                                    "Time a sample waited for a worker with room", registry=registry,
                                    buckets=QUEUE_BUCKETS)
        queue = Gauge("pdserve:router_queue_length", "Samples waiting for a worker with room", registry=registry)
        queue.set_function(queue_length)
        registry.register(_ResyncCollector(index))

    def observe_route(self, route, waited_s: float) -> None:
        self.queue_time.observe(waited_s)
        self.decisions.labels("decode", route.decode.address).inc()
        if route.skip_reason:
            self.skipped_prefill.labels(route.skip_reason).inc()

    def observe_prefill(self, worker, prompt_blocks: int, cached_blocks: int) -> None:
        self.decisions.labels("prefill", worker.address).inc()
        self.query_blocks.inc(prompt_blocks)
        self.hit_blocks.inc(cached_blocks)

    def observe_rejection(self, reason: str) -> None:
        self.rejected.labels(reason).inc()


class _ResyncCollector:
    """The index's own numbers, read at scrape time: resyncs, and blocks per worker and medium."""

    def __init__(self, index: KvIndex) -> None:
        self.index = index

    def collect(self):
        yield CounterMetricFamily("pdserve:kv_index_resyncs", "KV index snapshots loaded (first sync and after gaps)",
                                  value=self.index.num_resyncs)
        blocks = GaugeMetricFamily("pdserve:kv_index_blocks",
                                   "Prefix blocks the router's KV index says each worker holds, by medium",
                                   labels=["worker", "medium"])
        for worker in self.index.workers:
            for medium, count in self.index.num_blocks_by_medium(worker).items():
                blocks.add_metric([worker, medium], count)
        yield blocks
