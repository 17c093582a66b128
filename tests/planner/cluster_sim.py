"""A simulated cluster for the planner's tests: pools of workers with a true capacity the planner
never sees, exporting the router's metrics as Prometheus text, and a Scaler over it.

Per pool: a worker serves at most `top_rate` tokens/s; with load x per worker its latency is
base / (1 - x / top_rate) (a queue for prefill, a batch growing with load for decode), times a
lognormal spread per request, plus the wait of any backlog (load beyond the pool's rate). A new
worker serves `start_s` after it is asked for; a removed one drains for `drain_s`. Worker-seconds
count every worker from its start to the end of its drain.
"""
from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from planner.scaler import ROLES, PoolReplicas
from router.metrics import LATENCY_BUCKETS, TOKEN_LATENCY_BUCKETS

SPREAD = 0.25
"""Sigma of the lognormal spread of one request's latency around the pool's."""
ITL_SAMPLES_PER_TOKEN = 0.1


@dataclasses.dataclass(frozen=True)
class PoolModel:
    top_rate: float
    """Tokens/s one worker serves at most."""
    base_latency_s: float
    """Latency of an idle worker (prefill: for the mean prompt; decode: one step)."""
    start_s: float = 30.0
    drain_s: float = 5.0


@dataclasses.dataclass(frozen=True)
class Load:
    rate: float
    """Requests/s."""
    input_len: int
    output_len: int


@dataclasses.dataclass
class SimWorker:
    ready_at: float
    leaving_at: float | None = None


class SimCluster:
    def __init__(self, models: dict[str, PoolModel], sizes: dict[str, int], seed: int = 0) -> None:
        self.models = models
        self.rng = random.Random(seed)
        self.now = 0.0
        self.workers = {role: [SimWorker(0.0) for _ in range(sizes[role])] for role in ROLES}
        self.backlog = {role: 0.0 for role in ROLES}
        self.worker_seconds = {role: 0.0 for role in ROLES}
        self.ttft_samples: list[float] = []
        self.itl_samples: list[float] = []
        self.sizes: list[tuple[float, int, int]] = []
        self._served = {role: 0.0 for role in ROLES}
        registry = self.registry = CollectorRegistry()
        self._ttft = Histogram("pdserve:time_to_first_token_seconds", "", registry=registry, buckets=LATENCY_BUCKETS)
        self._itl = Histogram("pdserve:decode_inter_token_latency_seconds", "", registry=registry,
                              buckets=TOKEN_LATENCY_BUCKETS)
        self._requests = Counter("pdserve:request_success", "", registry=registry)
        self._arrivals = Counter("pdserve:request_arrivals", "", registry=registry)
        self._prompt = Counter("pdserve:prompt_tokens", "", registry=registry)
        self._generated = Counter("pdserve:generation_tokens", "", registry=registry)
        self._prefilled = Counter("pdserve:router_prefill_tokens", "", registry=registry)
        registry.register(_WorkerGauges(self))

    # ---- what the planner sees -------------------------------------------------
    def metrics_text(self) -> list[str]:
        return [generate_latest(self.registry).decode()]

    def serving(self, role: str) -> int:
        return sum(w.ready_at <= self.now and w.leaving_at is None for w in self.workers[role])

    # ---- time ------------------------------------------------------------------
    def step(self, load: Load, dt: float = 1.0) -> None:
        """Advance `dt` seconds under `load`."""
        arrivals = _poisson(self.rng, load.rate * dt)
        latency = {}
        for role, tokens_per_request in (("prefill", load.input_len), ("decode", load.output_len)):
            latency[role] = self._serve(role, load.rate * tokens_per_request, dt)
        for _ in range(arrivals):
            ttft = latency["prefill"] * math.exp(self.rng.gauss(0, SPREAD))
            self._ttft.observe(ttft)
            self.ttft_samples.append(ttft)
        generated = self._served["decode"]
        for _ in range(round(generated * ITL_SAMPLES_PER_TOKEN)):
            itl = latency["decode"] * math.exp(self.rng.gauss(0, SPREAD))
            self._itl.observe(itl)
            self.itl_samples.append(itl)
        self._requests.inc(arrivals)
        self._arrivals.inc(arrivals)
        self._prompt.inc(arrivals * load.input_len)
        self._prefilled.inc(self._served["prefill"])
        self._generated.inc(generated)
        for role in ROLES:
            alive = [w for w in self.workers[role] if w.leaving_at is None or w.leaving_at > self.now]
            self.worker_seconds[role] += len(alive) * dt
            self.workers[role] = alive
        self.now += dt
        self.sizes.append((self.now, self.serving("prefill"), self.serving("decode")))

    def _serve(self, role: str, offered: float, dt: float) -> float:
        """Serve one step of `role`'s load; returns the latency a request sees now."""
        model, n = self.models[role], max(self.serving(role), 0)
        capacity = n * model.top_rate
        demand = offered * dt + self.backlog[role]
        served = min(demand, capacity * dt)
        self.backlog[role] = demand - served
        self._served[role] = served
        if capacity <= 0:
            return 1e3
        utilization = min(offered / capacity, 0.95)
        return model.base_latency_s / (1 - utilization) + self.backlog[role] / capacity

    # ---- scaling -----------------------------------------------------------------
    def resize(self, role: str, replicas: int) -> None:
        active = [w for w in self.workers[role] if w.leaving_at is None]
        for _ in range(replicas - len(active)):
            self.workers[role].append(SimWorker(self.now + self.models[role].start_s))
        starting_first = sorted(active, key=lambda w: -w.ready_at)
        for worker in starting_first[:max(0, len(active) - replicas)]:
            worker.leaving_at = self.now + (self.models[role].drain_s if worker.ready_at <= self.now else 0.0)


class SimScaler:
    """The Scaler (planner/scaler.py) of a SimCluster."""

    def __init__(self, cluster: SimCluster) -> None:
        self.cluster = cluster

    def replicas(self) -> dict[str, PoolReplicas]:
        c = self.cluster
        return {role: PoolReplicas(sum(w.leaving_at is None for w in c.workers[role]), c.serving(role))
                for role in ROLES}

    def scale(self, role: str, replicas: int, idle_first: Sequence[str] = ()) -> None:
        self.cluster.resize(role, replicas)


class _WorkerGauges:
    def __init__(self, cluster: SimCluster) -> None:
        self.cluster = cluster

    def collect(self):
        healthy = GaugeMetricFamily("pdserve:worker_healthy", "", labels=["worker", "role"])
        used = GaugeMetricFamily("pdserve:worker_kv_blocks_used", "", labels=["worker", "role"])
        total = GaugeMetricFamily("pdserve:worker_kv_blocks_total", "", labels=["worker", "role"])
        c = self.cluster
        for role in ROLES:
            for i, w in enumerate(c.workers[role]):
                if w.ready_at <= c.now and w.leaving_at is None:
                    address = [f"10.0.{ROLES.index(role)}.{i}:5000", role]
                    healthy.add_metric(address, 1.0)
                    used.add_metric(address, 10.0)
                    total.add_metric(address, 100.0)
        yield from (healthy, used, total)


def _poisson(rng: random.Random, mean: float) -> int:
    """Knuth's method (means here are small)."""
    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def p90(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def run(models: dict[str, PoolModel], load_at: Callable[[float], Load], duration_s: float,
        sizes: dict[str, int], on_interval: Callable[[SimCluster], None] | None = None, interval_s: float = 10.0,
        seed: int = 0) -> SimCluster:
    """Simulate `duration_s` seconds from `sizes`; `on_interval` (the planner) runs every `interval_s`."""
    cluster = SimCluster(models, sizes, seed)
    while cluster.now < duration_s:
        if on_interval is not None and cluster.now % interval_s == 0:
            on_interval(cluster)
        cluster.step(load_at(cluster.now))
    return cluster
