"""The router's Prometheus metrics (names: vLLM's with a `pdserve:` prefix).

Request-level figures are observed as responses stream through the router;
per-worker gauges (`worker` and `role` labels) come from the workers' stats,
polled by the WorkerPool.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from common.metrics_http import MetricsServer
from router.migration import MigrationReason
from router.worker_pool import WorkerPool

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.75, 1.0, 1.25,
                   1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
"""vLLM's TTFT/E2E buckets plus finer ones between 0.1 and 4 s, where CPU latencies fall."""
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                         0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class WorkerStatsCollector:
    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def collect(self):
        gauges = {
            "kv_blocks_used": GaugeMetricFamily(
                "pdserve:worker_kv_blocks_used",
                "KV blocks held by running requests or transfer leases (free prefix-cache blocks excluded)",
                labels=["worker", "role"]),
            "kv_blocks_total": GaugeMetricFamily("pdserve:worker_kv_blocks_total", "KV blocks in the worker's pool",
                                                 labels=["worker", "role"]),
            "num_requests": GaugeMetricFamily("pdserve:worker_num_requests",
                                              "Requests the worker holds (queued, running, transferring, leased)",
                                              labels=["worker", "role"]),
        }
        healthy = GaugeMetricFamily("pdserve:worker_healthy", "1 while the worker is in rotation",
                                    labels=["worker", "role"])
        saturated = GaugeMetricFamily("pdserve:worker_saturated", "1 while the worker is at its request limit "
                                      "(new requests wait for another)", labels=["worker", "role"])
        token_s = GaugeMetricFamily("pdserve:router_prefill_token_seconds",
                                    "Learnt seconds per uncached prompt token of each prefill worker (the routing "
                                    "policy's prediction)", labels=["worker"])
        request_s = GaugeMetricFamily("pdserve:router_prefill_request_seconds",
                                      "Learnt fixed seconds per request of each prefill worker", labels=["worker"])
        link = GaugeMetricFamily("pdserve:router_kv_link_bytes_per_second",
                                 "Learnt bandwidth of KV pulls into each worker (from prefill workers into a decode "
                                 "worker, from peers into a prefill worker); absent until timed",
                                 labels=["worker", "role"])
        for w in self.pool.workers:
            if w.role == "prefill":
                token_s.add_metric([w.address], w.speed.token_s)
                request_s.add_metric([w.address], w.speed.request_s)
            if w.link.bytes_per_s:
                link.add_metric([w.address, w.role], w.link.bytes_per_s)
            healthy.add_metric([w.address, w.role], 1.0 if w.healthy else 0.0)
            saturated.add_metric([w.address, w.role], 0.0 if w.has_room else 1.0)
            if w.stats is not None:
                for name, family in gauges.items():
                    family.add_metric([w.address, w.role], float(getattr(w.stats, name)))
        yield from gauges.values()
        yield healthy
        yield saturated
        yield token_s
        yield request_s
        yield link


class RouterMetrics:
    def __init__(self, pool: WorkerPool) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(WorkerStatsCollector(pool))
        self.ttft = Histogram("pdserve:time_to_first_token_seconds", "Time from request arrival to its first token",
                              registry=self.registry, buckets=LATENCY_BUCKETS)
        self.itl = Histogram("pdserve:inter_token_latency_seconds",
                             "Gap between consecutive chunks of a request as the router relays them",
                             registry=self.registry, buckets=TOKEN_LATENCY_BUCKETS)
        self.decode_itl = Histogram("pdserve:decode_inter_token_latency_seconds",
                                    "Gaps between chunks after a request's second one: decode steps only (the "
                                    "first gap holds the prefill -> decode hand-off and KV pull); what the "
                                    "planner sizes the decode pool by", registry=self.registry,
                                    buckets=TOKEN_LATENCY_BUCKETS)
        self.tpot = Histogram("pdserve:request_time_per_output_token_seconds",
                              "(e2e latency - TTFT) / (output tokens - 1), per request with 2+ tokens",
                              registry=self.registry, buckets=TOKEN_LATENCY_BUCKETS)
        self.cancelled = Counter("pdserve:request_cancelled", "Requests ended by the client (cancel, deadline) "
                                 "or by an Abort call", registry=self.registry)
        self.e2e = Histogram("pdserve:e2e_request_latency_seconds", "Time from arrival to the last token",
                             registry=self.registry, buckets=LATENCY_BUCKETS)
        self.arrivals = Counter("pdserve:request_arrivals", "Samples accepted for generation, counted on arrival "
                                "(the demand, where request_success is what was served)", registry=self.registry)
        self.success = Counter("pdserve:request_success", "Finished samples by finish reason",
                               ["finished_reason"], registry=self.registry)
        self.failures = Counter("pdserve:request_failure", "Requests ended by an error, by gRPC status code",
                                ["code"], registry=self.registry)
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens of finished samples",
                                     registry=self.registry)
        self.generation_tokens = Counter("pdserve:generation_tokens", "Generated tokens", registry=self.registry)
        self.migrations = Counter("pdserve:request_migrations", "Samples moved to another decode worker after "
                                  "their decode stream broke, by reason (router/migration.py)", ["reason"],
                                  registry=self.registry)
        for reason in MigrationReason:
            self.migrations.labels(reason.value)

    def serve(self, host: str, port: int) -> MetricsServer:
        """Start the /metrics HTTP server in a thread."""
        return MetricsServer(self.registry, host, port)
