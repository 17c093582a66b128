"""Routing policies on a replayed production trace: `pdserve loadtest --dataset mooncake:FILE` per policy.

For each policy a fresh cluster of real processes (no policy inherits a warm cache): --prefill prefill and
--decode decode workers (SmolLM2, float32, --num-threads 1 each) behind a router, then the trace slice
(the first --sessions conversations of at least --min-turns turns, each hash id as --block-tokens random
token ids, later turns sent only after the previous turn answered) replayed at --concurrency in trace
order. Every worker's KV cache
holds --kv-fraction of the slice's distinct 16-token blocks, so where a turn goes decides whether its
history is a cache hit.

Policies: `prefix` (peer pulls on: a prefill worker lacking a prefix another holds pulls it when that is
cheaper than computing it; with --prefill 0 the decode workers compute the prompts and pull the same way),
`prefix-no-pull` (`--no-peer-pulls`: the policy before peer pulls), `round_robin`, `least_loaded`.

Reported per policy: TTFT mean/p50/p90/p99 (ms) over all turns and mean TTFT of turns 2+, the prefix hit
ratio the engines achieved (usage.cached_tokens / prompt tokens) against the trace's ideal (every block
seen before is reused), prompt tokens the prefill workers computed (router metric) against the ideal,
peer pulls leased and the tokens they moved. The trace is the user's file; nothing is fetched:

  PYTHONPATH=. .venv/bin/python bench/trace_replay.py --trace conversation_trace.jsonl \\
      [--sessions 60 --concurrency 3 --prefill 2 --decode 2] [--output bench/results/trace_replay.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from loadtest.config import DatasetConfig  # noqa: E402
from loadtest.prefix import block_keys  # noqa: E402
from loadtest.trace import trace_prompts  # noqa: E402
from tests.cluster.harness import generate_routed, metric_value, start_cluster, stop_all  # noqa: E402

POLICIES = ("prefix", "prefix-no-pull", "round_robin", "least_loaded")
BLOCK_BYTES_FP32 = 30 * 2 * 16 * 3 * 64 * 4  # SmolLM2: layers x K/V x block x KV heads x head dim x 4 bytes


def slice_figures(args) -> dict:
    """The slice's prompts: count, tokens, distinct blocks and the ideal hit ratio."""
    config = DatasetConfig(name="mooncake", path=args.trace, trace_block_tokens=args.block_tokens,
                           trace_sessions=args.sessions, trace_min_turns=args.min_turns)
    prompts = trace_prompts(config, 10**9, args.seed)
    seen: set[int] = set()
    total = cached = 0
    for p in prompts:
        keys = block_keys(p.token_ids)
        for i, k in enumerate(keys):
            if k not in seen:
                break
            cached = cached + 16 if i < (len(p.token_ids) - 1) // 16 else cached
        seen.update(keys)
        total += len(p.token_ids)
    return {"requests": len(prompts), "prompt_tokens": total, "distinct_blocks": len(seen),
            "ideal_cached_tokens": cached, "ideal_computed_tokens": total - cached}


def warm_up(router, count: int) -> None:
    """A few short unrelated prompts first, so no worker's first-ever step (allocation, kernel selection)
    lands in the measured TTFTs."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(count) as pool:
        list(pool.map(lambda i: generate_routed(router, list(range(45000 + 100 * i, 45000 + 100 * i + 40))),
                      range(2 * count)))


def run_policy(policy: str, args, kv_gib: float) -> dict:
    routing = ["--routing-policy", "prefix" if policy.startswith("prefix") else policy,
               "--skip-prefill-tokens", "0"]  # every prompt goes through the prefill pool's routing
    if policy == "prefix-no-pull":
        routing.append("--no-peer-pulls")
    procs = start_cluster(["prefill"] * args.prefill + ["decode"] * args.decode, "--kv-cache-memory-gib",
                          f"{kv_gib:.4f}", router_flags=tuple(routing), timeout=120)
    router = procs[-1]
    try:
        warm_up(router, args.prefill + args.decode)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "run.json"
            subprocess.run([sys.executable, "-m", "pdserve.cli", "loadtest", "--url", router.address,
                            "--dataset", f"mooncake:{args.trace}", "--trace-block-tokens", str(args.block_tokens),
                            "--trace-sessions", str(args.sessions), "--trace-min-turns", str(args.min_turns),
                            "--max-concurrency", str(args.concurrency),
                            "--trace-max-output-len", str(args.max_output_len), "--seed", str(args.seed),
                            "--no-progress", "--output", str(out),
                            *(["--save-requests", f"{args.output}.{policy}.requests.jsonl"] if args.output else [])],
                           check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
            run = json.loads(out.read_text())
        url = router.metrics_url
        computed = metric_value(url, "pdserve:router_prefill_tokens_total") or 0.0
        if not args.prefill:  # the decode workers compute the prompts: what their usage says they did not reuse
            computed = float(run["total_input_tokens"] - run["total_cached_tokens"])
        leased = metric_value(url, "pdserve:router_peer_pulls_total", outcome="leased") or 0.0
        pulled = 16 * sum(metric_value(url, "pdserve:router_prefix_hit_blocks_by_source_total", source="peer",
                                       medium=medium) or 0.0 for medium in ("device", "cpu", "disk"))
    finally:
        stop_all(procs)
    turns = run.get("per_turn", {})
    later = [v for k, v in turns.items() if k != "0"]
    later_n = sum(v["completed"] for v in later)
    return {"ttft_mean_ms": run["mean_ttft_ms"], "ttft_p50_ms": run["median_ttft_ms"],
            "ttft_p90_ms": run.get("p90_ttft_ms", 0.0), "ttft_p99_ms": run["p99_ttft_ms"],
            "later_turns_ttft_mean_ms": (sum(v["mean_ttft_ms"] * v["completed"] for v in later) / later_n
                                         if later_n else 0.0),
            "prefix_hit_ratio": run["prefix_hit_ratio"], "ideal_prefix_hit_ratio": run.get("ideal_prefix_hit_ratio"),
            "prefill_tokens_computed": computed, "peer_pulls_leased": leased, "peer_pull_tokens": pulled,
            "completed": run["completed"], "failed": run.get("failed", 0), "duration_s": run["duration"]}


ROWS = [("TTFT mean ms", "ttft_mean_ms", ".0f"), ("TTFT p50 ms", "ttft_p50_ms", ".0f"),
        ("TTFT p90 ms", "ttft_p90_ms", ".0f"), ("TTFT p99 ms", "ttft_p99_ms", ".0f"),
        ("TTFT mean ms, turns 2+", "later_turns_ttft_mean_ms", ".0f"),
        ("prefix hit ratio (engines)", "prefix_hit_ratio", ".1%"),
        ("prefill tokens computed", "prefill_tokens_computed", ".0f"), ("peer pulls", "peer_pulls_leased", ".0f"),
        ("tokens pulled from peers", "peer_pull_tokens", ".0f"), ("completed", "completed", "d"),
        ("duration s", "duration_s", ".0f")]


def table(results: dict[str, dict], figures: dict) -> str:
    names = list(results)
    lines = [f"{'':28}" + "".join(f"{n:>16}" for n in names)]
    for label, key, fmt in ROWS:
        lines.append(f"{label:28}" + "".join(f"{format(results[n][key], fmt):>16}" for n in names))
    lines.append(f"ideal: {figures['ideal_computed_tokens']} prompt tokens computed of {figures['prompt_tokens']} "
                 f"(hit ratio {figures['ideal_cached_tokens'] / figures['prompt_tokens']:.1%}), "
                 f"{figures['distinct_blocks']} distinct blocks, {figures['requests']} requests")
    if "round_robin" in results:
        rr = results["round_robin"]
        for n in names:
            lines.append(f"{n}: mean TTFT {rr['ttft_mean_ms'] / results[n]['ttft_mean_ms']:.2f}x better than "
                         f"round_robin, p99 {rr['ttft_p99_ms'] / results[n]['ttft_p99_ms']:.2f}x")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, help="Mooncake/AIPerf trace JSONL (the user's file)")
    p.add_argument("--sessions", type=int, default=60, help="the first N conversations of the trace")
    p.add_argument("--min-turns", type=int, default=1, help="only conversations of at least this many turns")
    p.add_argument("--block-tokens", type=int, default=16, help="token ids per trace hash id")
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--kv-fraction", type=float, default=2 / 3, help="each worker's KV cache / the slice's blocks")
    p.add_argument("--max-output-len", type=int, default=32)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="JSON result file")
    args = p.parse_args()
    figures = slice_figures(args)
    kv_gib = args.kv_fraction * figures["distinct_blocks"] * BLOCK_BYTES_FP32 / 2**30
    results = {}
    for policy in args.policies.split(","):
        results[policy] = run_policy(policy, args, kv_gib)
        print(f"{policy}: {json.dumps(results[policy])}", flush=True)
    print(table(results, figures))
    if args.output:
        Path(args.output).write_text(json.dumps({"settings": vars(args), "slice": figures, "kv_gib_per_worker": kv_gib,
                                                 "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
