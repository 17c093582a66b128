"""The console table, the JSON result file and the per-request JSONL file."""
from __future__ import annotations

import json
import math

from loadtest.stats import METRICS, PERCENTILES, RequestRecord

LABELS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
          "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


def table(summary: dict) -> str:
    rows = [("Successful requests", summary["completed"]), ("Failed requests", summary["failed"])]
    for code, n in sorted(summary.get("failures_by_status", {}).items()):
        rows.append((f"  failed: {code}", n))
    rows += [("Request rate (req/s)", summary.get("request_rate", "")),
             ("Max concurrency", summary.get("max_concurrency")),
             ("Benchmark duration (s)", summary["duration"]),
             ("Total input tokens", summary["total_input_tokens"]),
             ("Total generated tokens", summary["total_output_tokens"]),
             ("Request throughput (req/s)", summary["request_throughput"]),
             ("Output token throughput (tok/s)", summary["output_throughput"]),
             ("Total token throughput (tok/s)", summary["total_token_throughput"]),
             ("Prefix hit ratio (%)", 100.0 * summary.get("prefix_hit_ratio", 0.0))]
    if "ideal_prefix_hit_ratio" in summary:
        rows += [("Ideal prefix hit ratio (%)", 100.0 * summary["ideal_prefix_hit_ratio"]),
                 ("Trace sessions", summary.get("num_sessions"))]
    if "slos_ms" in summary:
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in summary["slos_ms"].items())
        rows += [(f"SLO ({slos})", ""), ("Requests meeting every SLO", summary["good_requests"]),
                 ("SLO attainment (%)", 100.0 * summary["slo_attainment"]),
                 ("Request goodput (req/s)", summary["request_goodput"])]
    lines = [_title("Serving Benchmark Result")] + [_row(k, v) for k, v in rows]
    for m in METRICS:
        lines.append(_title(LABELS[m], "-"))
        lines.append(_row(f"Mean {m.upper()} (ms)", summary[f"mean_{m}_ms"]))
        lines += [_row(f"P{p} {m.upper()} (ms)", summary[f"p{p}_{m}_ms"]) for p in PERCENTILES]
    if summary.get("per_turn"):
        lines += turn_table(summary["per_turn"])
    lines.append("=" * 60)
    return "\n".join(lines)


def turn_table(per_turn: dict[str, dict]) -> list[str]:
    """A trace replay's TTFT and ITL (ms) per turn of a session."""
    lines = [_title("By turn of a session (ms)", "-"),
             f"{'turn':>4} {'done':>5} {'hit %':>6} {'TTFT mean':>9} {'p50':>7} {'p99':>7} "
             f"{'ITL mean':>8} {'p50':>6} {'p99':>6}"]
    for turn, t in per_turn.items():
        lines.append(f"{turn:>4} {t['completed']:>5} {100 * t['prefix_hit_ratio']:>6.1f} {t['mean_ttft_ms']:>9.1f} "
                     f"{t['p50_ttft_ms']:>7.1f} {t['p99_ttft_ms']:>7.1f} {t['mean_itl_ms']:>8.1f} "
                     f"{t['p50_itl_ms']:>6.1f} {t['p99_itl_ms']:>6.1f}")
    return lines


def sweep_table(runs: list[dict], target: float, goodput_rate: float | None) -> str:
    lines = [_title("SLO attainment by request rate"),
             f"{'rate (req/s)':>12} {'attainment %':>13} {'p99 TTFT ms':>12} {'p99 TPOT ms':>12} {'failed':>7}"]
    for r in runs:
        lines.append(f"{_num(r['request_rate']):>12} {100 * r['slo_attainment']:>13.1f} {r['p99_ttft_ms']:>12.1f} "
                     f"{r['p99_tpot_ms']:>12.1f} {r['failed']:>7}")
    best = "none" if goodput_rate is None else _num(goodput_rate)
    lines.append(f"goodput (highest rate with >= {100 * target:.0f}% attainment): {best} req/s")
    return "\n".join(lines)


def write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_jsonable(data), f, indent=2)
        f.write("\n")


def write_jsonl(path: str, runs: list[tuple[float, list[RequestRecord]]]) -> None:
    """One line per request: (request rate of its run, record)."""
    with open(path, "w", encoding="utf-8") as f:
        for rate, records in runs:
            for r in records:
                f.write(json.dumps(_jsonable({"request_rate": rate, **r.to_json()})) + "\n")


def _jsonable(x):
    """inf -> "inf" (JSON has no infinity)."""
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_jsonable(v) for v in x]
    return x


def _title(text: str, fill: str = "=") -> str:
    return f" {text} ".center(60, fill)


def _num(v) -> str:
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def _row(key: str, value) -> str:
    return f"{key + ':':<44}{_num(value) if value is not None else '-':>16}"
