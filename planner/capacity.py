"""A pool's capacity, learnt online: tokens/s one worker carries with its latency at the SLO.

No offline profiling. Both pools follow one curve: 1/latency falls linearly with the load per
worker x (tokens/s). For prefill that is a queue (TTFT = T0 / (1 - x/mu)); for decode it is a
step whose time grows with the batch (ITL = a + b*batch, batch = x*ITL, so ITL = a / (1 - b*x)).
With T0 the latency of an idle pool, one window's (x, T) gives the load at which the latency
would reach the SLO S:

    c = x * (1/T0 - 1/S) / (1/T0 - 1/T)

which holds on both sides of S, and in overload too (x is then the pool's top rate, and T only
grows). Windows barely above T0 say little; each estimate is weighted by (1 - T0/T) and old ones
fade with a half-life. A window meeting the SLO at load x also proves the capacity is >= x.
"""
from __future__ import annotations

INFORMATIVE = 0.15
"""Windows with T < T0 / (1 - INFORMATIVE) teach only the lower bound."""
BASE_GROWTH_PER_S = 1.5 ** (1 / 600)
"""The idle latency T0 is the lowest seen, creeping up 1.5x per 10 minutes so a heavier mix is relearnt."""
FEASIBLE_MARGIN = 0.95
"""T0 above this fraction of the SLO: no number of workers meets it."""


class CapacityEstimate:
    def __init__(self, slo_s: float, half_life_s: float = 300.0) -> None:
        self.slo_s = slo_s
        self.half_life_s = half_life_s
        self.base_latency_s: float | None = None
        self._estimate: float | None = None
        self._weight = 0.0
        self.proven = 0.0
        """The highest load per worker seen meeting the SLO (fading)."""
        self.samples = 0

    @property
    def feasible(self) -> bool:
        """False once the pool's idle latency is (nearly) the SLO: more workers cannot meet it."""
        return self.base_latency_s is None or self.base_latency_s < FEASIBLE_MARGIN * self.slo_s

    @property
    def tokens_per_s(self) -> float | None:
        """Load per worker at the SLO; None until a window has shown anything."""
        known = [v for v in (self._estimate, self.proven) if v]
        return max(known) if known else None

    def observe(self, load_per_worker: float, latency_s: float, elapsed_s: float) -> None:
        """One window: `load_per_worker` tokens/s served per worker with p90 latency `latency_s`;
        `elapsed_s` since the previous call (for fading)."""
        if latency_s <= 0 or load_per_worker <= 0:
            return
        fade = 0.5 ** (elapsed_s / self.half_life_s)
        base = self.base_latency_s
        base = latency_s if base is None else min(base * BASE_GROWTH_PER_S ** elapsed_s, latency_s)
        self.base_latency_s = base
        self.proven *= fade
        if latency_s <= self.slo_s:
            self.proven = max(self.proven, load_per_worker)
        if not self.feasible or latency_s * (1 - INFORMATIVE) < base:
            return
        inv_base, inv_slo, inv_latency = 1 / base, 1 / self.slo_s, 1 / latency_s
        estimate = load_per_worker * (inv_base - inv_slo) / (inv_base - inv_latency)
        weight = 1 - base / latency_s
        kept = self._weight * fade
        self._estimate = estimate if self._estimate is None else \
            (self._estimate * kept + estimate * weight) / (kept + weight)
        self._weight = kept + weight
        self.samples += 1
