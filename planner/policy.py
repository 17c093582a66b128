"""The planner's decisions: how many prefill and decode workers, and why (no I/O).

Each pool is sized on its own: workers = ceil(load / (capacity * target_utilization)), with the
capacity learnt online (planner/capacity.py). Around that:
- up at once (after `scale_up_cooldown_s` since the pool last changed): the load needs more
  workers (once the p90 is within PREDICTIVE_LATENCY_FRACTION of the SLO), the SLO is missed (one
  more while the estimate catches up), or requests wait at the router for a pool whose workers are
  all saturated (decode: or its KV is nearly full);
- down only after `scale_down_window_s` of windows in which fewer workers would have carried the
  load at `scale_down_utilization` (< target: hysteresis), with the SLO met and nothing waiting,
  and `scale_down_cooldown_s` after the last change; to the size the window's peak load needs;
- never outside [min, max]; an SLO below the pool's idle latency adds nothing (it cannot help).
"""
from __future__ import annotations

import dataclasses
import logging
import math

from planner.capacity import CapacityEstimate
from planner.config import PlannerConfig
from planner.observation import Observation
from planner.scaler import ROLES, PoolReplicas

logger = logging.getLogger(__name__)

REASONS = ("below_min", "above_max", "load_above_capacity", "ttft_above_slo", "itl_above_slo", "queue_backlog",
           "kv_usage_high", "load_below_capacity")
SLO_REASON = {"prefill": "ttft_above_slo", "decode": "itl_above_slo"}
PREDICTIVE_LATENCY_FRACTION = 0.6
"""The learnt capacity adds workers ahead of a missed SLO only once the p90 is this close to it (or
requests wait): an online fit extrapolates, and a pool far below its SLO has no need of its prediction."""


@dataclasses.dataclass(frozen=True)
class Decision:
    role: str
    current: int
    desired: int
    reason: str
    detail: str

    @property
    def direction(self) -> str:
        return "up" if self.desired > self.current else "down"


@dataclasses.dataclass
class PoolState:
    capacity: CapacityEstimate
    last_change: float = float("-inf")
    calm_since: float | None = None
    """Since when every window has allowed fewer workers (None: the last one did not)."""
    calm_peak: float = 0.0
    """The highest load since calm_since."""
    needed: int | None = None
    """Workers the last window's load needed at the learnt capacity (None: capacity unknown)."""
    load: float = 0.0
    latency_s: float | None = None
    warned_infeasible: bool = False
    settled: bool = False
    """The last window had no worker starting or leaving."""


class Planner:
    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        self.pools = {role: PoolState(CapacityEstimate(config.slo_s(role))) for role in ROLES}

    def decide(self, obs: Observation, replicas: dict[str, PoolReplicas]) -> list[Decision]:
        """The changes to make after window `obs`, given each pool's current size. Capacity is learnt
        only from settled windows: no worker starting or leaving during them (a window spanning a
        resize mixes two sizes, and where workers share machines a starting one slows the others)."""
        decode_full = obs.queue_length > 0 and obs.pools["decode"].saturated
        settled = all(r.wanted == r.ready for r in replicas.values()) and all(p.steady for p in obs.pools.values())
        decisions = []
        for role in ROLES:
            state, pool = self.pools[role], obs.pools[role]
            latency = pool.latency_s
            if role == "prefill" and latency is not None and decode_full and obs.queue_time_p90_s:
                latency = max(0.0, latency - obs.queue_time_p90_s)  # waiting for decode room is not prefill's
            if settled and latency is not None and pool.requests >= self.config.min_requests and pool.workers > 0:
                state.capacity.observe(pool.per_worker_tokens_per_s, latency, obs.time)
            state.load, state.latency_s = pool.offered_tokens_per_s, latency
            state.settled = settled
            decision = self._decide_pool(role, state, obs, replicas[role].wanted)
            if decision is not None:
                decisions.append(decision)
        return decisions

    def applied(self, decision: Decision, time: float) -> None:
        """The decision was carried out at `time` (a refused one is not: the next window decides again)."""
        state = self.pools[decision.role]
        state.last_change, state.calm_since = time, None

    def _decide_pool(self, role: str, state: PoolState, obs: Observation, current: int) -> Decision | None:
        cfg, pool = self.config, obs.pools[role]
        bounds = cfg.bounds(role)
        if current < bounds.min_workers:
            return Decision(role, current, bounds.min_workers, "below_min", f"{current} < min {bounds.min_workers}")
        if current > bounds.max_workers:
            return Decision(role, current, bounds.max_workers, "above_max", f"{current} > max {bounds.max_workers}")
        capacity = state.capacity.tokens_per_s
        load = pool.offered_tokens_per_s
        state.needed = math.ceil(load / (capacity * cfg.target_utilization)) if capacity else None
        up = self._up(role, state, obs, current)
        since_change = obs.time - state.last_change
        if up is not None:
            state.calm_since = None
            if since_change < cfg.scale_up_cooldown_s or current >= bounds.max_workers:
                return None
            desired, reason, detail = up
            return Decision(role, current, min(max(desired, current + 1), bounds.max_workers), reason, detail)
        if not self._calm(role, state, obs, current):
            state.calm_since = None
            return None
        if state.calm_since is None:
            state.calm_since, state.calm_peak = obs.time, 0.0
        state.calm_peak = max(state.calm_peak, pool.window_tokens_per_s)
        if current <= bounds.min_workers or obs.time - state.calm_since < cfg.scale_down_window_s \
                or since_change < cfg.scale_down_cooldown_s:
            return None
        capacity = state.capacity.safe_tokens_per_s
        fewer = math.ceil(state.calm_peak / (capacity * cfg.scale_down_utilization)) if capacity else 0
        desired = min(current - 1, max(bounds.min_workers, fewer))
        return Decision(role, current, desired, "load_below_capacity",
                        f"peak load {state.calm_peak:.0f} tok/s over {obs.time - state.calm_since:.0f} s fits "
                        f"{desired} workers at {cfg.scale_down_utilization:.0%} of {capacity or 0:.0f} tok/s")

    def _up(self, role: str, state: PoolState, obs: Observation, current: int) -> tuple[int, str, str] | None:
        cfg, pool = self.config, obs.pools[role]
        slo, latency = cfg.slo_s(role), state.latency_s
        missed = latency is not None and latency > slo and pool.requests >= cfg.min_requests
        near = latency is not None and latency >= PREDICTIVE_LATENCY_FRACTION * slo
        if state.needed is not None and state.needed > current and (missed or near or obs.queue_length > 0):
            reason = SLO_REASON[role] if missed else "load_above_capacity"
            return state.needed, reason, (f"load {pool.offered_tokens_per_s:.0f} tok/s needs {state.needed} workers "
                                          f"at {state.capacity.tokens_per_s:.0f} tok/s each")
        if missed and state.capacity.feasible and state.settled:  # a blind step: once the last one shows
            return current + 1, SLO_REASON[role], f"p90 {latency * 1e3:.0f} ms > SLO {slo * 1e3:.0f} ms"
        if missed and not state.capacity.feasible and not state.warned_infeasible:
            logger.warning("planner: %s p90 %.0f ms misses its SLO of %.0f ms, but the pool's idle latency is "
                           "%.0f ms (fitted): more workers cannot meet it (adding none)", role, latency * 1e3,
                           slo * 1e3, (state.capacity.base_latency_s or 0.0) * 1e3)
        state.warned_infeasible = missed and not state.capacity.feasible
        if obs.queue_length > 0 and pool.saturated:
            if role == "decode" and pool.kv_usage >= cfg.kv_usage_high:
                return current + 1, "kv_usage_high", (f"KV {pool.kv_usage:.0%} used, {obs.queue_length:.0f} "
                                                      "requests waiting")
            return current + 1, "queue_backlog", f"{obs.queue_length:.0f} requests wait for a {role} worker"
        return None

    def _calm(self, role: str, state: PoolState, obs: Observation, current: int) -> bool:
        """Whether this window allows fewer workers: the SLO met, nothing waiting, and one worker fewer
        carrying the load at scale_down_utilization (or no load at all)."""
        cfg, pool = self.config, obs.pools[role]
        if obs.queue_length > 0 or (state.latency_s is not None and state.latency_s > cfg.slo_s(role)):
            return False
        load, capacity = pool.window_tokens_per_s, state.capacity.safe_tokens_per_s
        if load <= 0:
            return True
        return capacity is not None and load <= (current - 1) * capacity * cfg.scale_down_utilization
