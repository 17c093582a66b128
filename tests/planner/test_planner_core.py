"""The planner's pure core: reading the routers' metrics, one window's observation, the capacity fit,
the decision rules (bounds, cooldowns, hysteresis, infeasible SLOs, queue and KV pressure), the loop."""
from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from planner.capacity import CapacityEstimate
from planner.config import PlannerConfig
from planner.loop import PlannerLoop
from planner.observation import observe
from planner.planner_metrics import PlannerMetrics
from planner.policy import Planner
from planner.router_metrics import Histogram as Buckets
from planner.router_metrics import parse_router_metrics
from planner.scaler import PoolReplicas


class FakeRouter:
    """A router's registry with the metrics the planner reads."""

    def __init__(self, workers: dict[str, tuple[str, dict]]) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram("pdserve:time_to_first_token_seconds", "", registry=self.registry,
                              buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0))
        self.itl = Histogram("pdserve:decode_inter_token_latency_seconds", "", registry=self.registry,
                             buckets=(0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2))
        self.counters = {name: Counter(f"pdserve:{name}", "", registry=self.registry) for name in (
            "request_success", "request_arrivals", "prompt_tokens", "generation_tokens", "router_prefill_tokens",
            "router_prefix_query_blocks", "router_prefix_hit_blocks")}
        self.workers = workers
        self.registry.register(self)

    def collect(self):
        families = {}
        for name in ("healthy", "kv_blocks_used", "kv_blocks_total", "num_requests", "saturated"):
            family = families[name] = GaugeMetricFamily(f"pdserve:worker_{name}", "", labels=["worker", "role"])
            for address, (role, values) in self.workers.items():
                family.add_metric([address, role], values.get(name, 0.0))
        yield from families.values()

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def test_two_routers_sum_and_a_worker_counts_once():
    workers = {"10.0.0.1:1": ("decode", {"healthy": 1, "kv_blocks_used": 30, "kv_blocks_total": 100})}
    a, b = FakeRouter(workers), FakeRouter(workers)
    for router, ttfts in ((a, (0.05, 0.3)), (b, (0.7, 1.5))):
        for value in ttfts:
            router.ttft.observe(value)
        router.counters["request_success"].inc(2)
    snap = parse_router_metrics([a.text(), b.text()], time=0)
    assert snap.counters["requests"] == 4
    assert snap.ttft.counts == (1, 1, 2, 2, 2, 3, 3, 4, 4, 4, 4)
    assert snap.ttft.quantile(0.5) == pytest.approx(0.3)  # the 2nd of 4: all of (0.2, 0.3]
    assert snap.ttft.quantile(0.9) == pytest.approx(1.0 + 0.6 * 0.5)  # 3.6 of 4: 60% into (1, 1.5]
    assert list(snap.workers) == ["10.0.0.1:1"] and snap.workers["10.0.0.1:1"].kv_blocks_used == 30


def test_a_restarted_router_counts_from_zero():
    earlier = Buckets((0.1, math.inf), (5, 9))
    assert Buckets((0.1, math.inf), (1, 2)).since(earlier).counts == (1, 2)
    assert Buckets((0.1, math.inf), (6, 12)).since(earlier).counts == (1, 3)
    assert Buckets((0.1, math.inf), (0, 0)).quantile(0.9) is None


def test_demand_is_arrivals_times_uncached_tokens_and_differs_from_served():
    workers = {"p": ("prefill", {"healthy": 1}), "d": ("decode", {"healthy": 1, "kv_blocks_used": 50,
                                                                  "kv_blocks_total": 200})}
    router = FakeRouter(workers)
    first = parse_router_metrics([router.text()], time=0)
    c = router.counters
    c["request_arrivals"].inc(40)  # 4/s asked for over 10 s ...
    c["request_success"].inc(20)  # ... 2/s finished
    c["prompt_tokens"].inc(20 * 500)
    c["generation_tokens"].inc(20 * 100)
    c["router_prefill_tokens"].inc(20 * 250)
    c["router_prefix_query_blocks"].inc(40)
    c["router_prefix_hit_blocks"].inc(20)  # half the prompt blocks were cached
    for _ in range(20):
        router.ttft.observe(0.3)
    obs = observe([first, parse_router_metrics([router.text()], time=10)])
    prefill, decode = obs.pools["prefill"], obs.pools["decode"]
    assert obs.request_rate == 4
    assert prefill.served_tokens_per_s == 500 and prefill.offered_tokens_per_s == 4 * 500 * 0.5
    assert decode.served_tokens_per_s == 200 and decode.offered_tokens_per_s == 400
    assert decode.kv_usage == 0.25 and prefill.steady and prefill.workers == 1
    assert prefill.latency_s == pytest.approx(0.29)  # all 20 in (0.2, 0.3]: the 18th is 90% into it


def synthetic_latency(load: float, base: float = 0.2, top: float = 1000.0) -> float:
    return base / (1 - load / top)


def test_capacity_fit_finds_the_load_at_the_slo():
    slo = 1.0
    est = CapacityEstimate(slo)
    est.observe(300, synthetic_latency(300), now=0)
    assert est.tokens_per_s is None and est.proven == 300  # one load: no slope yet, only a lower bound
    for i, load in enumerate((500, 700, 900, 950)):
        est.observe(load, synthetic_latency(load), now=10 * (i + 1))
    assert est.tokens_per_s == pytest.approx(1000 * (1 - 0.2 / slo), rel=0.01)  # 800
    assert est.base_latency_s == pytest.approx(0.2, rel=0.01)
    assert est.feasible


def test_an_slo_below_the_idle_latency_is_infeasible():
    est = CapacityEstimate(slo_s=0.15)
    for i, load in enumerate((100, 400, 800)):
        est.observe(load, synthetic_latency(load), now=i)
    assert not est.feasible and est.tokens_per_s is None


CONFIG = PlannerConfig(slo_ttft_s=1.0, slo_itl_s=0.1, interval_s=10, window_s=30, min_prefill=1, max_prefill=4,
                       min_decode=1, max_decode=3, scale_up_cooldown_s=30, scale_down_cooldown_s=60,
                       scale_down_window_s=60)


class ScriptedCluster:
    """Routers whose windows the test writes: per pool a load, a latency p90, a worker count."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.sizes = dict(sizes)
        self.now = 0.0
        self.router = FakeRouter({})
        self.scaled: list[tuple[str, int]] = []
        self.fail_scale = False
        self.queue = 0
        self._set_workers()

    def window(self, seconds: float, prefill_tokens_per_s: float, ttft: float, decode_tokens_per_s: float = 10.0,
               itl: float = 0.02, queue: int = 0, kv_usage: float = 0.1, saturated: bool = False) -> None:
        rate = 2.0
        c = self.router.counters
        for _ in range(int(seconds)):
            c["request_arrivals"].inc(rate)
            c["request_success"].inc(rate)
            c["prompt_tokens"].inc(prefill_tokens_per_s)
            c["router_prefill_tokens"].inc(prefill_tokens_per_s)
            c["generation_tokens"].inc(decode_tokens_per_s)
            for _ in range(int(rate)):
                self.router.ttft.observe(ttft * 0.95)
                self.router.itl.observe(itl * 0.95)
        self._set_workers(kv_usage, saturated)
        self.queue = queue
        self.now += seconds

    def _set_workers(self, kv_usage: float = 0.1, saturated: bool = False) -> None:
        self.router.workers = {f"{role}-{i}": (role, {"healthy": 1, "kv_blocks_used": 100 * kv_usage,
                                                      "kv_blocks_total": 100, "saturated": float(saturated)})
                               for role in ("prefill", "decode") for i in range(self.sizes[role])}

    def text(self) -> list[str]:
        return [self.router.text() + f"# TYPE pdserve:router_queue_length gauge\n"
                                     f"pdserve:router_queue_length {self.queue}\n"]

    def replicas(self) -> dict[str, PoolReplicas]:
        return {role: PoolReplicas(n, n) for role, n in self.sizes.items()}

    def scale(self, role: str, replicas: int, idle_first=()) -> None:
        if self.fail_scale:
            raise RuntimeError("403 Forbidden")
        self.scaled.append((role, replicas))
        self.sizes[role] = replicas


def loop_for(cluster: ScriptedCluster, config: PlannerConfig = CONFIG, metrics=None) -> PlannerLoop:
    return PlannerLoop(config, cluster.text, cluster, metrics, clock=lambda: cluster.now)


def test_a_missed_slo_adds_a_worker_then_waits_for_the_cooldown_and_a_settled_window():
    cluster = ScriptedCluster({"prefill": 1, "decode": 1})
    loop = loop_for(cluster)
    loop.tick()
    changes = []
    for _ in range(6):
        cluster.window(10, 100, ttft=2.5)
        changes += [(cluster.now, d.role, d.desired, d.reason) for d in loop.tick()]
    # 10: first step; 40 is past the 30 s cooldown, but its window still spans the change; 50 is settled
    assert changes == [(10, "prefill", 2, "ttft_above_slo"), (50, "prefill", 3, "ttft_above_slo")]


def test_never_beyond_max_or_below_min():
    cluster = ScriptedCluster({"prefill": 4, "decode": 0})
    loop = loop_for(cluster)
    loop.tick()
    cluster.window(10, 100, ttft=2.5)
    decisions = loop.tick()
    assert [(d.role, d.desired, d.reason) for d in decisions] == [("decode", 1, "below_min")]
    assert cluster.sizes["prefill"] == 4  # at max: the missed SLO adds nothing


def test_an_infeasible_slo_stops_the_blind_steps():
    """A missed SLO with the capacity unknown adds one worker, then waits for a settled window to see
    what it did; once the fit says the idle latency itself misses the SLO, it adds nothing more."""
    cluster = ScriptedCluster({"prefill": 1, "decode": 1})
    loop = loop_for(cluster, PlannerConfig(**{**CONFIG.__dict__, "slo_itl_s": 0.015}))
    loop.tick()
    cluster.window(30, 100, ttft=0.2, decode_tokens_per_s=400, itl=synthetic_latency(400, 0.02, 2000))
    assert [(d.role, d.desired) for d in loop.tick()] == [("decode", 2)]
    for pool_load in (400, 2000, 3000, 1000, 2500, 400):  # per worker: half
        cluster.window(30, 100, ttft=0.2, decode_tokens_per_s=pool_load,
                       itl=synthetic_latency(pool_load / 2, 0.02, 2000))
        assert loop.tick() == []
    assert not loop.planner.pools["decode"].capacity.feasible


def test_decode_kv_full_with_requests_waiting_adds_decode():
    cluster = ScriptedCluster({"prefill": 1, "decode": 1})
    loop = loop_for(cluster)
    loop.tick()
    cluster.window(10, 100, ttft=0.3, queue=5, kv_usage=0.95, saturated=True)
    reasons = {d.role: d.reason for d in loop.tick()}
    assert reasons == {"decode": "kv_usage_high", "prefill": "queue_backlog"}


def test_scale_down_waits_for_a_calm_window_and_the_cooldown_and_never_flaps():
    cluster = ScriptedCluster({"prefill": 3, "decode": 1})
    loop = loop_for(cluster)
    loop.tick()
    # learn the curve: ttft = 0.2 / (1 - x / 1000) per worker
    for load in (300, 600, 650, 450):
        cluster.window(30, 3 * load, ttft=synthetic_latency(load))
        assert loop.tick() == []
    capacity = loop.planner.pools["prefill"].capacity.tokens_per_s
    assert capacity == pytest.approx(800, rel=0.1)
    # steady load a bit under what 2 workers carry at the scale-down utilisation: 3 stay (hysteresis)
    per_worker = 2 * capacity * CONFIG.scale_down_utilization * 1.15 / 3
    for _ in range(12):
        cluster.window(10, 3 * per_worker, ttft=synthetic_latency(per_worker))
        assert loop.tick() == []
    # the load falls to a third of one worker: fewer workers, only after the scale-down window of calm,
    # to what the window's peak needs, one cooldown apart
    start, changes = cluster.now, []
    for _ in range(20):
        cluster.window(10, 300, ttft=synthetic_latency(300 / cluster.sizes["prefill"]))
        changes += [(cluster.now, d.desired, d.reason) for d in loop.tick()]
    assert {reason for _, _, reason in changes} == {"load_below_capacity"}
    assert changes[0][0] >= start + CONFIG.scale_down_window_s
    assert all(b[0] - a[0] >= CONFIG.scale_down_cooldown_s for a, b in zip(changes, changes[1:], strict=False))
    assert [desired for _, desired, _ in changes][-1] == 1 and len(changes) <= 2


def test_a_failed_scale_is_counted_and_retried_next_interval():
    cluster = ScriptedCluster({"prefill": 1, "decode": 1})
    metrics = PlannerMetrics(CollectorRegistry())
    loop = loop_for(cluster, metrics=metrics)
    loop.tick()
    cluster.fail_scale = True
    cluster.window(10, 100, ttft=2.5)
    assert loop.tick() == []
    assert metrics.errors.labels("scale")._value.get() == 1
    cluster.fail_scale = False
    cluster.window(10, 100, ttft=2.5)
    assert [(d.role, d.desired) for d in loop.tick()] == [("prefill", 2)]
    assert metrics.decisions.labels("prefill", "up", "ttft_above_slo")._value.get() == 1
    assert metrics.desired.labels("prefill")._value.get() == 2


def test_unreadable_metrics_are_counted_not_raised():
    metrics = PlannerMetrics(CollectorRegistry())

    def broken() -> list[str]:
        raise ConnectionError("no router metrics could be read")

    loop = PlannerLoop(CONFIG, broken, ScriptedCluster({"prefill": 1, "decode": 1}), metrics, clock=lambda: 0.0)
    assert loop.tick() == []
    assert metrics.errors.labels("metrics")._value.get() == 1


@pytest.mark.parametrize("change,message", [
    ({"slo_ttft_s": 0}, "slo_ttft_s"),
    ({"window_s": 5}, "window_s"),
    ({"min_decode": 0}, "min_decode"),
    ({"max_prefill": 0}, "min_prefill <= max_prefill"),
    ({"scale_down_utilization": 0.95}, "scale_down_utilization < target_utilization"),
])
def test_config_is_validated(change, message):
    with pytest.raises(ValueError, match=message):
        PlannerConfig(**{**PlannerConfig().__dict__, **change})


def test_planner_object_has_a_pool_per_role():
    assert set(Planner(CONFIG).pools) == {"prefill", "decode"}
