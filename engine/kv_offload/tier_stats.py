"""Counters of one KV tier, read by the worker's metrics (per medium)."""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

LOAD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
"""Upper bounds (seconds) of the load-latency histogram."""


@dataclass
class TierStats:
    capacity_bytes: int
    queries: int = 0
    """Blocks looked up in this tier (past the blocks found above it)."""
    hits: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    num_refused: int = 0
    """Disk: blocks whose bytes failed their checksum when loaded (dropped, recomputed)."""
    load_counts: list[int] = field(default_factory=lambda: [0] * (len(LOAD_BUCKETS) + 1))
    load_seconds: float = 0.0

    def observe_load(self, seconds: float) -> None:
        self.load_counts[bisect_left(LOAD_BUCKETS, seconds)] += 1
        self.load_seconds += seconds

    def snapshot(self, used_bytes: int) -> dict:
        return {"capacity_bytes": self.capacity_bytes, "used_bytes": used_bytes, "queries": self.queries,
                "hits": self.hits, "misses": self.queries - self.hits, "bytes_stored": self.bytes_stored,
                "bytes_loaded": self.bytes_loaded, "num_refused": self.num_refused,
                "load_counts": list(self.load_counts), "load_seconds": self.load_seconds}
