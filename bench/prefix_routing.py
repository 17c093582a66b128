"""Prefix-aware routing vs round_robin vs random on a prefix-sharing workload.

For each policy, a fresh cluster of real processes (so no policy inherits a
warm cache): 2 `pdserve prefill-worker`s and 1 `pdserve decode-worker`
(--num-threads 1 each) behind `pdserve router --routing-policy P`.

Workload (same seed, same prompts, same arrival times for every policy):
--num-system-prompts system prompts of --system-len random token ids; each
request is one of them (uniformly at random) plus its own --suffix-len random
tokens, --output-len tokens out (greedy, ignore_eos), Poisson arrivals at
--request-rate per second. Every prefill worker's KV cache holds
--kv-prompts-per-worker system prompts (default 4.5: room for the half of the
prompts prefix routing sends each worker, not for all of them), so where a
prompt goes decides whether its prefill is a cache hit. Remote prefill is
always used (--skip-prefill-tokens 0), so the decode worker's own cache does
not hide the prefill routing.

Measured at the client: TTFT = send -> first token; prefix hit rate = cached
prompt tokens / prompt tokens (usage.cached_tokens: what the prefill engine
actually reused). The router's own view (KV index) is reported too:
router_prefix_hit_blocks_total / router_prefix_query_blocks_total.

  PYTHONPATH=. .venv/bin/python bench/prefix_routing.py [--request-rate 2.5]

`--scenario pressure` (issue 21): --workers prefill and as many decode workers (float32), router
defaults (decode prefills itself when it holds all but 32 tokens), --num-system-prompts prompts
behind a shared 8-token header x --questions questions each, shuffled, sent by --concurrency
clients one request at a time; every worker's cache holds --kv-fraction (2/3) of the prompts. Reports
long prefills (requests whose prefill computed more than their question; ideal = one per system
prompt), TTFT percentiles and per-worker counts:

  PYTHONPATH=. .venv/bin/python bench/prefix_routing.py --scenario pressure --num-system-prompts 24 \
      --system-len 592 --suffix-len 12 --output-len 2 --concurrency 4 --policies prefix,round_robin
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

from bench.disagg_vs_colocated import arrival_offsets, cpu_model, pct  # noqa: E402
from common.grpc_common import insecure_channel  # noqa: E402
from common.protocol import generate_pb2, generate_pb2_grpc  # noqa: E402
from tests.cluster.harness import free_port, metric_value, start  # noqa: E402

POLICIES = ("prefix", "round_robin", "random")
BLOCK_BYTES_BF16 = 30 * 2 * 16 * 3 * 64 * 2  # SmolLM2: layers x K/V x block x KV heads x head dim x 2 bytes


def make_workload(args) -> tuple[list[list[int]], list[int], list[float]]:
    rng = random.Random(args.seed)
    systems = [[1000 + s] + [rng.randrange(1000, 40000) for _ in range(args.system_len - 1)]
               for s in range(args.num_system_prompts)]
    choice = [rng.randrange(args.num_system_prompts) for _ in range(args.num_prompts)]
    prompts = [systems[c] + [rng.randrange(1000, 40000) for _ in range(args.suffix_len)] for c in choice]
    return prompts, choice, arrival_offsets(args.num_prompts, args.request_rate, args.seed)


async def one_request(stub, rid: str, prompt: list[int], output_len: int) -> dict:
    req = generate_pb2.GenerateRequest(
        request_id=rid, tokens=generate_pb2.TokenIds(ids=prompt),
        params=generate_pb2.SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    sent = time.perf_counter()
    ttft, cached, ok = None, 0, False
    try:
        call = stub.Generate(req)
        async for msg in call:
            if msg.HasField("chunk"):
                if ttft is None and msg.chunk.token_ids:
                    ttft = time.perf_counter() - sent
            else:
                ok, cached = True, msg.complete.usage.cached_tokens
        meta = dict(await call.trailing_metadata())
    except Exception as exc:  # noqa: BLE001 - a failed request is a result
        return {"ok": False, "error": repr(exc)[:200]}
    return {"ok": ok, "ttft": ttft, "cached": cached, "prompt": len(prompt), "e2e": time.perf_counter() - sent,
            "prefill": meta.get("pdserve-prefill-worker", "?"), "decode": meta.get("pdserve-decode-worker", "?")}


async def run_workload(address: str, prompts, offsets, output_len: int) -> list[dict]:
    async with insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        t0 = time.perf_counter()

        async def at(i: int) -> dict:
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            return await one_request(stub, f"r{i}", prompts[i], output_len)

        return list(await asyncio.gather(*(at(i) for i in range(len(prompts)))))


def run_policy(policy: str, args, prompts, offsets) -> dict:
    blocks_per_prompt = -(-(args.system_len + args.suffix_len) // 16)
    kv_gib = args.kv_prompts_per_worker * blocks_per_prompt * BLOCK_BYTES_BF16 / 2**30
    flags = ["--model", args.model, "--dtype", "bfloat16", "--port", "0", "--num-threads", "1"]
    procs = []
    try:
        for role in ("prefill", "prefill"):
            procs.append(start(role, [f"{role}-worker", *flags, "--kv-cache-memory-gib", f"{kv_gib:.4f}"]))
        procs.append(start("decode", ["decode-worker", *flags, "--kv-cache-memory-gib", "1.0"]))
        metrics_port = free_port()
        router = start("router", ["router", "--port", "0", "--model", args.model, "--routing-policy", policy,
                                  "--skip-prefill-tokens", "0", "--metrics-port", str(metrics_port), "--route-metadata",
                                  "--prefill-workers", f"{procs[0].address},{procs[1].address}",
                                  "--decode-workers", procs[2].address])
        procs.append(router)
        results = asyncio.run(run_workload(router.address, prompts, offsets, args.output_len))
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        query = metric_value(url, "pdserve:router_prefix_query_blocks_total") or 0
        hit = metric_value(url, "pdserve:router_prefix_hit_blocks_total") or 0
        per_worker = [metric_value(url, "pdserve:routing_decisions_total", role="prefill", worker=p.address) or 0
                      for p in procs[:2]]
    finally:
        for p in reversed(procs):
            p.stop()
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    return {"ttft_mean_ms": float(np.mean(ttft)) * 1000, "ttft_p50_ms": pct(ttft, 50),
            "ttft_p90_ms": pct(ttft, 90), "ttft_p99_ms": pct(ttft, 99),
            "e2e_p50_ms": pct([r["e2e"] for r in ok], 50),
            "prefix_hit_rate": sum(r["cached"] for r in ok) / max(1, sum(r["prompt"] for r in ok)),
            "router_index_hit_rate": hit / query if query else 0.0,
            "completed": len(ok), "failed": len(results) - len(ok), "kv_gib_per_prefill_worker": kv_gib,
            "prefill_requests_per_worker": per_worker,
            "errors": sorted({r["error"] for r in results if "error" in r})[:5]}


BLOCK_BYTES_FP32 = BLOCK_BYTES_BF16 * 2
HEADER = [1, 9690, 198, 2683, 359, 253, 5356, 5646]  # a chat template's fixed start, shared by every prompt


def make_pressure_workload(args) -> tuple[list[list[int]], list[int]]:
    """`--num-system-prompts` system prompts x `--questions` questions each, shuffled, chat-like: a
    shared header, then the system prompt (distinct from its first token), then the question."""
    rng = random.Random(args.seed)
    systems = [[2000 + s] + [rng.randrange(1000, 40000) for _ in range(args.system_len - 1)]
               for s in range(args.num_system_prompts)]
    order = [(s, q) for s in range(args.num_system_prompts) for q in range(args.questions)]
    rng.shuffle(order)
    prompts = [HEADER + systems[s] + [rng.randrange(1000, 40000) for _ in range(args.suffix_len)] for s, _ in order]
    return prompts, [s for s, _ in order]


async def run_closed_loop(address: str, prompts, output_len: int, concurrency: int) -> list[dict]:
    async with insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        results: list[dict | None] = [None] * len(prompts)
        todo = iter(range(len(prompts)))

        async def client() -> None:
            for i in todo:
                results[i] = await one_request(stub, f"r{i}", prompts[i], output_len)

        await asyncio.gather(*(client() for _ in range(concurrency)))
        return results


def run_pressure(policy: str, args, prompts) -> dict:
    """N prefill + N decode workers (float32, like the issue's report), router defaults otherwise (remote
    prefill skipped when the decode worker holds all but 32 tokens); every worker's KV cache holds
    --kv-fraction of the working set."""
    blocks_per_prompt = -(-len(prompts[0]) // 16)
    kv_gib = args.kv_fraction * args.num_system_prompts * blocks_per_prompt * BLOCK_BYTES_FP32 / 2**30
    flags = ["--model", args.model, "--dtype", "float32", "--port", "0", "--num-threads", "1",
             "--kv-cache-memory-gib", f"{kv_gib:.4f}"]
    procs = []
    try:
        for role in ["prefill"] * args.workers + ["decode"] * args.workers:
            procs.append(start(role, [f"{role}-worker", *flags]))
        metrics_port = free_port()
        prefill, decode = procs[:args.workers], procs[args.workers:]
        router = start("router", ["router", "--port", "0", "--model", args.model, "--routing-policy", policy,
                                  "--metrics-port", str(metrics_port),
                                  "--prefill-workers", ",".join(p.address for p in prefill),
                                  "--decode-workers", ",".join(p.address for p in decode)])
        procs.append(router)
        t0 = time.perf_counter()
        results = asyncio.run(run_closed_loop(router.address, prompts, args.output_len, args.concurrency))
        wall = time.perf_counter() - t0
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        per_prefill = [metric_value(url, "pdserve:routing_decisions_total", role="prefill", worker=p.address) or 0
                       for p in prefill]
        per_decode = [metric_value(url, "pdserve:routing_decisions_total", role="decode", worker=p.address) or 0
                      for p in decode]
    finally:
        for p in reversed(procs):
            p.stop()
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    long = [r for r in ok if r["prompt"] - r["cached"] > args.suffix_len + 16]  # the system prompt was computed
    return {"ttft_mean_ms": float(np.mean(ttft)) * 1000, "ttft_p50_ms": pct(ttft, 50),
            "ttft_p90_ms": pct(ttft, 90), "ttft_p99_ms": pct(ttft, 99),
            "long_prefills": len(long), "ideal_long_prefills": args.num_system_prompts,
            "long_ttft_mean_ms": float(np.mean([r["ttft"] for r in long])) * 1000 if long else 0.0,
            "prefix_hit_rate": sum(r["cached"] for r in ok) / max(1, sum(r["prompt"] for r in ok)),
            "prefill_requests_per_worker": per_prefill, "decode_requests_per_worker": per_decode,
            "long_prefills_per_worker": [sum(r["prefill"] == p.address or (r["prefill"] == "-" and
                                                                        r["decode"] == p.address) for r in long)
                                         for p in procs[:2 * args.workers]],
            "wall_s": wall, "completed": len(ok), "failed": len(results) - len(ok), "kv_gib_per_worker": kv_gib,
            "errors": sorted({r["error"] for r in results if "error" in r})[:5]}


PRESSURE_ROWS = [("long prefills (ideal = prefixes)", "long_prefills", "d"), ("TTFT mean ms", "ttft_mean_ms", ".0f"),
                 ("TTFT p50 ms", "ttft_p50_ms", ".0f"), ("TTFT p90 ms", "ttft_p90_ms", ".0f"),
                 ("TTFT p99 ms", "ttft_p99_ms", ".0f"), ("prefix hit rate (engine)", "prefix_hit_rate", ".1%"),
                 ("wall s", "wall_s", ".0f")]


ROWS = [("TTFT mean ms", "ttft_mean_ms", ".0f"), ("TTFT p50 ms", "ttft_p50_ms", ".0f"),
        ("TTFT p90 ms", "ttft_p90_ms", ".0f"), ("TTFT p99 ms", "ttft_p99_ms", ".0f"),
        ("E2E p50 ms", "e2e_p50_ms", ".0f"), ("prefix hit rate (engine)", "prefix_hit_rate", ".1%"),
        ("prefix hit rate (router index)", "router_index_hit_rate", ".1%")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--num-system-prompts", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--num-prompts", type=int, default=160)
    ap.add_argument("--request-rate", type=float, default=2.5)
    ap.add_argument("--kv-prompts-per-worker", type=float, default=4.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default="bench/results/prefix_routing.json")
    ap.add_argument("--scenario", choices=["arrivals", "pressure"], default="arrivals",
                    help="pressure: many prefixes, every cache holding --kv-fraction of them, closed loop")
    ap.add_argument("--questions", type=int, default=4, help="pressure: requests per system prompt")
    ap.add_argument("--workers", type=int, default=2, help="pressure: prefill workers, and as many decode workers")
    ap.add_argument("--concurrency", type=int, default=1, help="pressure: clients, each one request at a time")
    ap.add_argument("--kv-fraction", type=float, default=2 / 3, help="pressure: share of the prompts a cache holds")
    args = ap.parse_args()
    if args.scenario == "pressure":
        return pressure_main(args)
    prompts, _, offsets = make_workload(args)
    results = {}
    for policy in args.policies.split(","):
        print(f"== {policy}", flush=True)
        results[policy] = run_policy(policy, args, prompts, offsets)
    names = list(results)
    print(f"\n| metric | {' | '.join(names)} |")
    print(f"|---|{'---:|' * len(names)}")
    for label, key, fmt in ROWS:
        print(f"| {label} | {' | '.join(format(results[n][key], fmt) for n in names)} |")
    split = ["/".join(f"{n:.0f}" for n in r["prefill_requests_per_worker"]) for r in results.values()]
    print(f"| prefills per worker | {' | '.join(split)} |")
    done = [f"{r['completed']}/{r['failed']}" for r in results.values()]
    print(f"| completed/failed | {' | '.join(done)} |")
    if "prefix" in results and "round_robin" in results:
        print(f"\nTTFT p50: round_robin / prefix = "
              f"{results['round_robin']['ttft_p50_ms'] / results['prefix']['ttft_p50_ms']:.2f}x")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"settings": vars(args), "cpu": cpu_model(), "nproc": os.cpu_count(),
                                             "results": results}, indent=2))
    print(f"wrote {args.output}")
    return 0


def pressure_main(args) -> int:
    prompts, _ = make_pressure_workload(args)
    results = {}
    for policy in args.policies.split(","):
        print(f"== {policy}", flush=True)
        results[policy] = run_pressure(policy, args, prompts)
        print(json.dumps(results[policy]), flush=True)
    names = list(results)
    print(f"\n{args.workers}P{args.workers}D, concurrency {args.concurrency}, {len(prompts)} requests\n")
    print(f"| metric | {' | '.join(names)} |")
    print(f"|---|{'---:|' * len(names)}")
    for label, key, fmt in PRESSURE_ROWS:
        print(f"| {label} | {' | '.join(format(results[n][key], fmt) for n in names)} |")
    for label, key in (("long prefills per worker (P..., D...)", "long_prefills_per_worker"),
                       ("prefills per prefill worker", "prefill_requests_per_worker"),
                       ("requests per decode worker", "decode_requests_per_worker")):
        print(f"| {label} | {' | '.join('/'.join(f'{n:.0f}' for n in results[p][key]) for p in names)} |")
    done = [f"{r['completed']}/{r['failed']}" for r in results.values()]
    print(f"| completed/failed | {' | '.join(done)} |")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"settings": vars(args), "cpu": cpu_model(), "nproc": os.cpu_count(),
                                             "results": results}, indent=2))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
