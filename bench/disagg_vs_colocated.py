"""Online serving: disaggregated 1 prefill + 1 decode worker vs one co-located engine.

The same workload goes, one configuration after the other, through the real CLI
processes and the router's gRPC API:
  1P1D       `pdserve prefill-worker` + `pdserve decode-worker` (--num-threads 1
             each: one core per side on a 2-core machine) behind `pdserve router`;
             the prompt's KV moves from prefill to decode over kv_transfer.
  co-located one `pdserve decode-worker` (--num-threads 2: it owns both cores) behind
             a router with no prefill workers, so it prefills prompts itself and
             its prefill chunks share engine steps with the running decodes.

Workload: --num-prompts prompts of --input-len random token ids in [1000, 40000)
(each starting with its own index, so no two share a prefix-cache block), greedy,
ignore_eos, exactly --output-len tokens each, sent at Poisson arrivals of
--request-rate per second (inf: all at once); same seed, same prompts, same
arrival times for every configuration. Each configuration first serves 2
warm-up requests (other prompts), then the measured ones.

Per request, measured at the client: TTFT = send -> first chunk with tokens;
ITL = gap between successive chunks (one token each, normally); TPOT =
(e2e - TTFT) / (tokens - 1); E2E = send -> Complete. "first ITL" is the gap
between tokens 1 and 2: in 1P1D it holds the KV pull and the decode worker's
admission (token 1 comes from the prefill worker), so its excess over the
co-located one is the hand-off cost. Throughput = output tokens / wall time
from the first send to the last Complete.

  PYTHONPATH=. .venv/bin/python bench/disagg_vs_colocated.py [--request-rate 3]
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

from common.grpc_common import insecure_channel  # noqa: E402
from common.protocol import generate_pb2, generate_pb2_grpc  # noqa: E402
from tests.cluster.harness import start, worker_stats  # noqa: E402

CONFIGS = {"disagg": "1P1D", "colocated": "co-located"}


def make_prompts(n: int, input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1000 + i] + [rng.randrange(1000, 40000) for _ in range(input_len - 1)] for i in range(n)]


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def one_request(stub, rid: str, prompt: list[int], output_len: int) -> dict:
    req = generate_pb2.GenerateRequest(
        request_id=rid, tokens=generate_pb2.TokenIds(ids=prompt),
        params=generate_pb2.SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    sent = time.perf_counter()
    stamps, tokens, ok = [], 0, False
    try:
        async for msg in stub.Generate(req):
            if msg.HasField("chunk"):
                if msg.chunk.token_ids:
                    stamps.append(time.perf_counter())
                    tokens += len(msg.chunk.token_ids)
            else:
                ok = True
    except Exception as exc:  # noqa: BLE001 - a failed request is a result
        return {"ok": False, "error": repr(exc)[:200], "tokens": tokens}
    end = time.perf_counter()
    return {"ok": ok and tokens == output_len, "tokens": tokens, "send": sent, "end": end,
            "ttft": stamps[0] - sent if stamps else None, "e2e": end - sent,
            "itl": [b - a for a, b in itertools.pairwise(stamps)]}


async def run_workload(address: str, prompts, offsets, output_len: int, warmup: list[list[int]]) -> list[dict]:
    async with insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        for i, p in enumerate(warmup):
            await one_request(stub, f"warmup-{i}", p, output_len)
        t0 = time.perf_counter()

        async def at(i: int) -> dict:
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            return await one_request(stub, f"r{i}", prompts[i], output_len)

        return list(await asyncio.gather(*(at(i) for i in range(len(prompts)))))


def pct(xs: list[float], q: float) -> float:
    """q-th percentile of seconds, in ms."""
    return float(np.percentile(xs, q)) * 1000 if xs else float("nan")


def summarise(results: list[dict]) -> dict:
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    itl = [g for r in ok for g in r["itl"]]
    first_itl = [r["itl"][0] for r in ok if r["itl"]]
    tpot = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    e2e = [r["e2e"] for r in ok]
    wall = max(r["end"] for r in ok) - min(r["send"] for r in ok) if ok else float("nan")
    out_tokens = sum(r["tokens"] for r in ok)
    return {
        "ttft_mean_ms": float(np.mean(ttft)) * 1000 if ttft else float("nan"),
        "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
        "itl_mean_ms": float(np.mean(itl)) * 1000 if itl else float("nan"),
        "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
        "first_itl_p50_ms": pct(first_itl, 50),
        "tpot_p50_ms": pct(tpot, 50), "e2e_p50_ms": pct(e2e, 50),
        "output_tok_s": out_tokens / wall, "request_s": len(ok) / wall, "wall_s": wall,
        "output_tokens": out_tokens, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if "error" in r})[:5],
    }


def run_config(name: str, args, prompts, offsets, warmup) -> dict:
    flags = ["--model", args.model, "--dtype", args.dtype, "--port", "0",
             "--kv-cache-memory-gib", str(args.kv_cache_memory_gib)]
    procs = []
    try:
        if name == "disagg":
            procs.append(start("prefill", ["prefill-worker", *flags, "--num-threads", "1"]))
            procs.append(start("decode", ["decode-worker", *flags, "--num-threads", "1"]))
            prefill, decode = procs[0].address, procs[1].address
        else:
            procs.append(start("decode", ["decode-worker", *flags, "--num-threads", "2"]))
            prefill, decode = "", procs[0].address
        router = start("router", ["router", "--port", "0", "--model", args.model,
                                  "--prefill-workers", prefill, "--decode-workers", decode])
        procs.append(router)
        load_before = os.getloadavg()
        results = asyncio.run(run_workload(router.address, prompts, offsets, args.output_len, warmup))
        metrics = summarise(results)
        metrics["loadavg_before"], metrics["loadavg_after"] = load_before, os.getloadavg()
        stats = worker_stats(decode)
        metrics["kv_transfer_backend"] = stats.kv_transfer_backend
        metrics["kv_mb_per_request"] = stats.kv_bytes_moved / 1e6 / (len(prompts) + len(warmup))
        metrics["num_threads"] = {"disagg": "prefill 1 + decode 1", "colocated": "2"}[name]
        return metrics
    finally:
        for p in reversed(procs):
            p.stop()


ROWS = [("TTFT mean ms", "ttft_mean_ms", ".1f"), ("TTFT p50 ms", "ttft_p50_ms", ".1f"),
        ("TTFT p99 ms", "ttft_p99_ms", ".1f"), ("ITL mean ms", "itl_mean_ms", ".1f"),
        ("ITL p50 ms", "itl_p50_ms", ".1f"), ("ITL p99 ms", "itl_p99_ms", ".1f"),
        ("first ITL p50 ms", "first_itl_p50_ms", ".1f"), ("TPOT p50 ms", "tpot_p50_ms", ".1f"),
        ("E2E p50 ms", "e2e_p50_ms", ".0f"), ("output tok/s", "output_tok_s", ".1f"),
        ("request/s", "request_s", ".2f"), ("completed/failed", None, ""),
        ("torch threads", "num_threads", "s"), ("KV moved MB/req", "kv_mb_per_request", ".1f")]


def print_table(results: dict) -> None:
    names = list(results)
    print(f"\n| metric | {' | '.join(CONFIGS[n] for n in names)} |")
    print(f"|---|{'---:|' * len(names)}")
    for label, key, fmt in ROWS:
        cells = [f"{r['completed']}/{r['failed']}" if key is None else format(r[key], fmt)
                 for r in results.values()]
        print(f"| {label} | {' | '.join(cells)} |")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--kv-cache-memory-gib", type=float, default=1.0)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--request-rate", type=float, default=1.0, help="Poisson arrivals per second; inf: all at once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default="disagg,colocated")
    ap.add_argument("--output", default=str(Path(__file__).parent / "results" / "disagg_vs_colocated.json"))
    args = ap.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    if not set(configs) <= set(CONFIGS):
        ap.error(f"--configs: choose from {','.join(CONFIGS)}")

    prompts = make_prompts(args.num_prompts, args.input_len, args.seed)
    offsets = arrival_offsets(args.num_prompts, args.request_rate, args.seed)
    warmup = [[999 - i] + p[1:] for i, p in enumerate(make_prompts(2, args.input_len, args.seed + 100))]
    results = {}
    for name in configs:
        print(f"running {CONFIGS[name]} ...", flush=True)
        started = time.time()
        results[name] = run_config(name, args, prompts, offsets, warmup)
        print(f"  done in {time.time() - started:.0f} s (load average {results[name]['loadavg_after'][0]:.2f})",
              flush=True)

    print(f"\nworkload: {args.num_prompts} prompts x {args.input_len} tokens -> {args.output_len} tokens, "
          f"rate {args.request_rate}/s, seed {args.seed}, dtype {args.dtype}; {os.cpu_count()} CPUs; "
          "1P1D: prefill and decode worker with --num-threads 1 each, co-located: one worker with --num-threads 2")
    print_table(results)
    out = {"workload": vars(args),
           "machine": {"cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "platform": platform.platform(),
                       "python": platform.python_version()},
           "results": {CONFIGS[n]: r for n, r in results.items()}}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.output}")
    return 0 if all(r["failed"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
