"""PNG plots: latency CDFs of one run, SLO attainment against request rate for a sweep."""
from __future__ import annotations

from pathlib import Path

from loadtest.stats import METRICS, RequestRecord, metric_values_ms


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_cdfs(records: list[RequestRecord], path: Path, slos_ms: dict[str, float]) -> Path:
    """One panel per metric (TTFT, TPOT, ITL, E2EL): empirical CDF, SLO as a dashed line."""
    plt = _pyplot()
    values = metric_values_ms(records)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, name in zip(axes.flat, METRICS, strict=True):
        xs = sorted(values[name])
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post")
        if name in slos_ms:
            ax.axvline(slos_ms[name], color="red", linestyle="--", label=f"SLO {slos_ms[name]:g} ms")
            ax.legend(loc="lower right")
        ax.set_xlabel(f"{name.upper()} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_attainment(runs: list[dict], path: Path, target: float) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["request_rate"] for r in runs], [100 * r["slo_attainment"] for r in runs], marker="o")
    ax.axhline(100 * target, color="red", linestyle="--", label=f"{100 * target:.0f}% target")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
