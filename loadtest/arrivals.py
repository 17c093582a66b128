"""When requests are sent: Poisson or gamma inter-arrival times (as `vllm bench serve`)."""
from __future__ import annotations

import math
import random


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
