"""Micro-benchmark: one routing decision with a big KV index.

Builds a KvIndex of --num-blocks distinct block hashes (chains of
--chain-blocks blocks, i.e. real chained hashes of token ids) spread over
--num-workers prefill workers (each chain held by 1-3 of them, fed through
`load_snapshot` as a resync would), then times the router's real decision
path, `WorkerSelector.pick_prefill` (KV-index overlap over all workers + the
cost formula + tie-break), for prompts that share a random chain's first
blocks and end in fresh ones. Reported twice: the decision alone, and with
hashing the prompt's blocks first (what a request pays in all).

  PYTHONPATH=. .venv/bin/python bench/routing_decision.py
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from common.protocol import worker_pb2  # noqa: E402
from engine.block_hash import hash_full_blocks  # noqa: E402
from router.admission import AdmissionQueue  # noqa: E402
from router.kv_index import KvIndex  # noqa: E402
from router.routing_policy import RoutingPolicy  # noqa: E402
from router.worker_pool import WorkerPool  # noqa: E402
from router.worker_selector import WorkerSelector  # noqa: E402

BS = 16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-blocks", type=int, default=1_000_000)
    ap.add_argument("--num-workers", type=int, default=16)
    ap.add_argument("--chain-blocks", type=int, default=250)
    ap.add_argument("--prompt-blocks", type=int, default=128, help="blocks per routed prompt (2,048 tokens)")
    ap.add_argument("--decisions", type=int, default=5000)
    ap.add_argument("--output", default="bench/results/routing_decision.json")
    args = ap.parse_args()
    rng = random.Random(0)

    t = time.perf_counter()
    chains = []
    for c in range(args.num_blocks // args.chain_blocks):
        tokens = [c] + [rng.randrange(49152) for _ in range(args.chain_blocks * BS - 1)]
        chains.append(tokens)
    addresses = [f"10.0.{w // 256}.{w % 256}:7000" for w in range(args.num_workers)]
    held: dict[str, list[int]] = {a: [] for a in addresses}
    for tokens in chains:
        hashes = hash_full_blocks(tokens, BS)
        for a in rng.sample(addresses, rng.randint(1, 3)):
            held[a].extend(hashes)
    index = KvIndex()
    for a in addresses:
        index.load_snapshot(a, 1, [(h, "device") for h in held[a]])
    build_s = time.perf_counter() - t
    entries = sum(len(h) for h in held.values())

    pool = WorkerPool(addresses, [])
    for w in pool.workers:
        w.healthy = True
        w.stats = worker_pb2.WorkerStats(role="prefill", block_size=BS, kv_blocks_total=100_000,
                                         num_waiting_tokens=rng.randrange(0, 4000), num_requests=rng.randrange(8))
    selector = WorkerSelector(pool, index, RoutingPolicy("prefix"), AdmissionQueue(0, 1.0))

    prompts = []
    for _ in range(args.decisions):
        shared = rng.randrange(0, args.prompt_blocks + 1)
        base = rng.choice(chains)[:shared * BS]
        prompts.append(base + [rng.randrange(49152) for _ in range(args.prompt_blocks * BS - len(base))])
    prehashed = [hash_full_blocks(p, BS) for p in prompts]

    del chains, held
    gc.collect()  # the benchmark's own garbage; the index itself is not GC-tracked
    decide, total = [], []
    for prompt, hashes in zip(prompts, prehashed, strict=True):
        t0 = time.perf_counter()
        selector.pick_prefill(len(prompt), hashes)
        t1 = time.perf_counter()
        selector.pick_prefill(len(prompt), selector.block_hashes(prompt))
        t2 = time.perf_counter()
        decide.append(t1 - t0)
        total.append(t2 - t1)
    result = {"settings": vars(args), "indexed_blocks": len(index._holders), "index_entries": entries,
              "index_gc_tracked": any(gc.is_tracked(w.hashes) for w in index._workers.values())
              or gc.is_tracked(index._holders),
              "build_s": build_s}
    for name, xs in (("decision", decide), ("hash_and_decision", total)):
        ms = np.array(xs) * 1000
        result[name] = {"mean_ms": float(ms.mean()), "p50_ms": float(np.percentile(ms, 50)),
                        "p99_ms": float(np.percentile(ms, 99)), "max_ms": float(ms.max())}
    print(f"index: {result['indexed_blocks']:,} distinct blocks, {entries:,} (worker, block) entries over "
          f"{args.num_workers} workers (built in {build_s:.1f} s); prompts of {args.prompt_blocks} blocks")
    print("| path | mean ms | p50 ms | p99 ms | max ms |\n|---|---:|---:|---:|---:|")
    for name in ("decision", "hash_and_decision"):
        r = result[name]
        print(f"| {name} | {r['mean_ms']:.3f} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['max_ms']:.3f} |")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
