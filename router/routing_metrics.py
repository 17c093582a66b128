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
PULL_OUTCOMES = ("leased", "nothing_held", "lease_failed", "holder_gone")
ERROR_BUCKETS = (-5.0, -1.0, -0.5, -0.25, -0.1, -0.05, -0.025, -0.01, 0.0, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                 5.0, 30.0)


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
        self.hits_by_source = Counter("pdserve:router_prefix_hit_blocks_by_source",
                                      "Prompt blocks the chosen prefill worker did not compute, by where they came "
                                      "from (local: its own cache, on medium; peer: pulled from another worker's "
                                      "device)", ["source", "medium"], registry=registry)
        self.peer_pulls = Counter("pdserve:router_peer_pulls",
                                  "Peer prefix pulls the router planned, by outcome: leased (the holder holds the "
                                  "blocks for the puller), nothing_held (evicted meanwhile), lease_failed, "
                                  "holder_gone; all but leased are computed instead", ["outcome"],
                                  registry=registry)
        for outcome in PULL_OUTCOMES:
            self.peer_pulls.labels(outcome)
        self.ttft_error = Histogram("pdserve:router_ttft_prediction_error_seconds",
                                    "Observed minus predicted seconds from a Prefill call to its first token "
                                    "(the routing policy's prediction for the worker it chose)",
                                    registry=registry, buckets=ERROR_BUCKETS)
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

    def observe_prefill(self, worker, prompt_blocks: int, cached_blocks: int, local_media: dict[str, int],
                        peer_media: dict[str, int] | None = None) -> None:
        """A prefill worker chosen: `cached_blocks` of the prompt held there (`local_media`: by best medium),
        more planned to come from a peer (`peer_media`: by the best medium holding them there)."""
        self.decisions.labels("prefill", worker.address).inc()
        self.query_blocks.inc(prompt_blocks)
        self.hit_blocks.inc(cached_blocks)
        self.observe_hits("local", local_media)
        self.observe_hits("peer", peer_media or {})

    def observe_hits(self, source: str, media: dict[str, int]) -> None:
        """Prompt blocks a worker will not compute, by where they come from ("local", "peer") and medium."""
        for medium, count in media.items():
            if count:
                self.hits_by_source.labels(source, medium).inc(count)

    def observe_prefill_done(self, computed_tokens: int, predicted_s: float, observed_s: float) -> None:
        self.prefill_tokens.inc(max(0, computed_tokens))
        if predicted_s > 0:
            self.ttft_error.observe(observed_s - predicted_s)

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
