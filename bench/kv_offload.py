"""Multi-turn chats through the cluster with the KV tiers off and on: prefill tokens computed, TTFT, ITL, throughput.

For each configuration, a fresh cluster of real processes: `pdserve prefill-worker` + `pdserve decode-worker`
(--num-threads 1 each) behind `pdserve router` (router defaults: the decode worker prefills a prompt itself
when it holds all but a few tokens of it). `off` gives the workers only their device pool, sized to hold
--pool-conversations conversations' histories; `on` gives them the same pool plus a host tier
(--cpu-gib) and a disk tier (--disk-gib, under a fresh temporary directory); `cpu` the host tier alone.

Workload (same seed, same tokens for both): --conversations chats of --turns turns. Turn 1 is
--first-len random token ids; every later turn's prompt is the previous prompt, the --output-len tokens
the model answered (greedy) and --user-len new tokens. Turns are interleaved: every chat's turn t goes
before any chat's turn t+1, with --concurrency chats in flight at once, so between two turns of one chat
all the others pass through the pool. A chat's next turn is sent after its previous one completes.

Measured at the client: prefill tokens computed = prompt tokens - usage.cached_tokens (what the engine
that prefilled reused, device or lower tier); TTFT (send -> first token), ITL (gaps between tokens),
output throughput over the run's wall time. "ITL after token 2" leaves out each request's first gap, which
holds the hand-off from prefill to decode (the KV pull, and with tiers a load from the decode worker's own);
"requests decoding at once" is the mean decode batch while any request decodes (ITL grows with it).

  PYTHONPATH=. .venv/bin/python bench/kv_offload.py [--conversations 16 --turns 4]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.disagg_vs_colocated import cpu_model, pct  # noqa: E402
from common.grpc_common import insecure_channel  # noqa: E402
from common.protocol import generate_pb2, generate_pb2_grpc  # noqa: E402
from tests.cluster.harness import start  # noqa: E402

BLOCK_BYTES_BF16 = 30 * 2 * 16 * 3 * 64 * 2  # SmolLM2: layers x K/V x block x KV heads x head dim x 2 bytes


async def one_turn(stub, rid: str, prompt: list[int], output_len: int) -> dict:
    req = generate_pb2.GenerateRequest(
        request_id=rid, tokens=generate_pb2.TokenIds(ids=prompt),
        params=generate_pb2.SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    sent = time.perf_counter()
    times, tokens, cached = [], [], 0
    call = stub.Generate(req)
    async for msg in call:
        if msg.HasField("chunk") and msg.chunk.token_ids:
            times.append(time.perf_counter())
            tokens.extend(msg.chunk.token_ids)
        elif msg.HasField("complete"):
            cached = msg.complete.usage.cached_tokens
    return {"ttft": times[0] - sent, "itl": [b - a for a, b in zip(times, times[1:], strict=False)],
            "tokens": tokens, "cached": cached, "prompt": len(prompt),
            "decoding": (times[min(1, len(times) - 1)], times[-1])}


async def run_chats(address: str, args) -> tuple[list[dict], float]:
    rng = random.Random(args.seed)
    histories = [[5000 + c] + [rng.randrange(1000, 40000) for _ in range(args.first_len - 1)]
                 for c in range(args.conversations)]
    user_turns = [[[rng.randrange(1000, 40000) for _ in range(args.user_len)] for _ in range(args.turns)]
                  for _ in range(args.conversations)]
    order = [(t, c) for t in range(args.turns) for c in range(args.conversations)]
    done = {c: asyncio.Event() for c in range(args.conversations)}
    results: list[dict] = []
    async with insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        todo = iter(order)
        t0 = time.perf_counter()

        async def client() -> None:
            for turn, conv in todo:
                if turn:
                    await done[conv].wait()
                    done[conv].clear()
                prompt = histories[conv] if not turn else histories[conv] + user_turns[conv][turn]
                result = await one_turn(stub, f"c{conv}t{turn}", prompt, args.output_len)
                result["turn"] = turn
                histories[conv] = prompt + result.pop("tokens")
                results.append(result)
                done[conv].set()

        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        return results, time.perf_counter() - t0


def run_config(name: str, args, pool_gib: float) -> dict:
    flags = ["--model", args.model, "--dtype", "bfloat16", "--port", "0", "--num-threads", "1",
             "--kv-cache-memory-gib", f"{pool_gib:.4f}"]
    procs, tmp = [], tempfile.TemporaryDirectory(prefix="pdserve-kv-tier-")
    try:
        for role in ("prefill", "decode"):
            tiers = [] if name == "off" or role not in args.tier_roles else ["--kv-offload-cpu-gib", str(args.cpu_gib)]
            if name == "on" and tiers:
                tiers += ["--kv-offload-dir", f"{tmp.name}/{role}", "--kv-offload-disk-gib", str(args.disk_gib)]
            procs.append(start(role, [f"{role}-worker", *flags, *tiers]))
        router = start("router", ["router", "--port", "0", "--model", args.model,
                                  "--prefill-workers", procs[0].address, "--decode-workers", procs[1].address])
        procs.append(router)
        results, wall = asyncio.run(run_chats(router.address, args))
    finally:
        for p in reversed(procs):
            p.stop()
        tmp.cleanup()
    later = [r for r in results if r["turn"] > 0]
    ttft = [r["ttft"] for r in results]
    itl = [g for r in results for g in r["itl"]]
    steady = [g for r in results for g in r["itl"][1:]]
    handoff = [r["itl"][0] for r in results if r["itl"]]
    return {"prefill_tokens_computed": sum(r["prompt"] - r["cached"] for r in results),
            "prompt_tokens": sum(r["prompt"] for r in results),
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
            "later_turn_ttft_p50_ms": pct([r["ttft"] for r in later], 50),
            "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99),
            "decode_itl_p50_ms": pct(steady, 50), "decode_itl_p99_ms": pct(steady, 99),
            "handoff_p50_ms": pct(handoff, 50), "handoff_p99_ms": pct(handoff, 99),
            "decode_batch": decode_batch([r["decoding"] for r in results]),
            "output_tok_s": sum(len(r["itl"]) + 1 for r in results) / wall, "wall_s": wall,
            "requests": len(results)}


def decode_batch(spans: list[tuple[float, float]]) -> float:
    """Requests decoding at once (from their second token to their last), averaged over the time any is."""
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    busy = weighted = 0.0
    level, last = 0, None
    for t, step in edges:
        if last is not None and level:
            busy += t - last
            weighted += level * (t - last)
        level, last = level + step, t
    return weighted / busy if busy else 0.0


ROWS = [("prefill tokens computed", "prefill_tokens_computed", "d"), ("prompt tokens", "prompt_tokens", "d"),
        ("TTFT p50 ms", "ttft_p50_ms", ".0f"), ("TTFT p99 ms", "ttft_p99_ms", ".0f"),
        ("TTFT p50 ms, turns 2+", "later_turn_ttft_p50_ms", ".0f"), ("ITL p50 ms", "itl_p50_ms", ".1f"),
        ("ITL p99 ms", "itl_p99_ms", ".1f"), ("ITL p50 ms, after token 2", "decode_itl_p50_ms", ".1f"),
        ("ITL p99 ms, after token 2", "decode_itl_p99_ms", ".1f"),
        ("token 1 -> 2 (hand-off) p50 ms", "handoff_p50_ms", ".0f"), ("token 1 -> 2 p99 ms", "handoff_p99_ms", ".0f"),
        ("requests decoding at once", "decode_batch", ".2f"), ("output tok/s", "output_tok_s", ".1f"),
        ("wall s", "wall_s", ".0f")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-len", type=int, default=512)
    ap.add_argument("--user-len", type=int, default=160)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--pool-conversations", type=float, default=3.0,
                    help="device pool per worker, in full-length conversation histories")
    ap.add_argument("--cpu-gib", type=float, default=1.0)
    ap.add_argument("--disk-gib", type=float, default=2.0)
    ap.add_argument("--configs", default="off,on", help="comma-separated: off, cpu (host tier only), on")
    ap.add_argument("--tier-roles", default="prefill,decode", help="which workers get the tiers (cpu, on)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default="bench/results/kv_offload.json")
    args = ap.parse_args()
    longest = args.first_len + (args.turns - 1) * (args.user_len + args.output_len) + args.output_len
    pool_gib = args.pool_conversations * -(-longest // 16) * BLOCK_BYTES_BF16 / 2**30
    results = {name: run_config(name, args, pool_gib) for name in args.configs.split(",")}
    names = list(results)
    print(f"\n{args.conversations} chats x {args.turns} turns, {args.first_len} + {args.user_len}/turn tokens in, "
          f"{args.output_len} out, concurrency {args.concurrency}; pool {pool_gib * 1024:.0f} MiB per worker; "
          f"{cpu_model()}")
    print(f"{'':28}" + "".join(f"{n:>14}" for n in names))
    for label, key, fmt in ROWS:
        print(f"{label:28}" + "".join(f"{format(results[n][key], fmt):>14}" for n in names))
    if "off" in results and "on" in results:
        off, on = results["off"], results["on"]
        print(f"prefill tokens cut {off['prefill_tokens_computed'] / max(1, on['prefill_tokens_computed']):.2f}x, "
              f"TTFT p50 {off['ttft_p50_ms'] / on['ttft_p50_ms']:.2f}x better")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"args": vars(args), "pool_gib": pool_gib, "results": results},
                                            indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
