"""One layer's decode attention over a bf16 and an fp8 KV cache: the C++ CPU kernel against torch's
gather + SDPA path (issue 17: which path fp8 decodes take on CPU).

  PYTHONPATH=. .venv/bin/python bench/kv_fp8_decode_micro.py --seqs 16 --context 512
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.attention import AttentionMetadata  # noqa: E402
from engine.attention.torch_paged import TorchPagedAttention  # noqa: E402


def time_forward(backend: TorchPagedAttention, cache_dtype: torch.dtype, args) -> float:
    """Median seconds of one decode step (the new tokens' K/V write included)."""
    torch.manual_seed(0)
    bs, hkv, d = 16, args.kv_heads, args.head_dim
    num_blocks = args.seqs * args.context // bs
    tables = torch.randperm(num_blocks).view(args.seqs, -1)
    meta = AttentionMetadata(slot_blocks=tables[:, -1], slot_offsets=torch.full((args.seqs,), bs - 1), prefills=[],
                             decode_token_indices=torch.arange(args.seqs), decode_block_tables=tables,
                             decode_seq_lens=torch.full((args.seqs,), args.context))
    q = torch.randn(args.seqs, args.heads, d, dtype=torch.bfloat16)
    k = torch.randn(args.seqs, hkv, d, dtype=torch.bfloat16)
    k_cache = torch.randn(num_blocks, bs, hkv, d).to(cache_dtype)
    v_cache = k_cache.clone()
    times = []
    for i in range(args.warmup + args.repeats):
        start = time.perf_counter()
        backend.forward(q, k, k, k_cache, v_cache, meta, (1.0, 1.0))
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--context", type=int, default=512, help="tokens of context per sequence (a multiple of 16)")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    scale = args.head_dim ** -0.5
    paths = {"C++ decode kernel": TorchPagedAttention(args.heads, args.kv_heads, args.head_dim, scale),
             "torch gather + SDPA": TorchPagedAttention(args.heads, args.kv_heads, args.head_dim, scale,
                                                        use_cpu_kernel=False)}
    print(f"{'path':<22} {'bf16 cache ms':>14} {'fp8 cache ms':>13}   (median of {args.repeats})")
    for name, backend in paths.items():
        bf16, fp8 = (time_forward(backend, dtype, args) * 1e3 for dtype in (torch.bfloat16, torch.float8_e4m3fn))
        print(f"{name:<22} {bf16:>14.1f} {fp8:>13.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
