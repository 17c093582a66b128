"""KV blocks held by sequences four windows long: a pure sliding-window model against full attention.

Runs the engine's own scheduler and KV cache manager (engine/scheduler.py, engine/kv_cache_manager.py;
no model, no torch, a fake sampler): --num-seqs sequences whose prompts are 4 x --window tokens (random,
no shared prefix) plus --output-len generated tokens, chunked prefill under --budget tokens per step.

  window   every layer slides (Mistral v0.1: window 4096; Phi-3-mini-4k: 2047): each step releases the blocks
           behind every sequence's window (KVCacheManager(sliding_window=...))
  full     the same model under full attention: every block stays until the sequence ends
  hybrid   some layers slide, some are full (gpt-oss and Gemma 2 alternate, --hybrid-full-fraction 0.5):
           the engine keeps one block table for all layers, so it holds exactly what `full` holds (not run
           again); "hybrid, per-layer groups" is what an allocator giving the sliding layers their own
           blocks (vLLM's hybrid allocator) would hold: computed, the full layers' share of `full` plus the
           sliding layers' share of `window`

Memory: a pool large enough for every sequence under full attention; blocks in use after each step (peak,
and the mean over steps where every sequence decodes), and their bytes for Mistral-7B-v0.1's KV (32 layers
x K/V x 8 KV heads x 128 x bf16 = 128 KiB per token, 2 MiB per 16-token block). Capacity: a pool of
--pool-gib of those bytes and --capacity-seqs such sequences waiting at once, each generating
--capacity-output-len tokens (long enough for sequences to pile up behind the prefill budget): how many run
together at most, preemptions, and engine steps to finish them all.

  PYTHONPATH=. .venv/bin/python bench/sliding_window_memory.py [--window 4096 --num-seqs 8]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import SchedulerConfig  # noqa: E402
from engine.kv_cache_manager import KVCacheManager  # noqa: E402
from engine.request import FinishReason, Request  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402

MISTRAL_7B_TOKEN_BYTES = 32 * 2 * 8 * 128 * 2
"""Mistral-7B-v0.1's KV per token: layers x K/V x KV heads x head dim x bf16 bytes."""


def simulate(window: int | None, num_blocks: int, num_seqs: int, output_len: int, args) -> dict:
    """Run `num_seqs` sequences through the scheduler; block counts and steps."""
    kv = KVCacheManager(num_blocks, args.block_size, enable_prefix_caching=True, sliding_window=window)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=args.budget, max_num_seqs=args.max_seqs), kv)
    rng = random.Random(args.seed)
    prompt_len = 4 * args.window
    for i in range(num_seqs):
        prompt = [rng.randrange(32000) for _ in range(prompt_len)]
        sched.add_request(Request(f"s{i}", prompt, SamplingParams(max_tokens=output_len, ignore_eos=True)))
    peak = steps = max_running = 0
    all_decoding: list[int] = []
    started = time.perf_counter()
    while sched.has_unfinished():
        out = sched.schedule()
        steps += 1
        sampling = [item.request for item in out.scheduled if item.samples]
        sched.finish_step(out)
        used = kv.pool.num_used_blocks
        peak = max(peak, used)
        max_running = max(max_running, sched.num_running)
        if len(out.scheduled) == num_seqs and all(item.num_new_tokens == 1 for item in out.scheduled):
            all_decoding.append(used)
        for request in sampling:
            request.append_token(rng.randrange(32000))
            if request.num_output_tokens >= request.params.max_tokens:
                sched.finish(request, FinishReason.LENGTH)
    assert kv.pool.num_used_blocks == 0 and not kv.block_tables, "blocks leaked"
    return {"peak_blocks": peak, "decoding_blocks": sum(all_decoding) / len(all_decoding) if all_decoding else None,
            "max_running": max_running, "preemptions": sched.num_preemptions, "steps": steps,
            "released_blocks": kv.num_window_released, "seconds": round(time.perf_counter() - started, 2)}


def gib(num_blocks: float | None, block_bytes: int) -> float | None:
    return None if num_blocks is None else round(num_blocks * block_bytes / 2**30, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-seqs", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens (prefill chunk)")
    parser.add_argument("--max-seqs", type=int, default=256)
    parser.add_argument("--hybrid-full-fraction", type=float, default=0.5,
                        help="the share of full-attention layers of the hybrid model (gpt-oss: 0.5, Gemma 3: 1/6)")
    parser.add_argument("--pool-gib", type=float, default=16.0)
    parser.add_argument("--capacity-seqs", type=int, default=48)
    parser.add_argument("--capacity-output-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="bench/results/sliding_window_memory.json")
    args = parser.parse_args()
    block_bytes = MISTRAL_7B_TOKEN_BYTES * args.block_size
    seq_len = 4 * args.window + args.output_len
    roomy = args.num_seqs * -(-seq_len // args.block_size) + 2

    memory = {name: simulate(window, roomy, args.num_seqs, args.output_len, args)
              for name, window in (("window", args.window), ("full", None))}
    memory["hybrid"] = dict(memory["full"])
    share = args.hybrid_full_fraction
    memory["hybrid, per-layer groups"] = {
        key: share * memory["full"][key] + (1 - share) * memory["window"][key]
        for key in ("peak_blocks", "decoding_blocks")}
    pool_blocks = int(args.pool_gib * 2**30 // block_bytes)
    capacity = {name: simulate(window, pool_blocks, args.capacity_seqs, args.capacity_output_len, args)
                for name, window in (("window", args.window), ("full", None))}

    print(f"{args.num_seqs} sequences of {4 * args.window} prompt + {args.output_len} output tokens, window "
          f"{args.window}, block {args.block_size}, prefill chunk {args.budget}; Mistral-7B-v0.1 KV bytes "
          f"({block_bytes / 2**20:.0f} MiB per block)\n")
    print("| attention | peak blocks | peak GiB | blocks while all decode | GiB while all decode |")
    print("|---|---:|---:|---:|---:|")
    for name, row in memory.items():
        decoding = row["decoding_blocks"]
        print(f"| {name} | {row['peak_blocks']:.0f} | {gib(row['peak_blocks'], block_bytes)} | "
              f"{'-' if decoding is None else f'{decoding:.0f}'} | {gib(decoding, block_bytes)} |")
    print(f"\nCapacity: {args.capacity_seqs} sequences of {4 * args.window} prompt + {args.capacity_output_len} "
          f"output tokens waiting, a pool of {args.pool_gib:g} GiB ({pool_blocks} blocks)\n")
    print("| attention | most running at once | preemptions | engine steps | blocks released |")
    print("|---|---:|---:|---:|---:|")
    for name, row in capacity.items():
        print(f"| {name} | {row['max_running']} | {row['preemptions']} | {row['steps']} | {row['released_blocks']} |")
    print("| hybrid | as full | | | |")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"args": vars(args), "block_bytes": block_bytes, "memory": memory,
                                             "pool_blocks": pool_blocks, "capacity": capacity}, indent=1))


if __name__ == "__main__":
    main()
