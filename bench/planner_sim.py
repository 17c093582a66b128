"""The SLO planner on simulated pools (tests/planner/cluster_sim.py), where adding a worker adds
capacity: per scenario (ramp, spike, diurnal, prefill-heavy, decode-heavy) the planner from 1 prefill
+ 1 decode against the smallest static sizing meeting both p90 SLOs over the whole run.

Pools (hidden from the planner): a prefill worker serves 4000 prompt tokens/s at most, idle TTFT
0.05 s + prompt/8000 s; a decode worker 2000 tokens/s, idle ITL 20 ms; latency grows as 1/(1 - load/top)
with a lognormal spread (sigma 0.25); a new worker serves 30 s after it is asked for, a removed one
drains 5 s. SLOs: TTFT p90 1.5 s, ITL p90 50 ms; planner interval 10 s, window 30 s, cooldowns 30/60 s.

  PYTHONPATH=. .venv/bin/python bench/planner_sim.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.planner.cluster_sim import p90  # noqa: E402
from tests.planner.test_planner_scenarios import CONFIG, SCENARIOS, planned, smallest_static  # noqa: E402


def main() -> int:
    rows = []
    for scenario in SCENARIOS:
        static = smallest_static(scenario)
        sim, loop = planned(scenario)
        sizes = {"prefill": [s[1] for s in sim.sizes], "decode": [s[2] for s in sim.sizes]}
        rows.append({
            "scenario": scenario.name, "duration_s": scenario.duration_s,
            "static_sizes": {r: max(s[i] for s in static.sizes) for i, r in ((1, "prefill"), (2, "decode"))},
            "static_worker_seconds": sum(static.worker_seconds.values()),
            "planner_worker_seconds": sum(sim.worker_seconds.values()),
            "planner_sizes_min_max": {r: (min(v), max(v)) for r, v in sizes.items()},
            "static_p90_ttft_s": p90(static.ttft_samples), "planner_p90_ttft_s": p90(sim.ttft_samples),
            "static_p90_itl_s": p90(static.itl_samples), "planner_p90_itl_s": p90(sim.itl_samples),
            "decisions": len(loop.decisions)})
    print(f"SLOs: TTFT p90 {CONFIG.slo_ttft_s:g} s, ITL p90 {CONFIG.slo_itl_s * 1e3:g} ms")
    print(f"{'scenario':>14} {'static P/D':>10} {'static w-s':>10} {'planner w-s':>11} {'saved':>6} "
          f"{'planner P':>9} {'planner D':>9} {'p90 TTFT s (static/planner)':>28} {'p90 ITL ms':>14} {'changes':>7}")
    for r in rows:
        saved = 1 - r["planner_worker_seconds"] / r["static_worker_seconds"]
        pmin, pmax = r["planner_sizes_min_max"]["prefill"]
        dmin, dmax = r["planner_sizes_min_max"]["decode"]
        print(f"{r['scenario']:>14} {r['static_sizes']['prefill']:>4}/{r['static_sizes']['decode']:<5} "
              f"{r['static_worker_seconds']:>10.0f} {r['planner_worker_seconds']:>11.0f} {100 * saved:>5.0f}% "
              f"{pmin:>5}..{pmax:<2} {dmin:>5}..{dmax:<2} "
              f"{r['static_p90_ttft_s']:>13.2f} / {r['planner_p90_ttft_s']:<12.2f} "
              f"{1e3 * r['static_p90_itl_s']:>6.1f} / {1e3 * r['planner_p90_itl_s']:<5.1f} {r['decisions']:>7}")
    out = Path("bench/results/planner_sim.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
