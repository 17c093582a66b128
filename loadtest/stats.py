"""Per-request timings and the run's summary (pure Python).

Definitions (vLLM `vllm bench serve`, all client-side):
  TTFT  send -> first chunk carrying tokens
  ITL   every gap between consecutive chunks of a request, pooled over requests
  TPOT  (E2EL - TTFT) / (output_tokens - 1), per request with >= 2 output tokens
  E2EL  send -> end of the stream
A request is good when it succeeded and meets every SLO; attainment = good /
(completed + failed); request_goodput = good / duration.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")
TURN_BUCKETS = 4
"""Trace replays report turns 0, 1, 2 and 3+ apart."""


@dataclass
class RequestRecord:
    """What the client saw of one request (times in seconds, perf_counter clock)."""

    index: int
    prompt_len: int
    scheduled_time: float = 0.0
    """When the arrival process meant to send it (before waiting for a concurrency slot or an earlier turn)."""
    offset_s: float = 0.0
    """When it was due, in seconds after the run's start."""
    send_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    end_time: float = 0.0
    output_tokens: int = 0
    status: str = "OK"
    """gRPC status code name; "OK" for a request that completed."""
    error: str = ""
    cached_tokens: int = 0
    """Prompt tokens the server reused from its prefix cache (its usage.cached_tokens)."""
    session_id: str | None = None
    """Trace replays: the request's session and its turn index in it."""
    turn: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.send_time if self.chunk_times else None

    @property
    def e2el(self) -> float:
        return self.end_time - self.send_time

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2 or self.ttft is None:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        return {"index": self.index, "status": self.status, "error": self.error, "prompt_len": self.prompt_len,
                "output_len": self.output_tokens, "ttft_ms": _ms(self.ttft), "tpot_ms": _ms(self.tpot),
                "e2el_ms": _ms(self.e2el) if self.ok else None, "itls_ms": [_ms(x) for x in self.itls],
                "start_time": self.send_time, "send_lag_ms": _ms(self.send_time - self.scheduled_time),
                "cached_tokens": self.cached_tokens, "session_id": self.session_id, "turn": self.turn}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        return 0.0
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def describe(values_ms: list[float], name: str) -> dict[str, float]:
    """mean_/median_/std_/p50_/p90_/p99_{name}_ms (0 for an empty list, as vLLM)."""
    n = len(values_ms)
    mean = sum(values_ms) / n if n else 0.0
    std = math.sqrt(sum((v - mean) ** 2 for v in values_ms) / n) if n else 0.0
    out = {f"mean_{name}_ms": mean, f"median_{name}_ms": percentile(values_ms, 50), f"std_{name}_ms": std}
    out.update({f"p{p}_{name}_ms": percentile(values_ms, p) for p in PERCENTILES})
    return out


def meets_slos(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    if not record.ok:
        return False
    values = {"ttft": record.ttft, "tpot": record.tpot, "e2el": record.e2el}
    return all(values[k] is None or values[k] * 1000.0 <= limit for k, limit in slos_ms.items())


def metric_values_ms(records: list[RequestRecord]) -> dict[str, list[float]]:
    """Each metric's samples in ms over the completed requests (ITL pooled)."""
    done = [r for r in records if r.ok]
    return {"ttft": [r.ttft * 1000.0 for r in done if r.ttft is not None],
            "tpot": [r.tpot * 1000.0 for r in done if r.tpot is not None],
            "itl": [x * 1000.0 for r in done for x in r.itls],
            "e2el": [r.e2el * 1000.0 for r in done]}


def summarize(records: list[RequestRecord], duration: float, slos_ms: dict[str, float]) -> dict:
    """The run's figures, named as `vllm bench serve` names them where the concept is the same."""
    done = [r for r in records if r.ok]
    total_in = sum(r.prompt_len for r in done)
    total_out = sum(r.output_tokens for r in done)
    duration = max(duration, 1e-9)
    out: dict = {
        "duration": duration, "completed": len(done), "failed": len(records) - len(done),
        "failures_by_status": dict(Counter(r.status for r in records if not r.ok)),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(done) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "total_cached_tokens": sum(r.cached_tokens for r in done), "prefix_hit_ratio": prefix_hit_ratio(done),
    }
    for name, values in metric_values_ms(records).items():
        out.update(describe(values, name))
    if slos_ms:
        good = sum(meets_slos(r, slos_ms) for r in records)
        out.update({"slos_ms": dict(slos_ms), "good_requests": good,
                    "slo_attainment": good / len(records) if records else 0.0,
                    "request_goodput": good / duration})
    return out


def prefix_hit_ratio(records: list[RequestRecord]) -> float:
    """Cached prompt tokens / prompt tokens over the completed requests (0.0 for none)."""
    done = [r for r in records if r.ok]
    total = sum(r.prompt_len for r in done)
    return sum(r.cached_tokens for r in done) / total if total else 0.0


def turn_bucket(turn: int | None) -> str:
    """"0", "1", "2" or "3+" (a request without a turn counts as a first turn)."""
    turn = turn or 0
    return str(turn) if turn < TURN_BUCKETS - 1 else f"{TURN_BUCKETS - 1}+"


def per_turn(records: list[RequestRecord]) -> dict[str, dict]:
    """Per turn bucket with requests: completed, prefix_hit_ratio, and mean/p50/p99 of TTFT and ITL in ms."""
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(turn_bucket(r.turn), []).append(r)
    out = {}
    for bucket in sorted(groups, key=lambda b: int(b.rstrip("+"))):
        mine = groups[bucket]
        values = metric_values_ms(mine)
        row: dict = {"requests": len(mine), "completed": sum(r.ok for r in mine), "prefix_hit_ratio":
                     prefix_hit_ratio(mine)}
        for m in ("ttft", "itl"):
            d = describe(values[m], m)
            row.update({k: d[k] for k in (f"mean_{m}_ms", f"p50_{m}_ms", f"p99_{m}_ms")})
        out[bucket] = row
    return out


def phase_summaries(records: list[RequestRecord], schedule, slos_ms: dict[str, float]) -> list[dict]:
    """summarize() per phase of a rate schedule, the requests grouped by when they were due to be sent."""
    out, phase_start = [], 0.0
    for rate, seconds in schedule:
        end = phase_start + seconds
        mine = [r for r in records if phase_start <= r.offset_s < end]
        out.append({"rate": rate, "start_s": phase_start, "end_s": end, **summarize(mine, seconds, slos_ms)})
        phase_start = end
    return out
