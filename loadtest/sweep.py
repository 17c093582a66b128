"""Goodput by sweeping the request rate: the highest rate whose SLO attainment stays >= the target."""
from __future__ import annotations

from dataclasses import replace

from loadtest.config import LoadTestConfig
from loadtest.datasets import load_prompts
from loadtest.runner import RunResult, run

ATTAINMENT_TARGET = 0.9


def goodput_rate(runs: list[dict], target: float = ATTAINMENT_TARGET) -> float | None:
    """Highest swept rate whose attainment is >= target (None: no rate met it)."""
    return max((r["request_rate"] for r in runs if r["slo_attainment"] >= target), default=None)


def sweep(config: LoadTestConfig, rates: list[float], on_run=None) -> tuple[list[RunResult], float | None]:
    """Run the same prompts once per rate (ascending); returns the runs and the goodput rate."""
    if not config.slos:
        raise ValueError("a sweep needs SLOs (config.slos)")
    prompts = load_prompts(config.dataset, config.num_prompts + config.num_warmups, config.seed)
    results = []
    for rate in sorted(rates):
        result = run(replace(config, request_rate=rate), prompts)
        results.append(result)
        if on_run is not None:
            on_run(result)
    return results, goodput_rate([r.summary for r in results])
