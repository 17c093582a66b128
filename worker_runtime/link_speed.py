"""What a decode worker's KV pulls cost: seconds = fixed_s + bytes * s_per_byte, learnt from its pulls.

Two exponentially weighted averages (weight ``alpha`` on the newest pull), as the router's prefill
speed: pulls of at least ``LONG_BYTES`` update the per-byte cost (their time less the fixed part,
per byte), shorter ones the fixed part (connection, request/grant round trip, queueing). Routers
read both from the worker's stats and keep a prompt on the decode worker when moving its KV would
take longer than computing it there (a slow or long link, router/worker_selector.py).
"""
from __future__ import annotations

LONG_BYTES = 4 << 20


class PullSpeed:
    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self.fixed_s = 0.0
        self.s_per_byte = 0.0
        """0 until a long pull was seen (routers then assume the link is no constraint)."""
        self._seen_long = self._seen_short = False

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        if nbytes >= LONG_BYTES:
            value = max(seconds - self.fixed_s, 0.5 * seconds) / nbytes
            a = self.alpha if self._seen_long else 1.0
            self.s_per_byte += a * (value - self.s_per_byte)
            self._seen_long = True
        else:
            value = max(seconds - nbytes * self.s_per_byte, 0.0)
            a = self.alpha if self._seen_short else 1.0
            self.fixed_s += a * (value - self.fixed_s)
            self._seen_short = True

    def seconds(self, nbytes: int) -> float:
        """Predicted time of a pull of ``nbytes``."""
        return self.fixed_s + nbytes * self.s_per_byte
