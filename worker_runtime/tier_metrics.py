"""Prometheus families of the worker's KV tiers (host memory, disk), one series per medium."""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from engine.kv_offload.tier_stats import LOAD_BUCKETS

# (metric name, stats key, help)
TIER_GAUGES = [
    ("kv_tier_capacity_bytes", "capacity_bytes", "Bytes a KV tier below the device pool can hold"),
    ("kv_tier_used_bytes", "used_bytes", "Bytes of prefix blocks a KV tier holds"),
]
TIER_COUNTERS = [
    ("kv_tier_hits", "hits", "Prefix blocks found in a KV tier (past the blocks found above it)"),
    ("kv_tier_misses", "misses", "Prefix blocks looked up in a KV tier and not found there"),
    ("kv_tier_stored_bytes", "bytes_stored", "Bytes of blocks written down into a KV tier"),
    ("kv_tier_loaded_bytes", "bytes_loaded", "Bytes of blocks loaded back from a KV tier into the device pool"),
    ("kv_tier_refused_blocks", "num_refused", "Disk tier blocks refused at load (checksum mismatch) and dropped"),
]


def tier_families(tiers: dict[str, dict], labels: list[str]):
    """Families for `tiers` (engine.kv_tier_stats(): medium -> counters) with the worker's label values."""
    names = ["role", "worker", "medium"]
    for metric_name, key, doc in TIER_GAUGES:
        family = GaugeMetricFamily(f"pdserve:{metric_name}", doc, labels=names)
        for medium, stats in tiers.items():
            family.add_metric([*labels, medium], float(stats[key]))
        yield family
    for metric_name, key, doc in TIER_COUNTERS:
        family = CounterMetricFamily(f"pdserve:{metric_name}", doc, labels=names)
        for medium, stats in tiers.items():
            family.add_metric([*labels, medium], float(stats[key]))
        yield family
    latency = HistogramMetricFamily("pdserve:kv_tier_load_seconds",
                                    "One load of a request's prefix blocks from a KV tier into the device pool",
                                    labels=names)
    for medium, stats in tiers.items():
        cumulative, buckets = 0, []
        for bound, count in zip((*LOAD_BUCKETS, float("inf")), stats["load_counts"], strict=True):
            cumulative += count
            buckets.append((str(bound) if bound != float("inf") else "+Inf", float(cumulative)))
        latency.add_metric([*labels, medium], buckets, stats["load_seconds"])
    yield latency
