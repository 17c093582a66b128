"""The planner's settings (`pdserve planner` and `pdserve serve --planner` flags map onto these)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PoolBounds:
    min_workers: int
    max_workers: int


@dataclasses.dataclass
class PlannerConfig:
    slo_ttft_s: float = dataclasses.field(default=2.0, metadata={
        "flag": "--slo-ttft-ms", "unit": "ms", "help": "TTFT p90 SLO the prefill pool is sized for"})
    """The time-to-first-token SLO, at the 90th percentile: what the prefill pool is sized for."""
    slo_itl_s: float = dataclasses.field(default=0.1, metadata={
        "flag": "--slo-itl-ms", "unit": "ms", "help": "ITL p90 SLO the decode pool is sized for"})
    """The inter-token latency SLO, at the 90th percentile: what the decode pool is sized for."""
    interval_s: float = dataclasses.field(default=10.0, metadata={"help": "how often the planner decides"})
    """How often the planner reads the routers and decides."""
    window_s: float = dataclasses.field(default=30.0, metadata={
        "help": "percentiles and rates over this much of the recent past"})
    """Latency percentiles and rates are taken over this much of the recent past (>= interval_s)."""
    min_prefill: int = dataclasses.field(default=1, metadata={"help": "fewest prefill workers"})
    max_prefill: int = dataclasses.field(default=4, metadata={"help": "most prefill workers"})
    min_decode: int = dataclasses.field(default=1, metadata={"help": "fewest decode workers"})
    max_decode: int = dataclasses.field(default=4, metadata={"help": "most decode workers"})
    scale_up_cooldown_s: float = dataclasses.field(default=30.0, metadata={
        "help": "after a change of a pool, no scale-up of it before this"})
    """After a change of a pool, no scale-up of it before this (the new workers start and latency settles)."""
    scale_down_cooldown_s: float = dataclasses.field(default=120.0, metadata={
        "help": "after a change of a pool, no scale-down of it before this"})
    """After a change of a pool, no scale-down of it before this."""
    scale_down_window_s: float = dataclasses.field(default=60.0, metadata={
        "help": "remove a worker only after this long of load the others could carry"})
    """A worker is removed only when every observation of this long says the others can carry its load."""
    target_utilization: float = 0.9
    """Pools are sized so their load is at most this fraction of the learnt capacity at the SLO."""
    scale_down_utilization: float = 0.7
    """Hysteresis: a pool shrinks only if one worker fewer would be loaded at most this much (< target)."""
    kv_usage_high: float = 0.9
    """Decode KV usage above this (with requests waiting at the router) adds a decode worker."""
    min_requests: int = 3
    """Windows with fewer finished requests teach the capacity estimate nothing (too noisy)."""

    def __post_init__(self) -> None:
        for name in ("slo_ttft_s", "slo_itl_s", "interval_s", "window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"planner {name} must be > 0, got {getattr(self, name)}")
        for name in ("scale_up_cooldown_s", "scale_down_cooldown_s", "scale_down_window_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"planner {name} must be >= 0, got {getattr(self, name)}")
        if self.window_s < self.interval_s:
            raise ValueError(f"planner window_s ({self.window_s:g}) must be >= interval_s ({self.interval_s:g})")
        for role in ("prefill", "decode"):
            low, high = getattr(self, f"min_{role}"), getattr(self, f"max_{role}")
            if low < 1 or high < low:
                raise ValueError(f"planner needs 1 <= min_{role} <= max_{role}, got {low} and {high}")
        if not 0 < self.scale_down_utilization < self.target_utilization <= 1:
            raise ValueError("planner needs 0 < scale_down_utilization < target_utilization <= 1, got "
                             f"{self.scale_down_utilization:g} and {self.target_utilization:g}")
        if not 0 < self.kv_usage_high <= 1:
            raise ValueError(f"planner kv_usage_high must be in (0, 1], got {self.kv_usage_high:g}")
        if self.min_requests < 1:
            raise ValueError(f"planner min_requests must be >= 1, got {self.min_requests}")

    def bounds(self, role: str) -> PoolBounds:
        return PoolBounds(getattr(self, f"min_{role}"), getattr(self, f"max_{role}"))

    def slo_s(self, role: str) -> float:
        return self.slo_ttft_s if role == "prefill" else self.slo_itl_s
