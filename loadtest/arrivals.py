"""When requests are sent: Poisson or gamma inter-arrival times (as `vllm bench serve`)."""
from __future__ import annotations

import math
import random
from collections.abc import Sequence


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times in seconds after the start, one per request, non-decreasing.

    rate = inf: all at 0. Otherwise gaps are gamma-distributed with shape
    `burstiness` and scale 1 / (rate * burstiness), so the mean gap is 1 / rate
    (burstiness 1 is a Poisson process)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    offsets, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, scale)
        offsets.append(t)
    return offsets


def schedule_offsets(schedule: Sequence[tuple[float, float]], burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times for a rate that steps: `(rate, seconds)` phases back to back, each with gamma gaps
    as above at its own rate (the first gap of a phase starts at the phase's start)."""
    rng = random.Random(seed)
    offsets: list[float] = []
    phase_start = 0.0
    for rate, seconds in schedule:
        t, end, scale = phase_start, phase_start + seconds, 1.0 / (rate * burstiness)
        while (t := t + rng.gammavariate(burstiness, scale)) < end:
            offsets.append(t)
        phase_start = end
    return offsets


def parse_schedule(text: str) -> tuple[tuple[float, float], ...]:
    """"0.5:60,3:120,0.5:120" -> ((0.5, 60.0), (3.0, 120.0), (0.5, 120.0)): requests/s for seconds."""
    phases = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            rate, seconds = (float(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"--rate-schedule {text!r}: expected RATE:SECONDS,..., e.g. 0.5:60,3:120") from None
        if not (rate > 0 and seconds > 0 and math.isfinite(rate)):
            raise ValueError(f"--rate-schedule: rate and seconds must be finite and > 0, got {part!r}")
        phases.append((rate, seconds))
    if not phases:
        raise ValueError("--rate-schedule: no phase given")
    return tuple(phases)
