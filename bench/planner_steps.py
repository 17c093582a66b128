"""The SLO planner against static sizings, under a request rate that steps 0.5 -> 3 -> 0.5 req/s.

For each configuration, a fresh `pdserve serve` (Ray-placed workers, --num-threads 1 each, float32)
and one `pdserve loadtest --rate-schedule` (random prompts, same seed for all):
  planner    `--planner` from 1 prefill + 1 decode, at most --max-workers per pool;
  static-2   2 prefill + 2 decode;   static-1   1 prefill + 1 decode.
Every configuration runs with `--planner`: the static ones have min = max so nothing changes, and all
count worker-seconds the same way (`pdserve:planner_worker_seconds_total`: workers asked for or up,
whichever is more, integrated from the load's start to its end).

SLO attainment: the share of requests meeting both SLOs (TTFT <= --slo-ttft-ms and TPOT <= --slo-itl-ms,
the load tester's goodput); also TTFT/ITL p90 per phase, failed requests, and the planner's decisions.

  PYTHONPATH=. .venv/bin/python bench/planner_steps.py [--phases 0.5:60,3:120,0.5:120]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from loadtest.arrivals import parse_schedule  # noqa: E402
from loadtest.chaos.processes import ManagedProcess  # noqa: E402
from loadtest.config import DatasetConfig, LoadTestConfig  # noqa: E402
from loadtest.runner import run  # noqa: E402
from tests.cluster.harness import free_port  # noqa: E402

WORKER_FLAGS = ["--model", "default", "--dtype", "float32", "--num-threads", "1", "--kv-cache-memory-gib", "0.5"]


def worker_seconds(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    found = re.findall(r'^pdserve:planner_worker_seconds_total\{role="(\w+)"\} (\S+)$', text, re.MULTILINE)
    return {role: float(value) for role, value in found}


def one_config(name: str, sizes: tuple[int, int], bounds: tuple[int, int], args, log_dir: Path) -> dict:
    metrics_port = free_port()
    planner = ["--planner", "--min-prefill", str(bounds[0]), "--max-prefill", str(bounds[1]),
               "--min-decode", str(bounds[0]), "--max-decode", str(bounds[1]), "--slo-ttft-ms", str(args.slo_ttft_ms),
               "--slo-itl-ms", str(args.slo_itl_ms), "--interval-s", str(args.interval_s),
               "--window-s", str(3 * args.interval_s), "--scale-up-cooldown-s", str(3 * args.interval_s),
               "--scale-down-cooldown-s", str(6 * args.interval_s), "--scale-down-window-s", str(6 * args.interval_s)]
    log = log_dir / f"{name}.log"
    log.unlink(missing_ok=True)
    proc = ManagedProcess(name, ["serve", "--prefill", str(sizes[0]), "--decode", str(sizes[1]), "--port", "0",
                                 "--metrics-port", str(metrics_port), *WORKER_FLAGS, *planner],
                          log_path=str(log)).start(900)
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        before, started = worker_seconds(url), time.monotonic()
        result = run(LoadTestConfig(
            url=proc.address, dataset=DatasetConfig("random", random_input_len=args.input_len,
                                                    random_output_len=args.output_len),
            rate_schedule=parse_schedule(args.phases), slos={"ttft": args.slo_ttft_ms, "tpot": args.slo_itl_ms},
            seed=args.seed, progress=False, request_timeout_s=600))
        after, elapsed = worker_seconds(url), time.monotonic() - started
    finally:
        proc.stop()
    text = log.read_text()
    s = result.summary
    return {"config": name, "completed": s["completed"], "failed": s["failed"],
            "slo_attainment": s.get("slo_attainment", 0.0), "p90_ttft_ms": s.get("p90_ttft_ms"),
            "p90_itl_ms": s.get("p90_itl_ms"), "duration_s": elapsed,
            "worker_seconds": {r: after[r] - before.get(r, 0.0) for r in after},
            "phases": [{k: p.get(k) for k in ("rate", "completed", "failed", "slo_attainment", "p90_ttft_ms",
                                              "p90_itl_ms")} for p in s["phases"]],
            "decisions": re.findall(r"^planner: (\w+ \d+ -> \d+ \(\w+)", text, re.MULTILINE)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phases", default="0.5:60,3:120,0.5:120")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--slo-ttft-ms", type=float, default=1500.0)
    parser.add_argument("--slo-itl-ms", type=float, default=200.0)
    parser.add_argument("--interval-s", type=float, default=5.0)
    parser.add_argument("--max-workers", type=int, default=2)
    parser.add_argument("--configs", default="planner,static-2,static-1")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="bench/results/planner_steps.json")
    args = parser.parse_args()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="planner-steps-"))
    print(f"serve logs in {log_dir}", flush=True)
    m = args.max_workers
    configs = {"planner": ((1, 1), (1, m)), "static-2": ((m, m), (m, m)), "static-1": ((1, 1), (1, 1))}
    rows = [one_config(name, *configs[name], args, log_dir) for name in args.configs.split(",")]
    print(f"\nload {args.phases} req/s, prompts {args.input_len} tokens, outputs {args.output_len}; SLOs: TTFT "
          f"{args.slo_ttft_ms:g} ms, TPOT {args.slo_itl_ms:g} ms")
    print(f"{'config':>10} {'done':>5} {'failed':>6} {'SLO att.':>8} {'p90 TTFT':>9} {'p90 ITL':>8} "
          f"{'worker-s P':>10} {'worker-s D':>10} {'total':>7}  per phase: attainment / p90 TTFT ms")
    for r in rows:
        ws = r["worker_seconds"]
        phases = "  ".join(f"{p['rate']:g}/s {100 * (p['slo_attainment'] or 0):.0f}% {p['p90_ttft_ms'] or 0:.0f}"
                           for p in r["phases"])
        print(f"{r['config']:>10} {r['completed']:>5} {r['failed']:>6} {100 * r['slo_attainment']:>7.1f}% "
              f"{r['p90_ttft_ms']:>9.0f} {r['p90_itl_ms']:>8.0f} {ws.get('prefill', 0):>10.0f} "
              f"{ws.get('decode', 0):>10.0f} {sum(ws.values()):>7.0f}  {phases}")
    for r in rows:
        if r["decisions"]:
            print(f"{r['config']} decisions: " + "; ".join(r["decisions"]))
    Path(args.output).write_text(json.dumps({"args": vars(args), "results": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
