"""A pool's capacity, learnt online: tokens/s one worker carries with its latency at the SLO.

No offline profiling. Both pools follow one curve: 1/latency falls linearly with the load per
worker x (tokens/s). For prefill that is a queue (TTFT = T0 / (1 - x/mu)); for decode it is a
step whose time grows with the batch (ITL = a + b*batch, batch = x*ITL, so ITL = a / (1 - b*x)).
So each window gives a point (x, 1/T) on a line 1/T = alpha - beta*x, fitted by least squares
with older windows fading (half-life). The load at which the latency reaches the SLO S is

    c = (alpha - 1/S) / beta

and 1/alpha is the idle latency: when it is (nearly) S, no number of workers meets the SLO.
The fit holds in overload too: x is then the pool's top rate and 1/T falls towards 0, on the
line's far end. It needs loads that differ (windows all at one load say nothing of the slope):
until then the capacity is unknown and the planner adds a worker when the SLO is missed, which
itself moves the load per worker. A window meeting the SLO at load x proves a capacity >= x.
"""
from __future__ import annotations

from collections import deque

MIN_SPREAD = 1.25
"""The loads fitted must span at least this ratio (highest / lowest)."""
FEASIBLE_MARGIN = 0.95
"""An idle latency above this fraction of the SLO: more workers cannot meet it."""


class CapacityEstimate:
    def __init__(self, slo_s: float, half_life_s: float = 600.0, max_samples: int = 120) -> None:
        self.slo_s = slo_s
        self.half_life_s = half_life_s
        self.samples: deque[tuple[float, float, float]] = deque(maxlen=max_samples)
        """(time, load per worker, 1 / latency)."""
        self.proven = 0.0
        """The highest load per worker seen meeting the SLO (fading)."""
        self._proven_at = 0.0
        self._fit: tuple[float, float] | None = None

    def observe(self, load_per_worker: float, latency_s: float, now: float) -> None:
        """One window: `load_per_worker` tokens/s served per worker with p90 latency `latency_s`."""
        if latency_s <= 0 or load_per_worker <= 0:
            return
        self.proven *= 0.5 ** (max(0.0, now - self._proven_at) / self.half_life_s)
        self._proven_at = now
        if latency_s <= self.slo_s:
            self.proven = max(self.proven, load_per_worker)
        self.samples.append((now, load_per_worker, 1.0 / latency_s))
        self._fit = self._least_squares(now)

    def _least_squares(self, now: float) -> tuple[float, float] | None:
        """(alpha, beta) of 1/T = alpha - beta * x, weighted by age; None without spread or slope."""
        xs = [x for _, x, _ in self.samples]
        if len(xs) < 2 or max(xs) < MIN_SPREAD * min(xs):
            return None
        weights = [0.5 ** ((now - t) / self.half_life_s) for t, _, _ in self.samples]
        total = sum(weights)
        mean_x = sum(w * x for w, (_, x, _) in zip(weights, self.samples, strict=True)) / total
        mean_y = sum(w * y for w, (_, _, y) in zip(weights, self.samples, strict=True)) / total
        var = sum(w * (x - mean_x) ** 2 for w, (_, x, _) in zip(weights, self.samples, strict=True))
        cov = sum(w * (x - mean_x) * (y - mean_y) for w, (_, x, y) in zip(weights, self.samples, strict=True))
        if var <= 0 or cov >= 0:
            return None  # latency not rising with load (yet): no slope to read
        beta = -cov / var
        return mean_y + beta * mean_x, beta

    @property
    def base_latency_s(self) -> float | None:
        """The fitted idle latency (None until fitted)."""
        return 1.0 / self._fit[0] if self._fit and self._fit[0] > 0 else None

    @property
    def feasible(self) -> bool:
        """False once the fit says the idle latency is (nearly) the SLO: more workers cannot meet it."""
        base = self.base_latency_s
        return self._fit is None or base is not None and base < FEASIBLE_MARGIN * self.slo_s

    @property
    def tokens_per_s(self) -> float | None:
        """Load per worker at the SLO; None until fitted (a light load alone only proves a lower
        bound, which must not size a pool up: it would chase its own tail)."""
        if self._fit is None or not self.feasible:
            return None
        alpha, beta = self._fit
        return max((alpha - 1.0 / self.slo_s) / beta, self.proven)

    @property
    def safe_tokens_per_s(self) -> float | None:
        """What one worker surely carries: the fitted capacity, else the proven lower bound."""
        return self.tokens_per_s or self.proven or None
