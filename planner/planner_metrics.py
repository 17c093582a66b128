"""The planner's own Prometheus metrics: desired vs actual workers, what it learnt, what it did."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from planner.policy import REASONS, Decision, Planner
from planner.scaler import ROLES, PoolReplicas


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.desired = Gauge("pdserve:planner_desired_workers", "Workers the planner wants, per pool", ["role"],
                             registry=registry)
        self.actual = Gauge("pdserve:planner_actual_workers", "Workers up and in rotation, per pool", ["role"],
                            registry=registry)
        self.capacity = Gauge("pdserve:planner_capacity_tokens_per_second",
                              "Learnt load one worker carries at the SLO (prefill: prompt tokens computed, decode: "
                              "tokens generated), per pool; 0 until learnt", ["role"], registry=registry)
        self.load = Gauge("pdserve:planner_load_tokens_per_second",
                          "The pool's load over the last window (served plus the backlog waiting for it)", ["role"],
                          registry=registry)
        self.latency = Gauge("pdserve:planner_latency_p90_seconds",
                             "p90 over the last window: TTFT (prefill), ITL (decode)", ["role"], registry=registry)
        self.slo = Gauge("pdserve:planner_slo_seconds", "The p90 SLO each pool is sized for", ["role"],
                         registry=registry)
        self.decisions = Counter("pdserve:planner_decisions", "Pool size changes, by pool, direction and reason",
                                 ["role", "direction", "reason"], registry=registry)
        self.worker_seconds = Counter("pdserve:planner_worker_seconds", "Worker-seconds spent, per pool (workers "
                                      "asked for or up, whichever is more, integrated over time)", ["role"],
                                      registry=registry)
        self.errors = Counter("pdserve:planner_errors", "Planner intervals that failed (metrics unreadable, scaling "
                              "refused)", ["stage"], registry=registry)
        for role in ROLES:
            for direction in ("up", "down"):
                for reason in REASONS:
                    self.decisions.labels(role, direction, reason)
            self.worker_seconds.labels(role)
        for stage in ("metrics", "scale"):
            self.errors.labels(stage)

    def record(self, planner: Planner, replicas: dict[str, PoolReplicas], desired: dict[str, int],
               decisions: list[Decision], elapsed_s: float) -> None:
        for role in ROLES:
            state = planner.pools[role]
            self.desired.labels(role).set(desired[role])
            self.actual.labels(role).set(replicas[role].ready)
            self.capacity.labels(role).set(state.capacity.tokens_per_s or 0.0)
            self.load.labels(role).set(state.load)
            self.latency.labels(role).set(state.latency_s or 0.0)
            self.slo.labels(role).set(planner.config.slo_s(role))
            self.worker_seconds.labels(role).inc(max(replicas[role].wanted, replicas[role].ready) * elapsed_s)
        for d in decisions:
            self.decisions.labels(d.role, d.direction, d.reason).inc()
