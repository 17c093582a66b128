"""The planner's decisions on simulated load (tests/planner/cluster_sim.py): ramp, spike, diurnal, and
prefill-heavy vs decode-heavy mixes. In each, the planner starts from one worker per pool, never sees
the pools' true capacity, and must meet both p90 SLOs over the whole run with fewer worker-seconds
than the smallest static sizing that also meets them."""
from __future__ import annotations

import dataclasses
import math

import pytest

from planner.config import PlannerConfig
from planner.loop import PlannerLoop
from planner.scaler import ROLES
from tests.planner.cluster_sim import Load, PoolModel, SimCluster, SimScaler, p90, run

CONFIG = PlannerConfig(slo_ttft_s=1.5, slo_itl_s=0.05, interval_s=10, window_s=30, min_prefill=1, max_prefill=8,
                       min_decode=1, max_decode=8, scale_up_cooldown_s=30, scale_down_cooldown_s=60,
                       scale_down_window_s=60)
DECODE = PoolModel(top_rate=2000.0, base_latency_s=0.02)


def prefill_model(input_len: int) -> PoolModel:
    return PoolModel(top_rate=4000.0, base_latency_s=0.05 + input_len / 8000.0)


def steps(*phases: tuple[float, float]):
    """(seconds, rate) phases back to back; the last one holds."""
    def rate_at(t: float) -> float:
        for seconds, rate in phases:
            if t < seconds:
                return rate
            t -= seconds
        return phases[-1][1]
    return rate_at


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    rate_at: object
    input_len: int
    output_len: int
    duration_s: float

    def load_at(self, t: float) -> Load:
        return Load(self.rate_at(t), self.input_len, self.output_len)

    @property
    def models(self) -> dict[str, PoolModel]:
        return {"prefill": prefill_model(self.input_len), "decode": DECODE}


SCENARIOS = [
    Scenario("ramp", lambda t: 1.0 + 9.0 * min(t, 900.0) / 900.0, 1000, 200, 1500),
    Scenario("spike", steps((600, 2.0), (300, 6.0), (900, 2.0)), 1000, 200, 1800),
    Scenario("diurnal", lambda t: 5.0 + 4.0 * math.sin(2 * math.pi * t / 1200), 1000, 200, 2400),
    Scenario("prefill_heavy", steps((500, 1.0), (600, 6.0), (700, 1.0)), 2000, 20, 1800),
    Scenario("decode_heavy", steps((500, 1.0), (600, 6.0), (700, 1.0)), 100, 1000, 1800),
]


def meets_slo(cluster: SimCluster) -> bool:
    return p90(cluster.ttft_samples) <= CONFIG.slo_ttft_s and p90(cluster.itl_samples) <= CONFIG.slo_itl_s


def smallest_static(scenario: Scenario) -> SimCluster:
    """The static sizing with the fewest workers meeting both SLOs (the pools do not interact in the
    simulation, so each is the smallest count meeting its own SLO with the other pool at its max)."""
    counts = {}
    for role, slo, samples in (("prefill", CONFIG.slo_ttft_s, "ttft_samples"),
                               ("decode", CONFIG.slo_itl_s, "itl_samples")):
        other = "decode" if role == "prefill" else "prefill"
        for n in range(1, CONFIG.bounds(role).max_workers + 1):
            sim = run(scenario.models, scenario.load_at, scenario.duration_s, {role: n, other: 8})
            if p90(getattr(sim, samples)) <= slo:
                counts[role] = n
                break
        else:
            pytest.fail(f"{scenario.name}: no static {role} size meets its SLO")
    return run(scenario.models, scenario.load_at, scenario.duration_s, counts)


def planned(scenario: Scenario, config: PlannerConfig = CONFIG) -> tuple[SimCluster, PlannerLoop]:
    holder = {}

    def plan(cluster: SimCluster) -> None:
        if "loop" not in holder:
            holder["loop"] = PlannerLoop(config, cluster.metrics_text, SimScaler(cluster), clock=lambda: cluster.now)
        holder["loop"].tick()

    sim = run(scenario.models, scenario.load_at, scenario.duration_s, {"prefill": 1, "decode": 1},
              on_interval=plan, interval_s=config.interval_s)
    return sim, holder["loop"]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_planner_meets_the_slo_with_fewer_worker_seconds_than_static(scenario):
    static = smallest_static(scenario)
    sim, loop = planned(scenario)
    assert meets_slo(static)
    assert p90(sim.ttft_samples) <= CONFIG.slo_ttft_s, (p90(sim.ttft_samples), loop.decisions)
    assert p90(sim.itl_samples) <= CONFIG.slo_itl_s, (p90(sim.itl_samples), loop.decisions)
    planned_total, static_total = sum(sim.worker_seconds.values()), sum(static.worker_seconds.values())
    assert planned_total < static_total, (planned_total, static_total, loop.decisions)
    # no flapping: every change of a pool is at least a cooldown after the previous one
    for role in ROLES:
        times = [r.time for r in loop.decisions if r.decision.role == role]
        assert all(b - a >= CONFIG.scale_up_cooldown_s for a, b in zip(times, times[1:], strict=False))


@pytest.mark.parametrize("heavy,light", [("prefill_heavy", "decode"), ("decode_heavy", "prefill")])
def test_a_mix_scales_the_pool_it_loads_and_leaves_the_other(heavy, light):
    scenario = next(s for s in SCENARIOS if s.name == heavy)
    sim, loop = planned(scenario)
    grown = "prefill" if light == "decode" else "decode"
    column = {"prefill": 1, "decode": 2}
    assert max(size[column[grown]] for size in sim.sizes) >= 3
    assert max(size[column[light]] for size in sim.sizes) == 1, [r.decision for r in loop.decisions]
    # back down after the busy phase
    assert sim.sizes[-1][column[grown]] <= 2, loop.decisions


def test_capacity_is_learnt_close_to_the_truth():
    """Prefill: the load per worker at which the TTFT p90 meets the SLO, from the model's curve and
    its spread, against what the planner learnt from the ramp."""
    scenario = SCENARIOS[0]
    _, loop = planned(scenario)
    model = scenario.models["prefill"]
    p90_factor = math.exp(1.2816 * 0.25)
    truth = model.top_rate * (1 - model.base_latency_s * p90_factor / CONFIG.slo_ttft_s)
    learnt = loop.planner.pools["prefill"].capacity.tokens_per_s
    assert truth * 0.75 <= learnt <= truth * 1.25, (learnt, truth)
