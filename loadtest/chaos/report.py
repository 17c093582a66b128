"""The chaos run's report: a table for the terminal, a dict for the JSON file."""
from __future__ import annotations

from collections import Counter


def verdict(report: dict) -> bool:
    """Pass: every request completed, no leak, every faulted worker came back."""
    return (report["requests"]["failed"] == 0 and not report["leaks"]
            and all(f["back_s"] is not None and not f["error"] for f in report["faults"]))


def table(report: dict) -> str:
    req, lat = report["requests"], report["latency_ms"]
    kinds = Counter(f["kind"] for f in report["faults"])
    downtime = [f["back_s"] - f["started_s"] for f in report["faults"] if f["back_s"] is not None]
    migrations = ", ".join(f"{k} {v:g}" for k, v in sorted(report["migrations"].items())) or "none"
    failures = ", ".join(f"{k} {v}" for k, v in sorted(req["failures_by_status"].items()))
    leaks = ", ".join(f"{a} (blocks, requests, leases) {v}" for a, v in report["leaks"].items()) or "none"
    rows = [
        ("cluster", f"{report['num_prefill']} prefill, {report['num_decode']} decode"),
        ("load", f"{report['duration_s']:g} s at {report['request_rate']:g} req/s"),
        ("requests sent", str(req["sent"])),
        ("completed", str(req["completed"])),
        ("failed", f"{req['failed']}" + (f" ({failures})" if failures else "")),
        ("migrations", migrations),
        ("faults", ", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) or "none"),
        ("worker back in rotation after", f"mean {sum(downtime) / len(downtime):.1f} s, max {max(downtime):.1f} s"
         if downtime else "-"),
        ("TTFT p50 / p99 ms", f"{lat['ttft_p50']:.0f} / {lat['ttft_p99']:.0f}"),
        ("ITL p50 / p99 ms", f"{lat['itl_p50']:.0f} / {lat['itl_p99']:.0f}"),
        ("leaks", leaks),
        ("verdict", "PASS" if verdict(report) else "FAIL"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
