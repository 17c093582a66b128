"""Tune the Triton paged-attention kernel's launch tiles on this GPU and remember the fastest
(engine/attention/tile_table.py).

For one shape (dtype, head_dim, query and KV heads) and step kind, every candidate (BLOCK_M, TILE, num_warps,
num_stages) runs a representative step: `prefill` packs --seqs prompts of --query-len tokens after --context
tokens of cached context; `decode` --seqs sequences of one token at --context. A candidate whose output
differs from the default tiles' (beyond rounding) is dropped; the rest are timed with CUDA events (median of
--iters launches). Prints a table, writes JSON (--output) and, with --save, stores the fastest in the tiles
file the engine reads (PDSERVE_ATTENTION_TILES or ~/.cache/pdserve/attention-tiles.json).

  python3 bench/tune_attention_tiles.py --kind prefill --head-dim 64 --heads 32 --kv-heads 8 --save
  python3 bench/tune_attention_tiles.py --kind decode --seqs 128 --context 512 --heads 32 --kv-heads 8 --save

On CPU it runs under Triton's interpreter (TRITON_INTERPRET=1): the outputs are checked, the times mean
nothing, and --save is refused.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from engine.attention.tile_table import (  # noqa: E402
    DEFAULT_TILES,
    Tiles,
    fit_group,
    min_block_m,
    save_tiles,
    table_path,
    tile_key,
)
from engine.attention.triton_kernels import paged_attention  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def candidates(kind: str, group: int) -> list[Tiles]:
    """The grid searched: the default first."""
    if kind == "decode":
        grid = itertools.product((16, 32), (32, 64, 128), (2, 4, 8), (1, 2, 3))
    else:
        grid = itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (1, 2, 3))
    tiles = [fit_group(DEFAULT_TILES[kind], group)] + [Tiles(m, t, w, s) for m, t, w, s in grid
                                                       if m >= min_block_m(group)]
    return list(dict.fromkeys(tiles))


def make_step(args, dtype: torch.dtype, device: torch.device) -> dict:
    """A packed step over a shuffled paged cache (block size 16) with random K/V in every slot."""
    gen = torch.Generator().manual_seed(0)
    query_len = 1 if args.kind == "decode" else args.query_len
    totals = [args.context + query_len] * args.seqs
    need = [-(-t // 16) for t in totals]
    num_blocks = sum(need) + 1
    kv = torch.randn(num_blocks, 2, 16, args.kv_heads, args.head_dim, generator=gen).to(dtype).to(device)
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(need)
    tables = perm[:args.seqs * width].view(args.seqs, width).to(torch.int32).to(device)
    q = torch.randn(args.seqs * query_len, args.heads, args.head_dim, generator=gen).to(dtype).to(device)
    cu_q = torch.arange(args.seqs + 1, dtype=torch.int32, device=device) * query_len
    seq_lens = torch.tensor(totals, dtype=torch.int32, device=device)
    return dict(q=q, k_cache=kv[:, 0], v_cache=kv[:, 1], block_tables=tables, seq_lens=seq_lens, cu_q=cu_q,
                max_query_len=query_len, scale=args.head_dim ** -0.5)


def run(step: dict, tiles: Tiles) -> torch.Tensor:
    return paged_attention(step["q"], step["k_cache"], step["v_cache"], step["block_tables"], step["seq_lens"],
                           step["cu_q"], step["max_query_len"], step["scale"], kv_splits=1, tiles=tiles)


def time_ms(step: dict, tiles: Tiles, iters: int) -> float:
    """Median ms of one launch (CUDA events; wall time on CPU)."""
    times = []
    for _ in range(iters):
        if step["q"].is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(step, tiles)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            run(step, tiles)
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=("prefill", "decode"), default="prefill")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--query-len", type=int, default=1024, help="prefill: tokens computed per sequence")
    ap.add_argument("--context", type=int, default=1024, help="cached tokens before them")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--limit", type=int, default=None, help="try only the first N candidates (a quick check)")
    ap.add_argument("--save", action="store_true", help="store the fastest in the engine's tiles file (GPU only)")
    ap.add_argument("--output", default=str(ROOT / "bench" / "results" / "tune_attention_tiles.json"))
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.save and device.type != "cuda":
        ap.error("--save needs a CUDA GPU (interpreted timings mean nothing)")
    if args.heads % args.kv_heads:
        ap.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    dtype, group = DTYPES[args.dtype], args.heads // args.kv_heads
    step = make_step(args, dtype, device)
    tried = candidates(args.kind, group)[:args.limit]
    reference = run(step, tried[0]).float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    rows = []
    for tiles in tried:
        try:
            out = run(step, tiles).float()
        except Exception as exc:  # noqa: BLE001 - a candidate the compiler refuses (shared memory) is skipped
            rows.append({"tiles": asdict(tiles), "error": str(exc).splitlines()[0][:200]})
            continue
        if not torch.allclose(out, reference, atol=tol, rtol=tol):
            rows.append({"tiles": asdict(tiles), "error": "output differs from the default tiles'"})
            continue
        rows.append({"tiles": asdict(tiles), "ms": time_ms(step, tiles, args.iters)})
    timed = [r for r in rows if "ms" in r]
    best = min(timed, key=lambda r: r["ms"])
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(f"{args.kind} attention tiles on {device_name}, {args.dtype}, head_dim {args.head_dim}, "
          f"{args.heads}/{args.kv_heads} heads, {args.seqs} seqs x {step['max_query_len']} new after {args.context}")
    print(f"{'BLOCK_M':>7} {'TILE':>5} {'warps':>5} {'stages':>6} {'ms':>9}  vs default")
    default_ms = rows[0].get("ms")  # the default tiles' (None if they failed)
    for r in rows:
        t = r["tiles"]
        speed = f"{default_ms / r['ms']:.2f}x" if "ms" in r and default_ms else r.get("error", "")
        ms = f"{r['ms']:9.3f}" if "ms" in r else f"{'-':>9}"
        print(f"{t['block_m']:>7} {t['tile']:>5} {str(t['num_warps']):>5} {str(t['num_stages']):>6} {ms}  {speed}")
    key = tile_key(device_name, args.kind, dtype, args.head_dim, group)
    print(f"fastest: {best['tiles']} ({best['ms']:.3f} ms); key {key}")
    if args.save:
        save_tiles(table_path(), key, Tiles(**best["tiles"]))
        print(f"saved to {table_path()}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"config": vars(args), "device": device_name, "key": key,
                                             "best": best, "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
