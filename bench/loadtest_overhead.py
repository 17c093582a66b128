"""The load tester's own overhead, against a fake Generation server with known delays.

`python -m loadtest.fake_server` (its own process, so it does not share the
load tester's GIL) answers every request with --output-len one-token chunks:
the first after --ttft-ms, the next --itl-ms apart. No model, no router: what
the load tester measures beyond those delays is its own (and gRPC's) overhead.
For each request rate the load tester (in this process, as `pdserve loadtest`
runs it) sends --num-prompts random-token prompts at Poisson arrivals and
reports achieved request throughput, how late requests left against their
scheduled arrival (send lag), measured TTFT / ITL / TPOT against the injected
delays, and the CPU the load tester and the fake server used (a share of one
core: on a shared 2-core machine, what limits the rate is CPU).

  PYTHONPATH=. .venv/bin/python bench/loadtest_overhead.py [--rates 100,200,300] [--num-prompts 2000]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from loadtest.config import DatasetConfig, LoadTestConfig
from loadtest.runner import run
from loadtest.stats import percentile

RESULTS = Path(__file__).resolve().parent / "results"


def start_fake(ttft_ms: float, itl_ms: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "loadtest.fake_server", "--ttft-ms", str(ttft_ms),
                             "--itl-ms", str(itl_ms)], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    match = re.search(r"ready: .* at (\S+)", line)
    if not match:
        proc.kill()
        raise SystemExit(f"fake server did not start: {line!r}")
    return proc, match.group(1)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(address: str, server_pid: int, rate: float, args) -> dict:
    dataset = DatasetConfig(name="random", random_input_len=args.input_len, random_output_len=args.output_len)
    config = LoadTestConfig(url=address, dataset=dataset, num_prompts=args.num_prompts, request_rate=rate,
                            num_warmups=20, progress=False)
    cpu0, server0 = time.process_time(), cpu_seconds(server_pid)
    result = run(config)
    cpu, server_cpu = time.process_time() - cpu0, cpu_seconds(server_pid) - server0
    s = result.summary
    lags = [1000 * (r.send_time - r.scheduled_time) for r in result.records]
    return {"request_rate": rate, "completed": s["completed"], "failed": s["failed"],
            "request_throughput": s["request_throughput"], "duration": s["duration"],
            "median_send_lag_ms": percentile(lags, 50), "p99_send_lag_ms": percentile(lags, 99),
            "client_cpu_ms_per_request": 1000 * cpu / (args.num_prompts + 20),
            "client_cpu_util": cpu / s["duration"], "server_cpu_util": server_cpu / s["duration"],
            **{k: s[k] for k in ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms",
                                 "median_tpot_ms", "p99_tpot_ms")}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="100,200,300")
    p.add_argument("--num-prompts", type=int, default=2000)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--ttft-ms", type=float, default=20.0)
    p.add_argument("--itl-ms", type=float, default=5.0)
    p.add_argument("--output", default=str(RESULTS / "loadtest_overhead.json"))
    args = p.parse_args()
    proc, address = start_fake(args.ttft_ms, args.itl_ms)
    try:
        rows = [measure(address, proc.pid, float(r), args) for r in args.rates.split(",")]
    finally:
        proc.kill()
        proc.wait(10)
    print(f"fake server: TTFT {args.ttft_ms:g} ms, ITL {args.itl_ms:g} ms, {args.output_len} tokens/request; "
          f"{args.num_prompts} requests per rate")
    print(f"{'rate':>6} {'done':>6} {'fail':>5} {'req/s':>7} {'lag p50':>8} {'lag p99':>8} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'TPOT p50':>9} {'client CPU':>10} {'server CPU':>10}")
    for r in rows:
        print(f"{r['request_rate']:>6.0f} {r['completed']:>6} {r['failed']:>5} {r['request_throughput']:>7.1f} "
              f"{r['median_send_lag_ms']:>8.2f} {r['p99_send_lag_ms']:>8.2f} {r['median_ttft_ms']:>9.2f} "
              f"{r['p99_ttft_ms']:>9.2f} {r['median_itl_ms']:>8.2f} {r['p99_itl_ms']:>8.2f} "
              f"{r['median_tpot_ms']:>9.2f} {100 * r['client_cpu_util']:>9.0f}% {100 * r['server_cpu_util']:>9.0f}%")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"injected": {"ttft_ms": args.ttft_ms, "itl_ms": args.itl_ms, "output_len": args.output_len},
                   "num_prompts": args.num_prompts, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "rows": rows}, f, indent=2)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
